"""Replica processes of `reprise serve` (tiny model) on one private Redis, over loopback gRPC: a turn
decoded on one replica is drafted from on another (figures from the admin plane), and a deletion on one
replica stops the tenant on every replica with its keys gone from Redis."""

from __future__ import annotations

import time

import pytest
from cluster_helpers import start_replicas, wait_for

from grpc_api.client import AdminClient, RepriseClient, RepriseError

pytestmark = pytest.mark.redis

PROMPT = list(b"Plan: search flights SFO to JFK, then book the cheapest one for P1001.")


def _stats(target: str, admin_key: str, tenant: str):
    with AdminClient(target, admin_key) as admin:
        return admin.index_stats(tenant)[0]


def test_turn_on_one_replica_drafts_on_another_and_deletion_reaches_all(deployment) -> None:
    d = deployment
    acme, acme_key = d.tenants["acme"]
    globex, globex_key = d.tenants["globex"]
    a, b = start_replicas(2, d.workdir, d.redis.url, d.env)
    try:
        # B holds acme (its first request loads it), then A decodes a turn of acme.
        with RepriseClient(b.target, acme_key) as cb:
            cb.generate(tokens=list(b"warm up"), max_new_tokens=8, session_id="warm")
        wait_for(lambda: _stats(b.target, d.admin_key, acme).index_sequences == 1, timeout=10)
        with RepriseClient(a.target, acme_key) as ca:
            done_a = ca.generate(tokens=PROMPT, max_new_tokens=96, ignore_eos=True, session_id="task-1")
        assert len(done_a.token_ids) == 96
        # It reaches B's in-memory index through the stream, without B loading anything again.
        delay = wait_for(lambda: _stats(b.target, d.admin_key, acme).index_sequences == 2, timeout=5)
        assert delay < 1.0
        # B drafts the same turn from it: same output (the model's), far more accepted draft tokens than
        # for globex, which has no history (same prompt, same replica).
        with RepriseClient(b.target, acme_key) as cb:
            done_b = cb.generate(tokens=PROMPT, max_new_tokens=96, ignore_eos=True, session_id="task-2")
        with RepriseClient(b.target, globex_key) as cg:
            done_g = cg.generate(tokens=PROMPT, max_new_tokens=96, ignore_eos=True, session_id="task-2")
        assert done_b.token_ids == done_a.token_ids == done_g.token_ids
        with AdminClient(b.target, d.admin_key) as admin:
            on_b = {s.tenant_id: s for s in admin.index_stats()}
        assert on_b[acme].num_accepted_tokens >= 80  # nearly the whole 96-token turn came from A's
        assert on_b[acme].num_accepted_tokens > on_b[globex].num_accepted_tokens + 40
        assert on_b[acme].num_steps < on_b[globex].num_steps

        # Deleting acme on A: B refuses its requests within the propagation delay, and Redis holds no
        # key of it (its snapshot, stream, records, lease included).
        with AdminClient(a.target, d.admin_key) as admin:
            admin.delete_tenant(acme, confirm=acme)
        t0 = time.monotonic()

        def refused_on_b() -> bool:
            try:
                with RepriseClient(b.target, acme_key) as cb:
                    cb.generate(tokens=PROMPT, max_new_tokens=4)
                return False
            except RepriseError as exc:
                return exc.code.name == "UNAUTHENTICATED"

        wait_for(refused_on_b, timeout=5, interval=0.02)
        assert time.monotonic() - t0 < 2.0
        with d.store() as store:
            raw = store.storage.r
            assert not [k for k in raw.scan_iter(match="*") if acme.encode() in k]
        with AdminClient(b.target, d.admin_key) as admin:
            assert acme not in {s.tenant_id for s in admin.index_stats()}
    finally:
        for r in (a, b):
            r.stop()
