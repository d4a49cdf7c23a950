"""A replica's parts through a Redis outage (a private redis-server with AOF ``appendfsync always``,
killed and restarted): writes wait and land, a bounded queue drops and counts, credentials answer
from the last verdict; and the ``[cluster]`` settings."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest
from testkit.cluster import RedisServer, master_env, require_redis_server, wait_for
from testkit.service import finished_turn

from privacy import StoreConfig, TenantId, open_store
from reprise.cluster.auth import ResilientAuthenticator
from reprise.cluster.node import ClusterNode
from reprise.cluster.writer import ReplicaWriter
from reprise.config import ClusterConfig, load_config
from reprise.engine.request import GenerationResult
from retrieval.proposer import RepriseProposer
from serving import errors


@pytest.fixture
def outage(tmp_path):
    require_redis_server()
    server = RedisServer(tmp_path / "redis", appendfsync="always").start()
    config = StoreConfig(backend="redis", redis_url=server.url, data_dir=tmp_path,
                         redis_key_prefix=f"t-{secrets.token_hex(4)}")
    env = master_env()
    stores = []

    def store():
        s = open_store(config, env=env)
        stores.append(s)
        return s

    yield server, store
    server.start() if server.proc is None else None
    for s in stores:
        s.close()
    server.stop()


def _record(tenant: str, i: int) -> GenerationResult:
    out = tuple(int(x) for x in np.random.default_rng(i).integers(0, 250, 30))
    return finished_turn(tenant, "s", f"r{i}", (1, 2, 3), out)


def test_writes_wait_for_redis_and_land_once_it_is_back(outage) -> None:
    server, store = outage
    node = ClusterNode(ClusterConfig(enabled=True, replica_id="a"), store(), RepriseProposer())
    node.start()
    try:
        t = node.store.create_tenant("acme").id.value
        assert node.replica.ensure(t, 5)
        node.writer.put(_record(t, 0))
        assert node.writer.flush(10)
        server.kill()
        for i in range(1, 6):
            node.writer.put(_record(t, i))
        wait_for(lambda: node.writer.num_retries >= 2, timeout=10)
        assert not node.writer.flush(0.2)  # held back, not dropped
        server.start()  # the AOF is replayed: the acknowledged write is there
        assert node.writer.flush(20)
        assert node.writer.num_written == 6 and node.writer.num_dropped == 0
        assert node.store.count_trajectories(TenantId(t)) == 6
        wait_for(lambda: node.replica.proposer.index_stats(t).num_trajectories == 6, timeout=10)
    finally:
        node.writer.close(5)
        node.stop()


def test_a_full_queue_drops_and_counts_and_shutdown_reports_what_was_not_stored(outage) -> None:
    server, store = outage
    s = store()
    node = ClusterNode(ClusterConfig(enabled=True, replica_id="a"), s, RepriseProposer())
    writer = ReplicaWriter(s, node.replica, max_pending=3)
    t = s.create_tenant("acme").id.value
    server.kill()
    writer.put(_record(t, 0))
    wait_for(lambda: writer.num_retries >= 1)  # that one is being retried
    for i in range(1, 10):
        writer.put(_record(t, i))
    assert writer.num_dropped == 6 and writer.pending == 3
    writer.close(timeout=0.5)
    wait_for(lambda: writer.num_dropped == 10, timeout=10)
    assert writer.num_written == 0
    node.writer.close(1)
    node.stop()


def test_credentials_answer_from_the_last_verdict_while_the_store_is_down(outage) -> None:
    server, store = outage
    s = store()
    tenant = s.create_tenant("acme").id
    seen, unseen = s.create_api_key(tenant).secret, s.create_api_key(tenant).secret
    auth = ResilientAuthenticator(s, ttl_s=0.001)
    assert auth.authenticate(seen).id == tenant.value
    assert auth.authenticate("rpk_" + "0" * 16 + "_" + "A" * 43) is None
    server.kill()
    time.sleep(0.01)
    assert auth.authenticate(seen).id == tenant.value and auth.num_fallbacks == 1
    with pytest.raises(errors.Unavailable):
        auth.authenticate(unseen)  # never verified: no verdict to fall back on
    auth.forget_tenant(tenant.value)  # deleted or rotated elsewhere: nothing from memory
    with pytest.raises(errors.Unavailable):
        auth.authenticate(seen)
    server.start()
    assert auth.authenticate(unseen).id == tenant.value


def test_cluster_settings() -> None:
    c = load_config({"store.backend": "redis", "cluster.enabled": "true", "cluster.replica_id": "r-1",
                     "cluster.index_memory_bytes": str(2**30)}, env={})
    assert c.cluster.enabled and c.cluster.name == "r-1" and c.cluster.index_memory_bytes == 2**30
    assert ClusterConfig().name.endswith(f"-{__import__('os').getpid()}")
    with pytest.raises(ValueError, match="store.backend"):
        load_config({"cluster.enabled": "true"}, env={})
    env = {"REPRISE_STORE_BACKEND": "redis", "REPRISE_CLUSTER_SNAPSHOT_EVERY": "0"}
    with pytest.raises(ValueError, match="snapshot_every must be >= 1, got 0.*REPRISE_CLUSTER_SNAPSHOT_EVERY"):
        load_config({}, env=env)
    for bad, match in [({"replica_id": "a b"}, "replica_id"), ({"index_memory_bytes": -1}, "index_memory_bytes"),
                       ({"resync_interval_s": 0}, "resync_interval_s"), ({"load_wait_s": -1}, "load_wait_s"),
                       ({"feed_max_len": 10}, "feed_max_len"), ({"max_pending_writes": 0}, "max_pending_writes")]:
        with pytest.raises(ValueError, match=match):
            ClusterConfig(**bad)
