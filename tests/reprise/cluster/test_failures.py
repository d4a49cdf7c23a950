"""Failures survived, with replica processes on a private redis-server (AOF, ``appendfsync always``):
``kill -9`` of a replica mid-stream, and redis-server killed and restarted under load (recorded replies
wait for their turns to be stored, and go out once Redis is back)."""

from __future__ import annotations

import threading
import time

import pytest
from testkit.cluster import start_replicas, wait_for

from grpc_api.client import AdminClient, RepriseClient, RepriseError
from privacy import TenantId

pytestmark = pytest.mark.slow

PROMPTS = [list(f"Step {i}: call get_reservation for R{1000 + i}, then report the fare.".encode()) for i in range(4)]


def _stored_turns(d, tenant: str) -> list[list[int]]:
    with d.store() as store:
        return [list(map(int, r.trajectory.token_ids)) for r in store.iter_trajectories(TenantId(tenant))]


def _index_sequences(target: str, admin_key: str, tenant: str) -> int:
    with AdminClient(target, admin_key) as admin:
        return admin.index_stats(tenant)[0].index_sequences


def test_kill_9_of_a_replica_mid_stream(deployment) -> None:
    d = deployment
    acme, key = d.tenants["acme"]
    a, b = start_replicas(2, d.workdir, d.redis.url, d.env)
    try:
        acked = [list(f"OBSERVATION {i}: seat 12{i} is free.".encode()) for i in range(5)]
        with RepriseClient(a.target, key) as ca:
            for i, turn in enumerate(acked):
                assert ca.append_trajectory(f"tool-{i}", tokens=turn) == len(turn)
            stream = ca.generate_stream(tokens=PROMPTS[0], max_new_tokens=400, ignore_eos=True, session_id="long")
            received: list[int] = []
            with pytest.raises(RepriseError) as failure:
                for chunk in stream:
                    received += chunk.token_ids
                    if len(received) >= 8:
                        a.kill9()  # mid-stream: the server process vanishes
        assert failure.value.code.name == "UNAVAILABLE"
        assert 8 <= len(received) < 400
        # The client retries on B: the output is the model's, and what A streamed was its prefix.
        with RepriseClient(b.target, key) as cb:
            retried = cb.generate(tokens=PROMPTS[0], max_new_tokens=400, ignore_eos=True, session_id="long")
            reference = cb.generate(tokens=PROMPTS[0], max_new_tokens=400, ignore_eos=True, speculation=False,
                                    do_not_record=True)
        assert retried.token_ids == reference.token_ids
        assert retried.token_ids[:len(received)] == received
        # Every turn A acknowledged before the kill is stored, and B drafts from all of them.
        stored = _stored_turns(d, acme)
        assert all(turn in stored for turn in acked)
        wait_for(lambda: _index_sequences(b.target, d.admin_key, acme) == len(_stored_turns(d, acme)), timeout=10)
    finally:
        for r in (a, b):
            r.stop()


def test_redis_killed_and_restarted_under_load(deployment) -> None:
    d = deployment
    acme, key = d.tenants["acme"]
    a, b = start_replicas(2, d.workdir, d.redis.url, d.env)
    try:
        clients = {r.name: RepriseClient(r.target, key) for r in (a, b)}
        # The model's outputs, and both replicas holding acme with its key verified once.
        reference = [clients["r1"].generate(tokens=p, max_new_tokens=48, ignore_eos=True, speculation=False,
                                            do_not_record=True).token_ids for p in PROMPTS]
        for c in clients.values():
            c.generate(tokens=list(b"warm up"), max_new_tokens=8, session_id="warm")
        clients["r0"].append_trajectory("tool-0", tokens=list(b"OBSERVATION: acknowledged before the crash"))
        wait_for(lambda: _index_sequences(a.target, d.admin_key, acme) == 3, timeout=10)
        wait_for(lambda: _index_sequences(b.target, d.admin_key, acme) == 3, timeout=10)
        before = _stored_turns(d, acme)

        d.redis.kill()  # a crash: with appendfsync always nothing acknowledged is lost
        outputs: dict[tuple[str, int], list[int]] = {}
        errors: list[BaseException] = []

        def serve(name: str) -> None:
            try:
                for i, p in enumerate(PROMPTS):
                    outputs[(name, i)] = clients[name].generate(tokens=p, max_new_tokens=48, ignore_eos=True,
                                                                session_id=f"outage-{name}").token_ids
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=serve, args=(name,)) for name in clients]
        for t in threads:
            t.start()
        with pytest.raises(RepriseError) as refused:  # a write cannot be acknowledged: reported
            clients["r0"].append_trajectory("tool-1", tokens=list(b"OBSERVATION: during the outage"))
        assert refused.value.code.name == "UNAVAILABLE"
        # A request that keeps nothing is served during the outage; a recorded one's reply waits until its
        # turn is stored (server.store_before_reply), so none of them has been answered yet.
        assert clients["r1"].generate(tokens=PROMPTS[0], max_new_tokens=48, ignore_eos=True, speculation=False,
                                      do_not_record=True).token_ids == reference[0]
        time.sleep(1.0)
        assert not outputs and not errors

        d.redis.start()  # same port and directory: the AOF is replayed
        for t in threads:
            t.join(60)
        assert not errors
        assert all(outputs[(name, i)] == reference[i] for name in clients for i in range(len(PROMPTS)))
        assert _stored_turns(d, acme)[:len(before)] == before
        # Every answered turn is stored (4 per replica), and both replicas catch up on all of them.
        total = len(before) + 2 * len(PROMPTS)
        wait_for(lambda: len(_stored_turns(d, acme)) == total, timeout=30, interval=0.2)
        for r in (a, b):
            wait_for(lambda r=r: _index_sequences(r.target, d.admin_key, acme) == total, timeout=15, interval=0.1)
        for c in clients.values():
            c.close()
    finally:
        for r in (a, b):
            r.stop()
