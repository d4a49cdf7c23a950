"""Altered, moved or truncated records fail with IntegrityError and are never decrypted; a wrong or
missing master key fails at start-up with MasterKeyError."""

from __future__ import annotations

import base64
import os

import pytest

from privacy import IntegrityError, MasterKeyError, open_store
from privacy.blobs import KIND_SNAPSHOT


def _one(store, tenant):
    (row,) = store.storage.traj_scan(tenant.value, None, 10)
    return row


def test_record_moved_under_another_tenant_fails(store) -> None:
    a, b = store.create_tenant("a").id, store.create_tenant("b").id
    store.append_trajectory(a, "s", [1, 2, 3], "a's secret")
    row = _one(store, a)
    # Copy a's sealed record, with its record id, into b's history (what a store-level attacker can do).
    store.storage.traj_append(b.value, [(row.record_id, b"\0" * 16, row.sealed)])
    with pytest.raises(IntegrityError, match="authentication failed"):
        next(store.iter_trajectories(b))
    assert store.num_integrity_failures == 1
    assert [r.trajectory.text for r in store.iter_trajectories(a)] == ["a's secret"]


def test_records_swapped_within_a_tenant_fail(store) -> None:
    t = store.create_tenant("a").id
    store.append_trajectory(t, "s", [1], "first")
    store.append_trajectory(t, "s", [2], "second")
    r1, r2 = store.storage.traj_scan(t.value, None, 10)
    store.storage.traj_replace(t.value, [(r1.record_id, r2.sealed), (r2.record_id, r1.sealed)])
    with pytest.raises(IntegrityError):
        next(store.iter_trajectories(t))


@pytest.mark.parametrize("where", ["format", "key_version", "nonce", "ciphertext", "tag"])
def test_one_flipped_byte_fails(store, where) -> None:
    t = store.create_tenant("a").id
    store.append_trajectory(t, "s", list(range(100)), "x" * 100)
    row = _one(store, t)
    pos = {"format": 0, "key_version": 4, "nonce": 10, "ciphertext": 40, "tag": len(row.sealed) - 1}[where]
    bad = bytearray(row.sealed)
    bad[pos] ^= 0x01
    store.storage.traj_replace(t.value, [(row.record_id, bytes(bad))])
    with pytest.raises(IntegrityError):
        list(store.iter_trajectories(t))


@pytest.mark.parametrize("keep", [0, 5, 20, -1])
def test_truncated_record_fails(store, keep) -> None:
    t = store.create_tenant("a").id
    store.append_trajectory(t, "s", list(range(50)), "text")
    row = _one(store, t)
    store.storage.traj_replace(t.value, [(row.record_id, row.sealed[:keep])])
    with pytest.raises(IntegrityError):
        list(store.iter_trajectories(t))


def test_snapshot_chunks_reordered_or_dropped_fail(make_config, master_env) -> None:
    store = open_store(make_config(chunk_bytes=4096), env=master_env)
    t = store.create_tenant("a").id
    tk = store.keychain.tenant_keys(t)
    store.put_snapshot(t, os.urandom(3 * 4096))
    tag = tk.tag(KIND_SNAPSHOT, "default")
    blob = store.storage.blob_get(t.value, KIND_SNAPSHOT, tag)
    c = blob.chunks
    for chunks in ([c[1], c[0], c[2]], c[:2], c + [c[2]]):
        store.storage.blob_put(t.value, KIND_SNAPSHOT, tag, blob.blob_id, blob.head, chunks)
        with pytest.raises(IntegrityError):
            store.get_snapshot(t)
    store.close()


def test_wrapped_data_key_moved_to_another_tenant_fails(store) -> None:
    a, b = store.create_tenant("a").id, store.create_tenant("b").id
    store.storage.keys_put(b.value, {"dek:1": store.storage.keys_get(a.value)["dek:1"]})
    store.evict_tenant(b)
    with pytest.raises(IntegrityError, match="wrapped key"):
        store.append_trajectory(b, "s", [1])


def test_wrong_master_key_fails_at_start(make_config, master_env) -> None:
    config = make_config()
    store = open_store(config, env=master_env)
    store.create_tenant("a")
    store.close()
    wrong = {"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}
    with pytest.raises(MasterKeyError, match="version\\(s\\) \\[1\\]|not the key"):
        open_store(config, env=wrong)
    wrong_same_version = {"REPRISE_MASTER_KEY": "1:" + wrong["REPRISE_MASTER_KEY"]}
    with pytest.raises(MasterKeyError, match="not the key this store was sealed with"):
        open_store(config, env=wrong_same_version)


def test_missing_master_key_fails_at_start(make_config, master_env) -> None:
    config = make_config()
    open_store(config, env=master_env).close()
    with pytest.raises(MasterKeyError, match="REPRISE_MASTER_KEY"):
        open_store(config, env={})  # no env, no key file: must not silently generate a new key


@pytest.mark.parametrize("value, message", [
    ("not base64 !!", "not <version>:<base64>"),
    (base64.b64encode(b"short").decode(), "5 bytes, expected 32"),
    ("2:" + base64.b64encode(os.urandom(32)).decode() + ",2:" + base64.b64encode(os.urandom(32)).decode(), "repeat"),
    ("0:" + base64.b64encode(os.urandom(32)).decode(), ">= 1"),
    ("1:AAAA=,bad", "no version|not valid"),
])
def test_malformed_master_key_fails_clearly(make_config, value, message) -> None:
    with pytest.raises(MasterKeyError, match=message) as exc:
        open_store(make_config(), env={"REPRISE_MASTER_KEY": value})
    assert value not in str(exc.value) or len(value) < 12  # the key itself is never echoed
