"""The Redis backend on a real three-master Redis Cluster on loopback (started and stopped here): every
operation of a tenant stays in its hash slot, deletion finds its keys on whichever node holds them."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

import pytest
from redis.cluster import RedisCluster

from privacy import StoreConfig, UnknownTenantError, open_store

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def _free_ports(n: int) -> list[int]:
    """Ports p where both p and the cluster bus port p + 10000 are free."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(20000, 45000)
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        ports.append(p)
    return ports


@pytest.fixture
def cluster(tmp_path):
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        pytest.skip("redis-server/redis-cli not installed")
    ports = _free_ports(3)
    procs = [
        subprocess.Popen(
            ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{p}.conf", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        for p in ports:
            for _ in range(50):
                if subprocess.run(["redis-cli", "-p", str(p), "ping"], capture_output=True, check=False).stdout:
                    break
                time.sleep(0.1)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, check=True)
        for _ in range(100):
            info = subprocess.run(["redis-cli", "-p", str(ports[0]), "cluster", "info"], capture_output=True,
                                  text=True, check=False).stdout
            if "cluster_state:ok" in info:
                break
            time.sleep(0.1)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def test_store_on_a_redis_cluster(cluster, tmp_path, master_env) -> None:
    config = StoreConfig(backend="redis", data_dir=tmp_path / "data", redis_url=f"redis://127.0.0.1:{cluster[0]}/0",
                         redis_cluster=True, chunk_bytes=4096)
    store = open_store(config, env=master_env)
    tenants = [store.create_tenant(f"t{i}").id for i in range(6)]  # spread over the three masters
    for t in tenants:
        store.append_trajectories(t, [])
        for i in range(5):
            store.append_trajectory(t, f"s{i % 2}", [1, 2, i], f"text {i}")
        store.put_snapshot(t, b"snapshot" * 2000)
        store.add_corpus_documents(t, [[1, 2]])
    key = store.create_api_key(tenants[0])
    assert store.authenticate(key.secret) == tenants[0]
    assert all(len(list(store.iter_trajectories(t, session_id="s1"))) == 2 for t in tenants)
    assert store.rotate_data_key(tenants[1]).num_records == 7
    assert store.get_snapshot(tenants[1]).data == b"snapshot" * 2000
    store.delete_tenant(tenants[2])
    with pytest.raises(UnknownTenantError):
        store.get_tenant(tenants[2])
    client = RedisCluster(host="127.0.0.1", port=cluster[0])
    slots = {client.keyslot(k) for k in client.scan_iter(match=f"reprise:{{t:{tenants[0].value}}}:*")}
    assert len(slots) == 1  # one tenant, one slot
    assert not [k for k in client.scan_iter(match="reprise:*") if tenants[2].value.encode() in k]
    store.close()
    again = open_store(config, env=master_env)
    assert [r.trajectory.text for r in again.iter_trajectories(tenants[5])] == [f"text {i}" for i in range(5)]
    again.close()
