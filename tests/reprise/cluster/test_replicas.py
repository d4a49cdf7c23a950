"""Replica processes of `reprise serve` (tiny model) on one private Redis, over loopback gRPC: a turn
decoded on one replica is drafted from on another (figures from the admin plane), and a deletion on one
replica stops the tenant on every replica with its keys gone from Redis."""

from __future__ import annotations

import time

import pytest
import redis
from testkit.cluster import (
    master_env,
    require_redis_server,
    start_redis_cluster,
    start_replicas,
    store_config,
    wait_for,
)

from grpc_api.client import AdminClient, RepriseClient, RepriseError
from privacy import open_store

pytestmark = pytest.mark.redis

PROMPT = list(b"Plan: search flights SFO to JFK, then book the cheapest one for P1001.")


def _stats(target: str, admin_key: str, tenant: str):
    with AdminClient(target, admin_key) as admin:
        return admin.index_stats(tenant)[0]


def scenario(a, b, admin_key: str, tenants: dict[str, tuple[str, str]], raw_nodes: list) -> None:
    """A turn decoded on A is drafted from on B; a deletion on A stops the tenant on B, keys gone."""
    acme, acme_key = tenants["acme"]
    globex, globex_key = tenants["globex"]
    # B holds acme (its first request loads it), then A decodes a turn of acme.
    with RepriseClient(b.target, acme_key) as cb:
        cb.generate(tokens=list(b"warm up"), max_new_tokens=8, session_id="warm")
    wait_for(lambda: _stats(b.target, admin_key, acme).index_sequences == 1, timeout=10)
    with RepriseClient(a.target, acme_key) as ca:
        done_a = ca.generate(tokens=PROMPT, max_new_tokens=96, ignore_eos=True, session_id="task-1")
    assert len(done_a.token_ids) == 96
    # It reaches B's in-memory index through the stream, without B loading anything again.
    delay = wait_for(lambda: _stats(b.target, admin_key, acme).index_sequences == 2, timeout=5)
    assert delay < 1.0
    # B drafts the same turn from it: same output (the model's), far more accepted draft tokens than
    # for globex, which has no history (same prompt, same replica).
    with RepriseClient(b.target, acme_key) as cb:
        done_b = cb.generate(tokens=PROMPT, max_new_tokens=96, ignore_eos=True, session_id="task-2")
    with RepriseClient(b.target, globex_key) as cg:
        done_g = cg.generate(tokens=PROMPT, max_new_tokens=96, ignore_eos=True, session_id="task-2")
    assert done_b.token_ids == done_a.token_ids == done_g.token_ids
    with AdminClient(b.target, admin_key) as admin:
        on_b = {s.tenant_id: s for s in admin.index_stats()}
    assert on_b[acme].num_accepted_tokens >= 80  # nearly the whole 96-token turn came from A's
    assert on_b[acme].num_accepted_tokens > on_b[globex].num_accepted_tokens + 40
    assert on_b[acme].num_steps < on_b[globex].num_steps

    # Deleting acme on A while a long stream of acme runs on B: B aborts it, refuses acme's requests
    # within the propagation delay, and no Redis node holds a key of acme (snapshot, stream, records,
    # lease included).
    running = RepriseClient(b.target, acme_key)
    stream = running.generate_stream(tokens=PROMPT, max_new_tokens=1500, ignore_eos=True)
    chunks = iter(stream)
    next(chunks)  # it is in flight on B
    with AdminClient(a.target, admin_key) as admin:
        admin.delete_tenant(acme, confirm=acme)
    t0 = time.monotonic()
    streamed = 1 + sum(1 for _ in chunks)
    assert stream.completion is not None and stream.completion.finish_reason == "aborted"
    assert streamed < 1500
    running.close()

    def refused_on_b() -> bool:
        try:
            with RepriseClient(b.target, acme_key) as cb:
                cb.generate(tokens=PROMPT, max_new_tokens=4)
            return False
        except RepriseError as exc:
            return exc.code.name == "UNAUTHENTICATED"

    wait_for(refused_on_b, timeout=5, interval=0.02)
    assert time.monotonic() - t0 < 2.0
    for node in raw_nodes:
        assert not [k for k in node.scan_iter(match="*") if acme.encode() in k]
    with AdminClient(b.target, admin_key) as admin:
        assert acme not in {s.tenant_id for s in admin.index_stats()}
        assert globex in {s.tenant_id for s in admin.index_stats()}


def test_turn_on_one_replica_drafts_on_another_and_deletion_reaches_all(deployment) -> None:
    d = deployment
    a, b = start_replicas(2, d.workdir, d.redis.url, d.env)
    try:
        scenario(a, b, d.admin_key, d.tenants, [redis.Redis(port=d.redis.port)])
    finally:
        for r in (a, b):
            r.stop()


@pytest.mark.slow
def test_the_same_on_a_redis_cluster_of_three_masters(tmp_path) -> None:
    require_redis_server()
    nodes = start_redis_cluster(tmp_path / "cluster")
    env = master_env()
    url = f"redis://127.0.0.1:{nodes[0].port}/0"
    try:
        with open_store(store_config(url, tmp_path / "setup", cluster=True), env=env) as store:
            admin_key = store.create_admin_key().secret
            tenants = {}
            for name in ("acme", "globex"):
                t = store.create_tenant(name)
                tenants[name] = (t.id.value, store.create_api_key(t.id).secret)
        a, b = start_replicas(2, tmp_path, url, env, cluster=True)
        try:
            raw = [redis.Redis(port=n.port) for n in nodes]
            scenario(a, b, admin_key, tenants, raw)
            slots = {raw[0].cluster("keyslot", k) for n in raw for k in n.scan_iter(match="*")
                     if tenants["globex"][0].encode() in k}
            assert len(slots) == 1  # every key of a tenant (feed lease, snapshot, stream) in one slot
        finally:
            for r in (a, b):
                r.stop()
    finally:
        for n in nodes:
            n.stop()
