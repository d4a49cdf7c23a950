"""One flipped byte in one sealed record costs that record only: the tenant's index is built from the
others, the record is counted (index stats, metrics) and named (`reprise index verify`), the export
leaves it out and says so, and `reprise index repair` sets it aside and reports what it dropped. A real
service: encrypted SQLite store, real gRPC, the operator CLI in-process."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from testkit.privacy import damage_page_holding
from testkit.service import start_service

from grpc_api.client import AdminClient, RepriseClient
from privacy import StoreConfig, TenantId, open_store
from reprise.cli import main

PASSWORD = "a long export password"


def flip_one_byte(store, tenant_id: str, index: int) -> tuple[str, str]:
    """Flip a ciphertext byte of the tenant's ``index``-th stored trajectory; (cursor, record id hex)."""
    row = store.storage.traj_scan(tenant_id, None, 1000)[index]
    bad = bytearray(row.sealed)
    bad[len(bad) // 2] ^= 0x10
    store.storage.traj_replace(tenant_id, [(row.record_id, bytes(bad))])
    return row.cursor, row.record_id.hex()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def service(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    r = start_service(tmp_path / "home")
    monkeypatch.setenv("REPRISE_SERVER", r.target)
    monkeypatch.setenv("REPRISE_ADMIN_KEY", r.admin_key)
    yield r
    r.stop()


def test_a_flipped_byte_is_quarantined_verified_and_repaired(service, capsys) -> None:
    r = service
    with AdminClient(r.target, r.admin_key) as admin:
        tenant, key = admin.create_tenant("acme")
        tid = tenant.tenant_id
        with RepriseClient(r.target, key) as client:
            for i in range(12):
                client.append_trajectory(f"s{i % 3}", tokens=[10 + i, 20 + i, 30 + i, 40 + i])
        cursor, record_id = flip_one_byte(r.service.store, tid, 4)

        stats, _ = admin.build_index(tid)
        assert (stats.index_sequences, stats.quarantined_records) == (11, 1)  # the other 11 still index
        _, memory = admin.index_stats_and_memory()
        assert memory.quarantined_records == 1
        assert "reprise_history_quarantined_records 1.0" in r.metrics()

        summary = admin.export_history(tid, io.BytesIO(), PASSWORD)
        assert summary.num_trajectories == 11 and [b.record_id for b in summary.skipped] == [record_id]

    code, out, err = cli(capsys, "index", "stats", "acme", "--json")
    assert code == 0 and json.loads(out)["tenants"][0]["quarantined_records"] == 1
    code, out, _ = cli(capsys, "index", "stats")
    assert code == 0 and "1 stored records failed authentication or parsing" in out
    code, out, _ = cli(capsys, "index", "verify", "acme")
    assert code == 1 and f"trajectory {record_id} (cursor {cursor}): " in out and "1 of 12" in out
    code, _, err = cli(capsys, "index", "build", "acme")
    assert code == 0 and "skipped 1 stored records" in err
    code, _, err = cli(capsys, "index", "export", "acme", "--out", str(r.home / "acme.export"), "--password-file",
                       str(_password_file(r.home)))
    assert code == 0 and "left out 1 stored records" in err and record_id in err

    code, out, _ = cli(capsys, "index", "repair", "acme", "--json")
    repaired = json.loads(out)
    assert code == 0 and repaired["repaired"] and repaired["num_quarantined"] == 1
    assert [(b["kind"], b["record_id"], b["cursor"]) for b in repaired["bad"]] == [("trajectory", record_id, cursor)]

    code, out, _ = cli(capsys, "index", "verify", "acme")
    assert code == 0 and "all 11 stored records authenticate and parse; 1 records kept in its quarantine" in out
    with AdminClient(r.target, r.admin_key) as admin:
        (stats,) = admin.index_stats(tid)
        assert (stats.index_sequences, stats.quarantined_records) == (11, 0)


def _password_file(home: Path) -> Path:
    path = home / "export-password"
    path.write_text(PASSWORD + "\n")
    return path


def test_start_up_serves_the_good_records_of_a_damaged_tenant(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    home = tmp_path / "home"
    r = start_service(home)
    try:
        with AdminClient(r.target, r.admin_key) as admin:
            tenant, key = admin.create_tenant("acme")
        with RepriseClient(r.target, key) as client:
            for i in range(5):
                client.append_trajectory("s", tokens=[1 + i, 2 + i, 3 + i])
        flip_one_byte(r.service.store, tenant.tenant_id, 0)
    finally:
        r.stop()
    r = start_service(home)  # the damaged record neither stops start-up nor empties the tenant's index
    try:
        with AdminClient(r.target, r.admin_key) as admin:
            (stats,) = admin.index_stats(tenant.tenant_id)
        assert (stats.index_sequences, stats.quarantined_records, stats.index_resident) == (4, 1, True)
        with RepriseClient(r.target, key) as client:
            assert client.generate(tokens=[5, 6], max_new_tokens=2).completion_tokens == 2
    finally:
        r.stop()


def test_a_bad_sqlite_page_stops_only_the_tenant_on_it(tmp_path: Path, monkeypatch, caplog) -> None:
    """Start-up over a store with one zeroed page: every tenant is served; the one whose history is on the
    page runs without history drafts, and the log names the file and the repair command."""
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    home = tmp_path / "home"
    r = start_service(home)
    with AdminClient(r.target, r.admin_key) as admin:
        a, key_a = admin.create_tenant("a")
        b, _ = admin.create_tenant("b")
    r.stop()
    store = open_store(StoreConfig(data_dir=home), env={})
    for tenant in (a, b):
        for i in range(30):
            store.append_trajectory(TenantId(tenant.tenant_id), "s", [(i + 5) % 250] * 300)
    needle = store.storage.traj_scan(a.tenant_id, None, 30)[15].sealed
    store.storage.shred_sync()
    store.close()
    damage_page_holding(home / "history.db", needle)

    r = start_service(home)
    try:
        assert any("history.db is damaged" in m and "python -m privacy repair" in m for m in caplog.messages)
        with AdminClient(r.target, r.admin_key) as admin:
            stats = {s.tenant_id: s for s in admin.index_stats()}
        assert stats[b.tenant_id].index_sequences == 30 and not stats[a.tenant_id].index_resident
        with RepriseClient(r.target, key_a) as client:
            assert client.generate(tokens=[5, 6], max_new_tokens=2).completion_tokens == 2
    finally:
        r.stop()
