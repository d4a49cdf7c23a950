"""Nothing acknowledged is lost: a completion whose reply reached the client is in the store, even when
the server is killed (SIGKILL) the moment the reply arrives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pytest
from testkit.service import byte_tokenizer, free_port, tiny_llama

from grpc_api.client import RepriseClient
from privacy import StoreConfig, open_store

TRIALS = 3
REQUESTS = 6  # per trial, in flight together; the kill follows the first reply


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-model"
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


class Server:
    """``reprise serve`` on a tiny model in a subprocess (SQLite store in ``home``)."""

    def __init__(self, home: Path, model_dir: Path) -> None:
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if k != "REPRISE_MASTER_KEY"}
        self.env.update(REPRISE_HOME=str(home), REPRISE_SERVER=f"127.0.0.1:{self.port}")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reprise", "serve", "--model-path", str(model_dir), "--grpc-port", str(self.port),
             "--http-port", "0", "--model-max-len", "400"],
            env=self.env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 120
        while not any("serving gRPC" in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.05)

    def cli(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reprise", *argv], capture_output=True, text=True, timeout=120,
                              env=self.env, check=False)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def test_a_reply_the_client_saw_survives_a_kill9(tmp_path: Path, model_dir: Path) -> None:
    home = tmp_path / "home"
    server = Server(home, model_dir)
    try:
        created = server.cli("tenant", "create", "acme", "--json")
        assert created.returncode == 0, created.stderr
        key = json.loads(created.stdout)["api_key"]
    except BaseException:
        server.stop()
        raise
    acknowledged: list[tuple[str, list[int]]] = []  # (session id, prompt + output tokens) of every reply seen
    for trial in range(TRIALS):
        with RepriseClient(f"127.0.0.1:{server.port}", key) as client, ThreadPoolExecutor(REQUESTS) as pool:
            prompts = {f"t{trial}-r{i}": [1 + (trial * 7 + i * 3 + j) % 200 for j in range(12)]
                       for i in range(REQUESTS)}
            futures = {pool.submit(client.generate, tokens=ids, session_id=sid, max_new_tokens=8 + 4 * i,
                                   ignore_eos=True): sid for i, (sid, ids) in enumerate(prompts.items())}
            for future in as_completed(futures):
                if future.exception() is not None:  # the kill broke the calls still in flight: never acknowledged
                    continue
                done = future.result()
                if server.proc.poll() is None:
                    server.kill9()  # the moment the first reply has arrived
                sid = futures[future]
                acknowledged.append((sid, prompts[sid] + list(done.token_ids)))
        server = Server(home, model_dir)  # restarts on the same data: what was acknowledged must be there
    server.stop()
    assert len(acknowledged) >= TRIALS
    with open_store(StoreConfig(data_dir=home)) as store:
        tenant = store.list_tenants()[0]
        stored = {(r.trajectory.session_id, tuple(int(t) for t in r.trajectory.token_ids))
                  for r in store.iter_trajectories(tenant.id)}
    missing = [sid for sid, ids in acknowledged if (sid, tuple(ids)) not in stored]
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged turns were lost: {missing}"
