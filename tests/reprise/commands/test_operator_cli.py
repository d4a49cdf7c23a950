"""`reprise tenant` and `reprise index export/import` against a server whose admin plane runs on the
real encrypted store (SQLite in a temp dir). The data plane is not used here: a stub stands in for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.service import LoopThread

from grpc_api.server import GrpcServer
from privacy import StoreConfig, TenantId, ensure_admin_key, open_store
from reprise.cli import main
from reprise.commands._remote import resolve_tenant
from reprise.config import ServerConfig
from reprise.server.admin import ServiceAdmin
from reprise.server.auth import StoreAuthenticator
from serving.admin import IndexMemory, TenantInfo, TenantStats
from serving.core import ServingCore
from serving.prepare import ServingSettings
from serving.records import ModelInfo
from serving.savings import Savings


class NoModel:
    """Data-plane stub: these tests never decode."""

    tokenizer = None
    alive = True

    def model_info(self):
        return ModelInfo("none", 1024, (0,), 100, False)

    async def close(self) -> None:
        pass


class NoIndexes:
    """No index; each tenant's figures show 3 s spent on 120 tokens against 6 s estimated without Reprise."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def forget(self, tenant: str) -> None:
        self.forgotten.append(tenant)

    def stats(self, tenant: str) -> TenantStats:
        return TenantStats(tenant, num_requests=2, num_steps=40, savings=Savings(2.0, 4.5, 1.0, 1.5, 120))

    def all_stats(self, tenants: list[str]) -> list[TenantStats]:
        return [self.stats(t) for t in tenants]

    def memory(self) -> IndexMemory:
        return IndexMemory()


@pytest.fixture
def admin_server(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    store = open_store(StoreConfig(data_dir=tmp_path))
    key_file = ensure_admin_key(store)
    auth = StoreAuthenticator(store)
    indexes = NoIndexes()
    admin = ServiceAdmin(store, indexes, auth.invalidate)
    lt = LoopThread()

    async def make():
        return GrpcServer(ServingCore(NoModel(), ServingSettings()), admin, auth, ServerConfig(grpc_port=0, http_port=0))

    server = lt.call(make())
    port = lt.call(server.start())
    monkeypatch.setenv("REPRISE_SERVER", f"127.0.0.1:{port}")
    monkeypatch.setenv("REPRISE_HOME", str(tmp_path))  # the CLI reads admin.key from here
    yield store, indexes, key_file
    lt.call(server.stop(0))
    lt.close()
    store.close()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_index_stats_shows_speedup_and_time_saved(admin_server, capsys) -> None:
    assert run(capsys, "tenant", "create", "acme")[0] == 0
    code, out, _ = run(capsys, "index", "stats", "--json")
    assert code == 0
    (row,) = json.loads(out)["tenants"]
    assert row["name"] == "acme" and row["speedup"] == pytest.approx(2.0) and row["tokens_per_second"] == 40.0
    assert (row["seconds_saved"], row["seconds_saved_drafts"], row["seconds_saved_cache"]) == pytest.approx((3, 2.5, 0.5))
    code, out, _ = run(capsys, "index", "stats", "acme")
    assert code == 0 and "2.00x" in out
    assert "time saved  3.0 s of an estimated 6.0 s without Reprise (drafts 2.5 s, prefix cache 0.5 s)" in out


def test_tenant_commands(admin_server, capsys, monkeypatch) -> None:
    store, indexes, key_file = admin_server
    assert key_file is not None and key_file.stat().st_mode & 0o777 == 0o600
    code, out, err = run(capsys, "tenant", "create", "acme", "--json")
    assert code == 0
    created = json.loads(out)
    assert created["name"] == "acme" and created["api_key"].startswith("rpk_")
    assert str(store.authenticate(created["api_key"])) == created["tenant_id"]
    code, out, _ = run(capsys, "tenant", "create", "acme")
    assert code == 1
    code, out, err = run(capsys, "tenant", "list")
    assert code == 0 and "acme" in out and created["tenant_id"] in out

    code, out, _ = run(capsys, "tenant", "rotate-key", "acme", "--json")
    rotated = json.loads(out)
    assert code == 0 and rotated["api_key"] != created["api_key"]
    assert str(store.authenticate(rotated["api_key"])) == created["tenant_id"]

    code, out, _ = run(capsys, "tenant", "rotate-key", "acme", "--data-key", "--json")
    assert code == 0 and json.loads(out)["key_version"] >= 2
    code, out, _ = run(capsys, "tenant", "rotate-key", "--master-key")
    assert code == 0 and "master key version" in out

    # deletion: refused without a typed confirmation, refused with the wrong one
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    code, _, err = run(capsys, "tenant", "delete", "acme")
    assert code == 2 and "--confirm acme" in err
    code, _, err = run(capsys, "tenant", "delete", "acme", "--confirm", "acne")
    assert code == 2 and "does not match" in err and store.list_tenants()
    code, out, _ = run(capsys, "tenant", "delete", "acme", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["deleted"] is False
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "acme")
    code, out, err = run(capsys, "tenant", "delete", "acme")
    assert code == 0 and "deleted tenant acme" in out and "rotate the master key" in err
    assert store.list_tenants() == [] and indexes.forgotten == [created["tenant_id"]]
    code, _, err = run(capsys, "tenant", "delete", "acme", "--confirm", "acme")
    assert code == 1 and "no tenant with name 'acme'" in err


def test_export_and_import(admin_server, capsys, tmp_path: Path, monkeypatch) -> None:
    store, _, _ = admin_server
    code, out, _ = run(capsys, "tenant", "create", "acme", "--json")
    tid = json.loads(out)["tenant_id"]

    store.append_trajectory(TenantId(tid), "s1", [1, 2, 3, 4], "one two")
    pw = tmp_path / "pw"
    pw.write_text("correct horse battery staple\n")
    out_file = tmp_path / "acme.export"
    code, out, _ = run(capsys, "index", "export", "acme", "--out", str(out_file), "--password-file", str(pw), "--json")
    assert code == 0 and out_file.is_file() and json.loads(out)["bytes"] == out_file.stat().st_size
    assert b"one two" not in out_file.read_bytes()
    code, _, err = run(capsys, "index", "export", "acme", "--out", str(out_file), "--password-file", str(pw))
    assert code == 2 and "exists" in err
    code, out, err = run(capsys, "index", "import", str(out_file), "--name", "acme-copy", "--password-file", str(pw))
    assert code == 0 and "into new tenant acme-copy" in out and "api key rpk_" in out
    copy = next(t for t in store.list_tenants() if t.name == "acme-copy")
    assert [r.trajectory.text for r in store.iter_trajectories(copy.id)] == ["one two"]
    wrong = tmp_path / "wrong"
    wrong.write_text("not the right password")
    code, _, err = run(capsys, "index", "import", str(out_file), "--name", "x", "--password-file", str(wrong))
    assert code == 1 and "data loss" in err


def test_cli_errors_are_clear(admin_server, capsys, monkeypatch) -> None:
    monkeypatch.setenv("REPRISE_ADMIN_KEY", "rpa_0000000000000000_" + "A" * 43)
    code, _, err = run(capsys, "tenant", "list")
    assert code == 4 and "check --admin-key" in err
    monkeypatch.delenv("REPRISE_ADMIN_KEY")
    code, _, err = run(capsys, "tenant", "list", "--server", "127.0.0.1:1", "--timeout", "3")
    assert code == 3 and "cannot reach the server" in err
    code, _, err = run(capsys, "index", "build", "nobody")
    assert code == 1 and "no tenant with name 'nobody'" in err


def test_import_corpus_checks_its_files_before_uploading(admin_server, capsys, tmp_path: Path) -> None:
    assert run(capsys, "tenant", "create", "acme")[0] == 0
    missing = tmp_path / "missing.txt"
    code, _, err = run(capsys, "index", "import-corpus", "acme", str(missing))
    assert code == 2 and err.strip().splitlines() == [f"reprise index: error: cannot read {missing}: No such file or directory"]
    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"text": "fine"}\n{"nope": 1}\n')
    code, _, err = run(capsys, "index", "import-corpus", "acme", str(bad))
    assert code == 2 and err.strip() == f'reprise index: error: {bad}:2: expected {{"text": "..."}} or {{"token_ids": [...]}}'
    long = tmp_path / "long.jsonl"
    with long.open("wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "')
        f.write(b"a" * (65 << 20))
    code, _, err = run(capsys, "index", "import-corpus", "acme", str(long))
    assert code == 2 and err.strip() == (f"reprise index: error: {long}:2: line longer than {64 << 20} bytes (a "
                                         "document must fit in one gRPC message, server.max_message_bytes): split it")


def test_a_name_never_reads_as_another_tenants_id(admin_server, capsys, monkeypatch) -> None:
    store, _, _ = admin_server
    code, out, _ = run(capsys, "tenant", "create", "acme", "--json")
    acme = json.loads(out)["tenant_id"]
    for name in (acme, acme.upper()):
        code, _, err = run(capsys, "tenant", "create", name)
        assert code == 2 and "has the shape of a tenant id (32 hex digits); choose another" in err
    # a store from before the rule may hold such a name, listed first: the id still wins
    monkeypatch.setattr("privacy.history.validate_tenant_name", lambda name: name)
    legacy = store.create_tenant(acme).id.value

    class Listing:
        def list_tenants(self):
            return [TenantInfo(legacy, acme, 0), TenantInfo(acme, "acme", 0)]

    assert resolve_tenant(Listing(), acme) == (acme, "acme")
    assert resolve_tenant(Listing(), legacy) == (legacy, acme)
    code, out, _ = run(capsys, "tenant", "delete", acme, "--dry-run", "--json")
    assert code == 0 and json.loads(out)["tenant_id"] == acme
