"""Helpers of the cluster tests: private redis-servers (single, AOF, or a three-master Cluster) on free
loopback ports, replica processes of `reprise serve` with the tiny model (``reprise.cluster.launch``),
and waiting. Nothing here touches the shared Redis at 127.0.0.1:6379."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from privacy import StoreConfig
from reprise.cluster import launch
from reprise.cluster.launch import RedisProcess as RedisServer
from reprise.cluster.launch import ReplicaProcess


def require_redis_server() -> None:
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        pytest.skip("redis-server/redis-cli not installed")


def master_env() -> dict[str, str]:
    return {"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}


def start_redis_cluster(workdir: Path, num_masters: int = 3) -> list[RedisServer]:
    """Three (or ``num_masters``) cluster-mode redis-servers joined into one Cluster, state ok."""
    nodes = [RedisServer(workdir / f"node{i}", appendfsync=None, cluster=True).start() for i in range(num_masters)]
    subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                    "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, check=True)
    for _ in range(100):
        info = subprocess.run(["redis-cli", "-p", str(nodes[0].port), "cluster", "info"], capture_output=True,
                              text=True, check=False).stdout
        if "cluster_state:ok" in info:
            return nodes
        time.sleep(0.1)
    raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")


def store_config(redis_url: str, data_dir: Path, cluster: bool = False) -> Any:
    return StoreConfig(backend="redis", redis_url=redis_url, redis_cluster=cluster, data_dir=data_dir)


def start_replicas(n: int, workdir: Path, redis_url: str, env: dict[str, str], cluster: bool = False,
                   **settings: str) -> list[ReplicaProcess]:
    """``n`` tiny-model replicas started together, each ready (resync every second, 4 slots)."""
    settings = {"model-num-slots": "4", "model-max-len": "2048", "cluster-resync-interval-s": "1",
                "model-num-threads": "1", **settings}  # replicas on one host: a core each, not every core each
    return launch.start_replicas(n, workdir, redis_url, env, cluster=cluster, **settings)


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.01) -> float:
    """Seconds until ``predicate()`` holds; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0
