"""One bad SQLite page: the store still opens and names the damaged file and the repair command
instead of a raw sqlite3.DatabaseError; the tenants whose rows are elsewhere read on; `python -m privacy
verify` reports it, `python -m privacy repair` salvages every readable row into a new file (the damaged
one kept) and says what it lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.privacy import damage_page_holding

from privacy import StoreConfig, open_store
from privacy.admin_cli import main
from privacy.errors import StoreDamagedError
from privacy.salvage import check_sqlite

N = 40


@pytest.fixture
def damaged_store(tmp_path: Path, monkeypatch):
    """A store with tenants a and b (N trajectories each), with the page of a's 20th trajectory zeroed."""
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    config = StoreConfig(data_dir=tmp_path)
    store = open_store(config, env={})
    a, b = store.create_tenant("a").id, store.create_tenant("b").id
    for tenant in (a, b):
        for i in range(N):
            store.append_trajectory(tenant, "s", [i % 250] * 300, f"{tenant.value[:4]} turn {i}")
    needle = store.storage.traj_scan(a.value, None, N)[20].sealed
    store.storage.shred_sync()  # everything into the main file
    store.close()
    damage_page_holding(config.sqlite.path, needle)
    return config, a, b


def test_a_bad_page_is_named_and_the_rest_still_reads(damaged_store) -> None:
    config, a, b = damaged_store
    store = open_store(config, env={})
    try:
        with pytest.raises(StoreDamagedError) as exc:
            list(store.iter_trajectories(a))
        assert str(config.sqlite.path) in str(exc.value) and "python -m privacy repair" in str(exc.value)
        assert len(list(store.iter_trajectories(b))) == N  # b's rows live on other pages
    finally:
        store.close()
    assert check_sqlite(config.sqlite.path)


def test_verify_then_repair_salvages_every_readable_row(damaged_store, capsys) -> None:
    config, a, b = damaged_store
    data_dir = str(config.data_dir)
    assert main(["--data-dir", data_dir, "verify"]) == 1
    out = capsys.readouterr().out
    assert "damaged; SQLite's integrity check reports 1 problem" in out and f"tenant {b.value}: all {N} records" in out
    assert f"tenant {a.value}: cannot be checked" in out and "python -m privacy repair" in out

    assert main(["--data-dir", data_dir, "repair", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    salvaged = report["file"]["salvaged"]
    (lost,) = next(t for t in salvaged["tables"] if t["table"] == "trajectories")["lost"]
    assert Path(salvaged["kept"]).is_file() and Path(salvaged["kept"]).name.startswith("history.db.damaged-")
    by_id = {t["tenant_id"]: t for t in report["tenants"]}
    assert by_id[b.value]["num_records"] == N and by_id[a.value]["bad"] == []
    num_lost = N - by_id[a.value]["num_records"]
    assert 1 <= num_lost <= 12 and lost[1] - lost[0] >= num_lost  # one 4 KiB page held a few of a's turns

    assert main(["--data-dir", data_dir, "verify"]) == 0
    assert "sound (SQLite integrity check: ok)" in capsys.readouterr().out
    store = open_store(config, env={})
    try:
        texts = [r.trajectory.text for r in store.iter_trajectories(a)]
        assert texts[0].endswith("turn 0") and texts[-1].endswith(f"turn {N - 1}") and len(texts) == N - num_lost
        assert f"{a.value[:4]} turn 20" not in texts
        store.append_trajectory(a, "s", [1, 2, 3], "after the repair")  # the salvaged file takes writes
        assert [r.trajectory.text for r in store.iter_trajectories(a)][-1] == "after the repair"
        assert len(list(store.iter_trajectories(b))) == N and store.authenticate  # keys and tenants intact
    finally:
        store.close()
