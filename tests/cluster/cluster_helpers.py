"""Helpers of the cluster tests: private redis-servers (single, AOF, or a three-master Cluster) on free
loopback ports, replica processes of `reprise serve` with the tiny model, and a store handle for
checking what Redis holds. Nothing here touches the shared Redis at 127.0.0.1:6379."""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (and, with ``with_bus``, port + 10000 free too: the Cluster bus)."""
    rng = random.Random()
    while True:
        p = rng.randrange(20000, 45000)
        try:
            for q in (p, p + 10000) if with_bus else (p,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        return p


def require_redis_server() -> None:
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        pytest.skip("redis-server/redis-cli not installed")


def master_env() -> dict[str, str]:
    return {"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}


class RedisServer:
    """A redis-server of our own; ``appendfsync`` None turns persistence off."""

    def __init__(self, workdir: Path, appendfsync: str | None = "always", cluster: bool = False) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(with_bus=cluster)
        self.appendfsync = appendfsync
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--protected-mode", "yes"]
        if self.appendfsync:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.ping():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def ping(self) -> bool:
        out = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True, check=False)
        return out.stdout.strip() == "PONG"

    def kill(self) -> None:
        """SIGKILL: what a crash of redis-server loses depends on appendfsync (docs/cluster.md)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None


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
    from privacy import StoreConfig

    return StoreConfig(backend="redis", redis_url=redis_url, redis_cluster=cluster, data_dir=data_dir)


class Replica:
    """A replica process (`python -m reprise.cluster.launch --tiny ...`)."""

    def __init__(self, name: str, home: Path, redis_url: str, env: dict[str, str], cluster: bool = False,
                 **settings: str) -> None:
        self.name = name
        flags = {"home": str(home), "grpc-port": "0", "http-port": "0", "store-backend": "redis",
                 "store-redis-url": redis_url, "cluster-replica-id": name, "model-num-slots": "4",
                 "model-max-len": "2048", "cluster-resync-interval-s": "1", "grace-seconds": "1", **settings}
        args = [sys.executable, "-m", "reprise.cluster.launch", "--tiny", "--cluster-enabled",
                "--log-level", "INFO"] + (["--store-redis-cluster"] if cluster else [])
        for k, v in flags.items():
            args += [f"--{k}", v]
        self.log = home.parent / f"{name}.log"
        home.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "REPRISE_HOME": str(home)}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=self.log.open("w"), text=True)
        self.port = 0
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.port = json.loads(line)["grpc_port"]
                self._ready.set()

    def wait_ready(self, timeout: float = 180) -> Replica:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.name} did not start:\n{self.log.read_text()[-3000:]}")
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_replicas(n: int, workdir: Path, redis_url: str, env: dict[str, str], cluster: bool = False,
                   **settings: str) -> list[Replica]:
    """``n`` replicas started together (they load the model in parallel), each ready."""
    reps = [Replica(f"r{i}", workdir / f"r{i}" / "home", redis_url, env, cluster, **settings) for i in range(n)]
    try:
        for r in reps:
            r.wait_ready()
    except BaseException:
        for r in reps:
            r.stop()
        raise
    return reps


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.01) -> float:
    """Seconds until ``predicate()`` holds; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0
