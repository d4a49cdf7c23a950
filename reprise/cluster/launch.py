"""Processes for tests and ``reprise bench cluster``: a replica (``reprise serve`` with an optional tiny
random model, announcing its ports on stdout once it serves) and a private redis-server.

    python -m reprise.cluster.launch --tiny --home DIR --grpc-port 0 --store-backend redis \\
        --store-redis-url redis://127.0.0.1:6399/0 --cluster-enabled
    # stdout: {"ready": true, "grpc_port": 41234, "http_port": 0, "pid": 777}

Every ``reprise serve`` flag works (settings also from REPRISE_* and the TOML file). ``--tiny`` serves
``reprise.offline.tiny``'s random Llama (same seed, same weights, on every replica: outputs agree across
replicas). SIGTERM stops gracefully, as ``reprise serve`` does.

From Python: ``ReplicaProcess(...).wait_ready()``, ``start_replicas(n, ...)``, ``RedisProcess(dir).start()``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from reprise.config import add_config_arguments, config_from_args
from reprise.offline.tiny import tiny_loaded_model
from reprise.service import Service

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reprise.cluster.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="serve reprise.offline.tiny's random Llama")
    parser.add_argument("--tiny-seed", type=int, default=7, help="its seed (default 7)")
    parser.add_argument("--log-level", default="WARNING", help="log level on stderr (default WARNING)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return asyncio.run(_serve(config, args))


async def _serve(config, args: argparse.Namespace) -> int:
    model = None
    if args.tiny:
        model = tiny_loaded_model(args.tiny_seed)
    service = Service(config, model=model, model_name="tiny-llama" if args.tiny else "")
    await service.start()
    service.install_signal_handlers()
    print(json.dumps({"ready": True, "grpc_port": service.grpc_port, "http_port": service.http_port,
                      "pid": os.getpid()}), flush=True)
    await service.wait()
    return 0


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (with ``with_bus``, port + 10000 free too: a Redis Cluster bus port)."""
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


def _terminate(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, and SIGKILL if the process has not exited within ``grace_s`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class RedisProcess:
    """A redis-server of our own on a free loopback port; ``appendfsync`` None turns persistence off."""

    def __init__(self, workdir: Path, appendfsync: str | None = "always", cluster: bool = False) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(with_bus=cluster)
        self.appendfsync = appendfsync
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
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
        """SIGKILL: what a crash loses depends on ``appendfsync`` (docs/cluster.md)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            _terminate(self.proc, grace_s=10)
            self.proc = None


class ReplicaProcess:
    """``python -m reprise.cluster.launch --cluster-enabled ...`` in the background; ``settings`` are
    `reprise serve` flags without dashes (``{"model-num-slots": "4"}``)."""

    def __init__(self, name: str, home: Path, redis_url: str, env: dict[str, str], tiny: bool = True,
                 cluster: bool = False, **settings: str) -> None:
        self.name = name
        home = Path(home)
        flags = {"home": str(home), "grpc-port": "0", "http-port": "0", "store-backend": "redis",
                 "store-redis-url": redis_url, "cluster-replica-id": name, "grace-seconds": "1", **settings}
        args = [sys.executable, "-m", "reprise.cluster.launch", "--cluster-enabled", "--log-level", "INFO"]
        args += (["--tiny"] if tiny else []) + (["--store-redis-cluster"] if cluster else [])
        for k, v in flags.items():
            args += [f"--{k}", v]
        home.parent.mkdir(parents=True, exist_ok=True)
        self.log = home.parent / f"{name}.log"
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "REPRISE_HOME": str(home)}
        with self.log.open("w") as log_file:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=log_file,
                                         text=True)
        self.port = 0
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.port = json.loads(line)["grpc_port"]
                self._ready.set()

    def wait_ready(self, timeout: float = 300) -> ReplicaProcess:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.name} did not start:\n{self.log.read_text()[-3000:]}")
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            _terminate(self.proc, grace_s=20)


def start_replicas(n: int, workdir: Path, redis_url: str, env: dict[str, str], **kwargs: Any) -> list[ReplicaProcess]:
    """``n`` replicas started together (they load the model in parallel), each ready; ``kwargs`` as
    ``ReplicaProcess``."""
    reps = [ReplicaProcess(f"r{i}", Path(workdir) / f"r{i}" / "home", redis_url, env, **kwargs) for i in range(n)]
    try:
        for r in reps:
            r.wait_ready()
    except BaseException:
        for r in reps:
            r.stop()
        raise
    return reps


if __name__ == "__main__":
    sys.exit(main())
