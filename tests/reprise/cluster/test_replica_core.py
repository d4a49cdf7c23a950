"""Replicas in one process (no model): each ``ClusterNode`` has its own store connection and proposer,
all on one private redis-server. Appends fan out exactly once in stream order, cold starts read the
snapshot plus the tail, the memory budget evicts whole tenants, deletions and key rotations propagate,
lost announcements are caught by the resync, damaged records are skipped."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from testkit.cluster import RedisServer, master_env, require_redis_server, wait_for
from testkit.service import finished_turn

from privacy import StoreConfig, TenantId, open_store
from privacy.changefeed import KIND_APPEND, open_feed, purge_leftovers, stream_position
from privacy.envelope import sealed_version
from reprise.cluster.node import ClusterNode
from reprise.cluster.replica import SNAPSHOT_NAME
from reprise.config import ClusterConfig
from reprise.engine.request import GenerationResult
from reprise.server.metrics import ServiceMetrics
from retrieval.proposer import RepriseProposer


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendfsync=None).start()
    yield server.url
    server.stop()


class Cluster:
    """Nodes sharing one key prefix and master key; everything is closed by ``close``."""

    def __init__(self, redis_url: str, tmp: Path) -> None:
        self.config = StoreConfig(backend="redis", redis_url=redis_url, data_dir=tmp,
                                  redis_key_prefix=f"t-{secrets.token_hex(4)}")
        self.env = master_env()
        self.nodes: list[ClusterNode] = []
        self.setup = open_store(self.config, env=self.env)

    def node(self, name: str, start: bool = True, **settings) -> ClusterNode:
        store = open_store(self.config, env=self.env)
        node = ClusterNode(ClusterConfig(enabled=True, replica_id=name, **settings), store, RepriseProposer(),
                           ServiceMetrics())
        if start:
            node.start()
        self.nodes.append(node)
        return node

    def tenant(self, name: str = "acme") -> str:
        return self.setup.create_tenant(name).id.value

    def keys_of(self, tenant: str) -> list[bytes]:
        return [k for k in self.setup.storage.r.scan_iter(match=f"{self.config.redis_key_prefix}:*")
                if tenant.encode() in k]

    def close(self) -> None:
        for n in self.nodes:
            n.stop(wait=False)  # all listeners leave their blocking reads together
        for n in self.nodes:
            n.writer.close(5)
            n.stop()
            n.store.close()
        for k in self.setup.storage.r.scan_iter(match=f"{self.config.redis_key_prefix}:*"):
            self.setup.storage.r.unlink(k)
        self.setup.close()


@pytest.fixture
def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    c.close()


def turn(tenant: str, i: int, rng: np.random.Generator) -> GenerationResult:
    prompt = tuple(int(x) for x in rng.integers(0, 250, 24))
    output = tuple(int(x) for x in rng.integers(0, 250, 40))
    return finished_turn(tenant, f"s{i % 3}", f"r{i}", prompt, output)


def num_trajectories(node: ClusterNode, tenant: str) -> int:
    return node.replica.proposer.index_stats(tenant).num_trajectories


def test_appends_from_every_replica_reach_every_index_once_in_stream_order(cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    t = cluster.tenant()
    assert a.replica.ensure(t, 5) and b.replica.ensure(t, 5)
    rng = np.random.default_rng(1)
    records = [turn(t, i, rng) for i in range(60)]

    def write(node: ClusterNode, part: list[GenerationResult]) -> None:
        for r in part:
            node.writer.put(r)

    threads = [threading.Thread(target=write, args=(n, records[i::2])) for i, n in enumerate((a, b))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    a.writer.flush(10)
    b.writer.flush(10)
    wait_for(lambda: num_trajectories(a, t) == 60 and num_trajectories(b, t) == 60, timeout=10)
    # Same trajectories applied in the same (stream) order on both: byte-identical index state.
    assert a.replica.proposer.snapshot(t) == b.replica.proposer.snapshot(t)
    assert a.replica.cursor(t) == b.replica.cursor(t)
    # A replica drafts another's turn: the continuation of B's last output, drafted on A.
    last = records[-1]
    session = a.replica.proposer.begin(t, "fresh", list(last.request.prompt_ids) + list(last.token_ids[:8]))
    assert session.propose(16).token_ids.tolist() == list(last.token_ids[8:24])
    lag = a.metrics.lag_seconds.collect()[0].samples
    assert any(s.name.endswith("_count") and s.value > 0 for s in lag)


def test_cold_start_reads_the_snapshot_and_the_tail_and_equals_a_full_rebuild(cluster) -> None:
    a = cluster.node("a")
    t = cluster.tenant()
    a.replica.ensure(t, 5)
    rng = np.random.default_rng(2)
    for i in range(30):
        a.writer.put(turn(t, i, rng))
    a.writer.flush(10)
    assert a.replica.seal_snapshot(t)
    snap = a.store.get_snapshot(TenantId(t), SNAPSHOT_NAME)
    for i in range(30, 45):  # the tail after the snapshot
        a.writer.put(turn(t, i, rng))
    a.writer.flush(10)
    cold = cluster.node("cold", start=False)
    assert cold.replica.ensure(t, 10)
    held = dict(cold.replica.held_tenants())[t]
    assert held.source == "snapshot" and stream_position(held.cursor) > stream_position(snap.cursor)
    rebuilt = cluster.node("rebuilt", start=False)
    assert rebuilt.replica.ensure(t, 10, rebuild=True)
    assert num_trajectories(cold, t) == num_trajectories(rebuilt, t) == 45
    assert cold.replica.proposer.snapshot(t) == rebuilt.replica.proposer.snapshot(t) == a.replica.proposer.snapshot(t)


def test_snapshots_are_sealed_in_the_background_once_due(cluster) -> None:
    a = cluster.node("a", snapshot_every=10, snapshot_check_s=0.05)
    b = cluster.node("b", snapshot_every=10, snapshot_check_s=0.05)
    t = cluster.tenant()
    a.replica.ensure(t, 5)
    b.replica.ensure(t, 5)
    rng = np.random.default_rng(3)
    for i in range(12):
        a.writer.put(turn(t, i, rng))
    a.writer.flush(10)
    wait_for(lambda: a.store.get_snapshot(TenantId(t), SNAPSHOT_NAME) is not None, timeout=10)
    wait_for(lambda: dict(b.replica.held_tenants())[t].since_snapshot < 10, timeout=5)

    def written() -> float:  # the counter moves after the snapshot is stored and announced
        return sum(n.metrics.snapshots._value.get() for n in (a, b))

    wait_for(lambda: written() >= 1, timeout=5)
    time.sleep(0.5)  # ten upkeep checks on each replica: time for a second seal, were there one
    assert written() == 1  # one replica compacts; the other hears of it and does not


def test_memory_budget_evicts_least_recently_used_tenants_whole_and_reloads_them(cluster) -> None:
    a = cluster.node("a")
    tenants = [cluster.tenant(f"t{i}") for i in range(3)]
    rng = np.random.default_rng(4)
    for t in tenants:
        a.replica.ensure(t, 5)
        for i in range(20):
            a.writer.put(turn(t, i, rng))
    a.writer.flush(10)
    sizes = a.replica.memory_bytes()
    full = a.replica.proposer.snapshot(tenants[0])
    a.replica.config = ClusterConfig(enabled=True, replica_id="a", index_memory_bytes=int(sizes[tenants[0]] * 1.5))
    with a.replica.pinned(tenants[0]):  # in use: kept although least recently used
        assert a.replica.enforce_budget() == 1
    assert [t for t, _ in a.replica.held_tenants()] == [tenants[0], tenants[2]]
    assert tenants[1] not in a.replica.proposer.tenants()
    assert a.replica.ensure(tenants[1], 10)  # reloaded on demand (sealed at eviction, or rebuilt)
    assert num_trajectories(a, tenants[1]) == 20
    assert a.replica.ensure(tenants[0], 10) and a.replica.proposer.snapshot(tenants[0]) == full
    assert a.metrics.evictions._value.get() >= 1


def test_a_lost_announcement_is_caught_by_the_resync(cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    t = cluster.tenant()
    b.replica.ensure(t, 5)
    a.store.append_trajectory(TenantId(t), "s", [1, 2, 3, 4], num_prompt_tokens=1)  # no announcement
    assert num_trajectories(b, t) == 0
    assert b.replica.resync() == 1 and num_trajectories(b, t) == 1
    assert b.replica.resync() == 0  # nothing applied twice


def test_deletion_on_one_replica_reaches_every_replica_and_leaves_no_key(cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    t = cluster.tenant()
    gone: list[str] = []
    b.replica.on_tenant_gone(gone.append)
    for n in (a, b):
        n.replica.ensure(t, 5)
    a.writer.put(turn(t, 0, np.random.default_rng(5)))
    a.writer.flush(10)
    wait_for(lambda: num_trajectories(b, t) == 1)
    assert b.replica.seal_snapshot(t)
    a.store.delete_tenant(TenantId(t))
    wait_for(lambda: gone == [t])
    assert not b.replica.is_held(t) and t in b.replica.deleted
    with pytest.raises(KeyError):
        b.replica.proposer.history(t)  # tombstoned: no request can recreate its index
    assert cluster.keys_of(t) == []
    b.writer.put(turn(t, 1, np.random.default_rng(6)))  # a late request's turn: dropped
    b.writer.flush(5)
    assert cluster.keys_of(t) == []


def test_a_write_racing_a_deletion_is_cleaned_up(cluster) -> None:
    a = cluster.node("a")
    t = cluster.tenant()
    tid = TenantId(t)
    late = open_store(cluster.config, env=cluster.env)  # another process that still holds t's keys
    late.append_trajectory(tid, "s", [1, 2])
    a.store.delete_tenant(tid)
    late.append_trajectory(tid, "s", [3, 4])  # lands after the purge, sealed with a key now destroyed
    assert cluster.keys_of(t)
    with pytest.raises(ValueError):
        purge_leftovers(late, TenantId(cluster.tenant("alive")))
    assert purge_leftovers(late, tid) == 1 and cluster.keys_of(t) == []
    late.close()


def test_data_key_rotation_on_one_replica_reaches_the_others(cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    t = cluster.tenant()
    tid = TenantId(t)
    rng = np.random.default_rng(7)
    b.replica.ensure(t, 5)
    b.writer.put(turn(t, 0, rng))
    b.writer.flush(10)  # B has the tenant's keys cached now
    assert a.store.rotate_data_key(tid).version == 2
    wait_for(lambda: t not in b.store.keychain.cached_tenants())
    b.writer.put(turn(t, 1, rng))
    b.writer.flush(10)
    versions = [sealed_version(row.sealed, "trajectory") for row in a.store.storage.traj_scan(t, None, 10)]
    assert versions == [2, 2]  # B sealed its new turn under version 2
    assert len(list(a.store.iter_trajectories(tid))) == 2


def test_a_damaged_record_is_skipped_not_applied(cluster) -> None:
    a = cluster.node("a")
    t = cluster.tenant()
    tid = TenantId(t)
    for i in range(3):
        a.store.append_trajectory(tid, "s", [1, 2, 3, i], num_prompt_tokens=1)
    middle = a.store.storage.traj_scan(t, None, 3)[1]
    a.store.storage.traj_replace(t, [(middle.record_id, middle.sealed[:-1] + bytes([middle.sealed[-1] ^ 1]))])
    assert a.replica.ensure(t, 5)
    assert num_trajectories(a, t) == 2
    assert a.metrics.crypto_failures.labels(kind="trajectory")._value.get() == 1


def test_the_change_feed(cluster) -> None:
    feed = open_feed(cluster.setup)
    t = TenantId(cluster.tenant())
    start = feed.last_id()
    first = feed.publish(KIND_APPEND, t, "1-1", "a")
    events = feed.read(start, block_ms=0)
    assert [(e.id, e.kind, e.tenant, e.cursor, e.origin) for e in events] == [(first, "append", t.value, "1-1", "a")]
    assert feed.read(first, block_ms=50) == []
    assert feed.try_lease(t, "snapshot", "a", 5) and not feed.try_lease(t, "snapshot", "b", 5)
    feed.release_lease(t, "snapshot", "b")  # not b's: stays
    assert not feed.try_lease(t, "snapshot", "b", 5)
    feed.release_lease(t, "snapshot", "a")
    assert feed.try_lease(t, "snapshot", "b", 5)
    with pytest.raises(ValueError, match="kind"):
        feed.publish("nonsense", t)
    with pytest.raises(ValueError, match="cursor"):
        feed.read("yesterday")
    with pytest.raises(ValueError, match="ttl_s"):
        feed.try_lease(t, "snapshot", "a", 0)
    with pytest.raises(TypeError):
        feed.publish(KIND_APPEND, t.value)  # type: ignore[arg-type]
    assert stream_position("") < stream_position("0-1") < stream_position("5-0") < stream_position("12-0")


def test_the_feed_needs_redis(tmp_path) -> None:
    with open_store(StoreConfig(data_dir=tmp_path), env=master_env()) as store, \
            pytest.raises(ValueError, match="sqlite"):
        open_feed(store)
