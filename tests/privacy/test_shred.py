"""Deleting a tenant is a crypto-shred: its keys go first, hooks evict it, its records follow; copies of
the store made afterwards hold nothing of it, and copies made before are dead once the master key
version that wrapped its key is rotated out (the shred epoch)."""

from __future__ import annotations

import base64
import os
import shutil

import pytest
from testkit.privacy import contains, raw_dump

from privacy import (
    AuthenticationError,
    IntegrityError,
    MasterKeyError,
    StoreConfig,
    UnknownTenantError,
    envelope,
    open_store,
)
from privacy.keyring import load_keyring


def _fill(store, name: str, n: int = 5):
    t = store.create_tenant(name).id
    for i in range(n):
        store.append_trajectory(t, f"s{i}", list(range(i, i + 30)), f"{name} text {i}")
    store.put_snapshot(t, b"index of " + name.encode())
    store.add_corpus_documents(t, [[1, 2, 3]])
    return t


def test_delete_shreds_then_evicts_then_deletes(store) -> None:
    a, b = _fill(store, "a"), _fill(store, "b")
    key = store.create_api_key(a)
    seen = []

    def hook(tenant):
        # Called after the keys are destroyed: nothing of a's can be decrypted any more.
        seen.append((tenant, store.storage.keys_get(tenant.value)))

    store.add_deletion_hook(hook)
    store.add_deletion_hook(lambda tenant: 1 / 0)  # a failing hook does not stop the deletion
    dry = store.delete_tenant(a, dry_run=True)
    assert (dry.num_records, dry.deleted) == (7, False) and store.count_trajectories(a) == 5
    report = store.delete_tenant(a)
    assert (report.tenant, report.num_records, report.deleted) == (a, 7, True)
    assert seen == [(a, {})]
    with pytest.raises(AuthenticationError):
        store.authenticate(key.secret)
    for read in (lambda: store.iter_trajectories(a), lambda: store.get_snapshot(a), lambda: store.get_tenant(a)):
        with pytest.raises(UnknownTenantError):
            read()
    with pytest.raises(UnknownTenantError):
        store.delete_tenant(a)
    assert [t.id for t in store.list_tenants()] == [b] and store.count_trajectories(b) == 5
    assert store.find_tenant("a") is None
    store.create_tenant("a")  # the name is free again, under a new id


def test_nothing_of_a_deleted_tenant_stays_in_the_store(make_config, store) -> None:
    a = _fill(store, "a")
    _fill(store, "b")
    wrapped = list(store.storage.keys_get(a.value).values())
    sealed = [row.sealed for row in store.storage.traj_scan(a.value, None, 100)]
    store.delete_tenant(a)
    dump = raw_dump(make_config())  # database + WAL files, every row / every Redis key and value
    assert not contains(dump, a.value.encode())
    for blob in wrapped + sealed:
        assert not contains(dump, blob[5:37]), "a wrapped key or sealed record of the deleted tenant is still stored"


def test_old_copy_is_readable_until_the_shred_epoch(make_config, master_env) -> None:
    """Honest about backups: a copy taken before the deletion still holds the wrapped key and opens with
    the same master key; after rotating the master key and retiring the old version it does not."""
    store = open_store(make_config(), env=master_env)
    a = _fill(store, "a")
    backup_keys = store.storage.keys_get(a.value)
    backup_rows = store.storage.traj_scan(a.value, None, 100)
    store.delete_tenant(a)
    kc = store.keychain
    assert kc.unwrap(a.raw, "dek:1", backup_keys["dek:1"])  # the caveat: the old copy still opens
    store.close()
    # Shred epoch: the operator adds master key version 2, the store re-wraps, version 1 is retired.
    old_key, new_key = kc.keyring.key(1), os.urandom(32)
    store = open_store(make_config(), env={"REPRISE_MASTER_KEY": f"2:{_b64(new_key)},1:{_b64(old_key)}"})
    store.rotate_master_key()
    assert store.keychain.keyring.versions == [2]
    with pytest.raises(MasterKeyError, match="version 1"):
        store.keychain.unwrap(a.raw, "dek:1", backup_keys["dek:1"])
    with pytest.raises(IntegrityError):  # nor can the new master key open it
        envelope.unwrap_key(new_key, a.raw, "dek:1", backup_keys["dek:1"])
    assert backup_rows  # the sealed records in the backup are now ciphertext without any key
    store.close()
    with pytest.raises(MasterKeyError):  # and the old master key no longer opens the live store
        open_store(make_config(), env={"REPRISE_MASTER_KEY": f"1:{_b64(old_key)}"})


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_sqlite_backup_after_shred_epoch_does_not_open(tmp_path) -> None:
    """The whole-file version for the embedded store, with the generated key file."""
    config = StoreConfig(data_dir=tmp_path / "data")
    store = open_store(config, env={})
    a = _fill(store, "a")
    _fill(store, "b")
    store.storage.shred_sync()
    backup = tmp_path / "backup"
    backup.mkdir()
    for f in store.storage.files():
        shutil.copy(f, backup / f.name)
    store.delete_tenant(a)
    store.rotate_master_key()  # key file now holds only version 2
    assert load_keyring(config.key_file).versions == [2]
    store.close()
    restored = StoreConfig(data_dir=tmp_path / "data", sqlite_path=backup / "history.db")
    with pytest.raises(MasterKeyError, match="version\\(s\\) \\[1\\]"):
        open_store(restored, env={})


def test_interrupted_deletion_finishes_at_start(make_config, master_env) -> None:
    store = open_store(make_config(), env=master_env)
    a, b = _fill(store, "a"), _fill(store, "b")
    store.storage.tenant_shred(a.value)  # the process dies right after the shred
    store.close()
    again = open_store(make_config(), env=master_env)
    assert again.storage.tenant_get(a.value) is None and again.storage.traj_count(a.value) == 0
    assert [t.id for t in again.list_tenants()] == [b]
    again.close()
