"""`reprise serve` as a user runs it: a subprocess with flags, the operator CLI against it, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from testkit.service import byte_tokenizer, free_port, tiny_llama

from grpc_api.client import RepriseClient
from privacy import StoreConfig, open_store
from reprise.cli import main


def cli(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reprise", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def test_print_config_and_bad_flags(tmp_path: Path) -> None:
    env = {**os.environ, "REPRISE_HOME": str(tmp_path), "REPRISE_SERVER_GRACE_SECONDS": "2.5"}
    out = cli("serve", "--print-config", "--grpc-port", "7000", "--drafting-max-draft-tokens", "12", env=env)
    assert out.returncode == 0, out.stderr
    assert "grpc_port = 7000" in out.stdout and "grace_seconds = 2.5" in out.stdout
    assert "max_draft_tokens = 12" in out.stdout and f'home = "{tmp_path}"' in out.stdout
    bad = cli("serve", "--grpc-port", "abc", env=env)
    assert bad.returncode == 2 and "server.grpc_port from flag --grpc-port: expected an integer, got 'abc'" in bad.stderr
    bad = cli("serve", "--model-path", str(tmp_path / "nope"), env=env)
    assert bad.returncode == 2 and "model.path: no such folder" in bad.stderr
    helptext = cli("serve", "--help").stdout
    for flag in ("--grpc-port", "--http-port", "--store-backend", "--model-path", "--grace-seconds",
                 "REPRISE_SERVER_GRPC_PORT", "--max-requests-per-tenant"):
        assert flag in helptext


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-model"
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_serve_then_sigterm_finishes_streams_and_keeps_history(tmp_path: Path, model_dir: Path) -> None:
    home = tmp_path / "home"
    grpc_port, http_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_MASTER_KEY"}
    env.update(REPRISE_HOME=str(home), REPRISE_SERVER=f"127.0.0.1:{grpc_port}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "reprise", "serve", "--model-path", str(model_dir), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--model-max-len", "600", "--grace-seconds", "20"],
        env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("serving gRPC" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        assert any("admin key is in" in line for line in lines)
        created = cli("tenant", "create", "acme", "--json", env=env)
        assert created.returncode == 0, created.stderr

        key = json.loads(created.stdout)["api_key"]
        with RepriseClient(f"127.0.0.1:{grpc_port}", key) as client:
            stream = client.generate_stream(text="hello", max_new_tokens=200, ignore_eos=True, session_id="kept")
            it = iter(stream)
            next(it)
            proc.send_signal(signal.SIGTERM)  # mid-stream
            rest = list(it)
        assert 1 + sum(len(c.token_ids) for c in rest) == 200 and stream.completion.finish_reason == "length"
        assert proc.wait(60) == 0
        assert any("stopped" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    with open_store(StoreConfig(data_dir=home)) as store:
        tenant = store.list_tenants()[0]
        assert [r.trajectory.session_id for r in store.iter_trajectories(tenant.id)] == ["kept"]


def test_ports_in_use_fail_clearly(tmp_path: Path, model_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    monkeypatch.setenv("REPRISE_HOME", str(tmp_path / "home"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--model-path", str(model_dir), "--http-port", str(port), "--grpc-port", str(free_port())])
        assert code == 1 and "Address already in use" in capsys.readouterr().err
        code = main(["serve", "--model-path", str(model_dir), "--grpc-port", str(port), "--http-port", str(free_port())])
        assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_engine_vllm_without_a_supported_vllm_is_one_clear_error(tmp_path: Path, model_dir: Path, monkeypatch,
                                                                 capsys) -> None:
    from reprise.backends.vllm import versions
    from reprise.cli import main

    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    monkeypatch.setenv("REPRISE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(versions, "installed_vllm", lambda: ("vllm", "0.31.1"))
    code = main(["serve", "--engine", "vllm", "--model-path", str(model_dir), "--grpc-port", str(free_port()),
                 "--http-port", str(free_port())])
    err = capsys.readouterr().err
    assert code == 1
    assert "supports vLLM 0.32.0; vllm 0.31.1 is installed" in err and "Traceback" not in err
