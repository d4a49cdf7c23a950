"""``python -m privacy``: the operator commands on the store."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys

import pytest

from privacy.admin_cli import build_parser, run


def _run(capsys, data_dir, env, *argv) -> str:
    args = build_parser().parse_args(["--data-dir", str(data_dir), *argv])
    assert run(args, env=env) == 0
    return capsys.readouterr().out


def test_operator_commands(tmp_path, capsys, master_env) -> None:
    d = tmp_path / "data"
    created = json.loads(_run(capsys, d, master_env, "tenant", "create", "acme"))
    assert created["name"] == "acme" and created["api_key"].startswith("rpk_")
    tid = created["tenant_id"]
    assert _run(capsys, d, master_env, "tenant", "list").split() == [tid, "acme"]
    assert _run(capsys, d, master_env, "admin-key", "create").startswith("rpa_")
    status = json.loads(_run(capsys, d, master_env, "keys", "status", "--json"))
    assert status["master_key_versions"] == [1] and status["tenants"][0]["tenant"] == tid
    assert "version 2" in _run(capsys, d, master_env, "keys", "rotate-data", tid)
    env = dict(master_env, EXPORT_PW="a long export password")
    out = tmp_path / "acme.rex"
    _run(capsys, d, env, "export", tid, "--out", str(out), "--password-env", "EXPORT_PW")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "acme2" in _run(capsys, d, env, "import", str(out), "--password-env", "EXPORT_PW", "--name", "acme2")
    key_file = tmp_path / "k"
    key_file.write_text(base64.b64encode(os.urandom(32)).decode())
    _run(capsys, d, env, "export", tid, "--out", str(tmp_path / "k.rex"), "--key-file", str(key_file))
    assert "would delete 0" in _run(capsys, d, master_env, "tenant", "delete", tid, "--confirm", tid, "--dry-run")
    with pytest.raises(ValueError, match="--confirm must repeat"):
        run(build_parser().parse_args(["--data-dir", str(d), "tenant", "delete", tid, "--confirm", "x"]), env=master_env)
    assert "crypto-shredded" in _run(capsys, d, master_env, "tenant", "delete", tid, "--confirm", tid)
    assert "acme2" in _run(capsys, d, master_env, "tenant", "list")


def test_errors_are_clean_messages(tmp_path, master_env) -> None:
    env = dict(os.environ, REPRISE_HOME=str(tmp_path), **master_env)
    out = subprocess.run([sys.executable, "-m", "privacy", "tenant", "create", "bad name"],
                         check=False, capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "error: tenant name" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "privacy", "tenant", "list"], check=False, capture_output=True,
                         text=True, env=dict(env, REPRISE_MASTER_KEY=base64.b64encode(os.urandom(32)).decode()))
    assert out.returncode == 2 and "master key" in out.stderr and "Traceback" not in out.stderr
