"""Rotations keep everything readable: a tenant's data key (records re-encrypted, old versions
destroyed), automatic retirement after max_encryptions_per_key, and the master key (data keys re-wrapped)."""

from __future__ import annotations

import base64
import os
import stat

import numpy as np
import pytest

from privacy import MasterKeyError, StoreConfig, envelope, open_store
from privacy.blobs import BLOB_KINDS
from privacy.keyring import load_keyring
from privacy.rotation import retire_master_versions


def _fill(store, name="acme", n=12):
    t = store.create_tenant(name).id
    written = [(f"s{i % 2}", list(range(i, i + 40)), f"text {i}") for i in range(n)]
    for s, ids, text in written:
        store.append_trajectory(t, s, ids, text, finished_at=1.0)
    store.put_snapshot(t, os.urandom(10_000), cursor="c")
    store.add_corpus_documents(t, [[1, 2], [3]])
    store.put_hidden_states(t, "h", [1, 2], np.ones((2, 8)))
    return t


def _contents(store, t):
    return (
        [(r.trajectory.session_id, r.trajectory.token_ids.tolist(), r.trajectory.text) for r in store.iter_trajectories(t)],
        store.get_snapshot(t).data,
        [d.tolist() for d in store.iter_corpus(t)],
        store.get_hidden_states(t, "h")[1].tolist(),
        store.get_tenant(t).name,
    )


def _versions(store, t) -> set[int]:
    rows = store.storage.traj_scan(t.value, None, 10_000)
    out = {envelope.sealed_version(r.sealed, "t") for r in rows}
    for kind in BLOB_KINDS:
        for b in store.storage.blob_list(t.value, kind):
            full = store.storage.blob_get(t.value, kind, b.tag)
            out |= {envelope.sealed_version(x, "b") for x in [full.head, *full.chunks]}
    return out


def test_data_key_rotation_reencrypts_and_destroys_old(make_config, master_env) -> None:
    config = make_config(chunk_bytes=4096)
    store = open_store(config, env=master_env)
    t = _fill(store)
    other = _fill(store, "other", 3)
    before, other_before = _contents(store, t), _contents(store, other)
    seen = []
    report = store.rotate_data_key(t, progress=seen.append)
    assert report.version == 2 and report.num_records == 12 + 3  # trajectories + snapshot, corpus, hidden
    assert seen and seen[-1].done == report.num_records and seen[-1].unit == "records"
    assert _versions(store, t) == {2}
    assert sorted(store.storage.keys_get(t.value)) == ["dek:2", "tag"]  # version 1 destroyed
    assert store.get_tenant(t).data_key_version == 2
    assert _contents(store, t) == before and _contents(store, other) == other_before
    store.append_trajectory(t, "s0", [5], "after")
    assert _versions(store, t) == {2}
    store.close()
    again = open_store(config, env=master_env)
    assert _contents(again, t)[0][-1] == ("s0", [5], "after")
    assert again.rotate_data_key(t).version == 3 and _versions(again, t) == {3}
    again.close()


def test_data_key_retired_after_max_encryptions(make_config, master_env) -> None:
    store = open_store(make_config(max_encryptions_per_key=16), env=master_env)
    t = store.create_tenant("acme").id
    for i in range(100):
        store.append_trajectory(t, "s", [i], str(i))
    assert [r.trajectory.text for r in store.iter_trajectories(t)] == [str(i) for i in range(100)]
    rows = store.storage.traj_scan(t.value, None, 1000)
    per_version: dict[int, int] = {}
    for r in rows:
        v = envelope.sealed_version(r.sealed, "t")
        per_version[v] = per_version.get(v, 0) + 1
    assert max(per_version.values()) <= 16 and len(per_version) >= 100 // 16
    assert store.get_tenant(t).data_key_version == max(per_version)
    store.close()


def test_master_key_rotation_with_key_file(tmp_path) -> None:
    config = StoreConfig(data_dir=tmp_path / "data")
    store = open_store(config, env={})  # generates <data_dir>/master.key
    assert stat.S_IMODE(config.key_file.stat().st_mode) == 0o600
    t = _fill(store)
    before = _contents(store, t)
    old_text = config.key_file.read_text()
    report = store.rotate_master_key()
    assert report.version == 2 and report.num_records == 3  # system key, dek:1, tag
    assert load_keyring(config.key_file).versions == [2]
    assert stat.S_IMODE(config.key_file.stat().st_mode) == 0o600
    assert _contents(store, t) == before
    store.close()
    again = open_store(config, env={})
    assert _contents(again, t) == before
    again.close()
    config.key_file.write_text(old_text)  # the retired key no longer opens the store
    with pytest.raises(MasterKeyError):
        open_store(config, env={})


def test_master_key_rotation_from_environment(make_config) -> None:
    k1, k2 = (base64.b64encode(os.urandom(32)).decode() for _ in range(2))
    store = open_store(make_config(), env={"REPRISE_MASTER_KEY": k1})
    t = _fill(store)
    before = _contents(store, t)
    with pytest.raises(MasterKeyError, match="add version 2"):
        store.rotate_master_key()  # Reprise cannot write the environment: the operator adds v2
    store.close()
    store = open_store(make_config(), env={"REPRISE_MASTER_KEY": f"2:{k2},1:{k1}"})
    assert store.rotate_master_key(retire_old=False).version == 2
    with pytest.raises(MasterKeyError, match="primary"):
        retire_master_versions(store, [2])
    retire_master_versions(store, [1])
    store.close()
    store = open_store(make_config(), env={"REPRISE_MASTER_KEY": f"2:{k2}"})
    assert _contents(store, t) == before
    store.close()
    with pytest.raises(MasterKeyError):
        open_store(make_config(), env={"REPRISE_MASTER_KEY": k1})


def test_retiring_a_version_in_use_is_refused(make_config) -> None:
    k1, k2 = (base64.b64encode(os.urandom(32)).decode() for _ in range(2))
    store = open_store(make_config(), env={"REPRISE_MASTER_KEY": k1})
    store.create_tenant("acme")
    store.close()
    store = open_store(make_config(), env={"REPRISE_MASTER_KEY": f"2:{k2},1:{k1}"})
    with pytest.raises(MasterKeyError, match="still wrap"):
        retire_master_versions(store, [1])
    store.close()
