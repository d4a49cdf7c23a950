"""The example deployment (deploy/cluster) says what the code does: its redis.conf and ACL user run a
replica's every operation on a real redis-server, its settings load, Envoy hashes on the documented
headers and health-checks the data plane."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from testkit.cluster import master_env, require_redis_server, wait_for
from testkit.service import finished_turn

from grpc_api.interceptors import DATA_PLANE
from privacy import StoreConfig, open_store
from privacy.changefeed import KIND_APPEND, open_feed
from reprise.cluster.launch import free_port
from reprise.cluster.node import ClusterNode
from reprise.config import ClusterConfig, env_name, load_config, settings
from retrieval.proposer import RepriseProposer

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "cluster"
yaml = pytest.importorskip("yaml")


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _acl_args(password: str) -> list[str]:
    """The redis-server command line of compose.yaml's redis service, password filled in."""
    command = _compose()["services"]["redis"]["command"]
    return [re.sub(r"\$\{REDIS_PASSWORD[^}]*\}", password, a) for a in command[2:]]


def test_redis_conf_and_its_acl_user_run_every_replica_operation(tmp_path) -> None:
    require_redis_server()
    port, password = free_port(), "s3cret-for-the-test"
    proc = subprocess.Popen(["redis-server", str(DEPLOY / "redis.conf"), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), *_acl_args(password)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nodes: list[ClusterNode] = []
    try:
        url = f"redis://reprise-svc:{password}@127.0.0.1:{port}/0"
        config = StoreConfig(backend="redis", redis_url=url, data_dir=tmp_path)
        env = master_env()
        deadline = time.monotonic() + 10
        while True:
            try:
                setup = open_store(config, env=env)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        out = subprocess.run(["redis-cli", "-p", str(port), "set", "reprise:x", "1"], capture_output=True, text=True,
                             check=False)
        assert "NOAUTH" in out.stdout + out.stderr  # the default user is off
        for name in ("a", "b"):
            node = ClusterNode(ClusterConfig(enabled=True, replica_id=name), open_store(config, env=env),
                               RepriseProposer())
            node.start()
            nodes.append(node)
        a, b = nodes
        t = setup.create_tenant("acme").id
        assert a.replica.ensure(t.value, 5) and b.replica.ensure(t.value, 5)
        out_ids = tuple(int(x) for x in np.random.default_rng(0).integers(0, 250, 30))
        a.writer.put(finished_turn(t.value, "s", "r", (1, 2), out_ids))
        a.writer.flush(10)
        wait_for(lambda: b.replica.proposer.index_stats(t.value).num_trajectories == 1)
        assert b.replica.seal_snapshot(t.value)  # lease (SET NX PX, GET, DEL) and blob writes
        assert setup.rotate_data_key(t).version == 2
        feed = open_feed(setup)
        assert feed.read(feed.publish(KIND_APPEND, t, "1-0"), block_ms=10) == []
        setup.delete_tenant(t)  # SCAN + UNLINK
        wait_for(lambda: t.value in b.replica.deleted)
        assert not [k for k in setup.storage.r.scan_iter(match="*") if t.value.encode() in k]
        with pytest.raises(Exception, match="no permissions"):
            setup.storage.r.config_get("appendfsync")  # no admin commands for the service user
        setup.close()
    finally:
        for n in nodes:
            n.writer.close(5)
            n.stop()
            n.store.close()
        proc.terminate()
        proc.wait(10)


def test_the_replicas_settings_load_and_name_only_known_variables(monkeypatch) -> None:
    known = {env_name(k) for k in settings()}
    compose = _compose()
    for name in ("reprise-1", "reprise-2", "reprise-3"):
        env = compose["services"][name]["environment"]
        assert set(env) <= known, set(env) - known
        assert env["REPRISE_CLUSTER_REPLICA_ID"] == name
    config = load_config(env={"REPRISE_STORE_REDIS_PASSWORD": "pw", "REPRISE_CLUSTER_REPLICA_ID": "reprise-1"},
                         config_file=DEPLOY / "reprise.toml")
    assert config.cluster.enabled and config.cluster.name == "reprise-1"
    assert config.store.backend == "redis" and config.store.redis.username == "reprise-svc"
    assert config.store.redis.password == "pw" and config.server.host == "0.0.0.0"
    redis_conf = (DEPLOY / "redis.conf").read_text()
    assert re.search(r"^appendonly yes$", redis_conf, re.MULTILINE) and re.search(r"^appendfsync everysec$", redis_conf, re.MULTILINE)
    assert re.search(r"^maxmemory-policy noeviction$", redis_conf, re.MULTILINE)


def test_envoy_hashes_on_session_then_tenant_and_checks_readiness() -> None:
    envoy = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    cluster = envoy["static_resources"]["clusters"][0]
    assert cluster["lb_policy"] == "RING_HASH"
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == DATA_PLANE
    hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert [(p["header"]["header_name"], p.get("terminal", False)) for p in route["hash_policy"]] == \
        [("x-reprise-session", True), ("authorization", False)]
    hosts = [e["endpoint"]["address"]["socket_address"]["address"]
             for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert hosts == [n for n in _compose()["services"] if n.startswith("reprise-")]
