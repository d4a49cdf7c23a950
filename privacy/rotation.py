"""Key rotation.

- Data key (per tenant): a new version takes new writes at once; every record sealed under an older
  version is re-encrypted under it (same record ids, so the associated data still binds them); then the
  old versions are destroyed. Writes continue meanwhile; the last step (remaining records, blobs, the
  tenant record, destroying the old keys) waits for this process's in-flight writes and holds new ones
  for its duration. Other processes on the same store must drop their cached keys
  (``HistoryStore.evict_tenant``) when told of the rotation, or they keep sealing under the old version.
- Master key: a new version wraps every data key, tag key and system key again (records are not
  touched); the old versions are then retired: their check values are deleted and, for a key file,
  they are removed from it. Done after tenant deletions, this is the "shred epoch": backups that still
  hold a deleted tenant's wrapped key become unreadable once the old master key version is destroyed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from privacy import envelope
from privacy.blobs import BLOB_KINDS, blob_record_id
from privacy.errors import MasterKeyError
from privacy.keychain import CHECK_PREFIX, SYSTEM_KEY_PREFIX, TenantKeys
from privacy.records import KIND_TENANT, KIND_TRAJECTORY, TENANT_RECORD_ID
from privacy.sealed import SealedStore
from privacy.tenants import Progress, ProgressCallback, TenantId

log = logging.getLogger(__name__)
_BATCH = 256


@dataclass(frozen=True, slots=True)
class RotationReport:
    """``version``: the new key version; ``num_records``: records re-encrypted or keys re-wrapped."""

    version: int
    num_records: int


def _report(progress: ProgressCallback | None, phase: str, done: int, total: int, unit: str) -> None:
    if progress is not None:
        progress(Progress(phase, done, total, unit))


def rotate_data_key(store: SealedStore, tenant: TenantId, progress: ProgressCallback | None = None) -> RotationReport:
    """See ``HistoryStore.rotate_data_key`` and the module docstring."""
    kc, storage = store.keychain, store.storage
    tk = kc.tenant_keys(tenant)
    new = kc.add_data_key_version(tk)  # new writes use it from here on
    store._keys_changed(tenant)  # other processes drop their cached keys and seal under it too
    old = sorted(v for v in tk.ciphers if v != new)
    total = storage.traj_count(tenant.value) + storage.blob_count(tenant.value)
    # Bulk pass while writes continue. Records committed later have later cursors, so the final pass
    # starts where this one ended.
    done, cursor = _reencrypt_trajectories(store, tk, new, None, progress, 0, total)
    with tk.gate.exclusive():  # no write of this process is between sealing and storing now
        moved, _ = _reencrypt_trajectories(store, tk, new, cursor, progress, done, total)
        done += moved + _reencrypt_blobs(store, tk, new, BLOB_KINDS)
        row = storage.tenant_get(tenant.value)
        assert row is not None
        info = store._open(tk, KIND_TENANT, TENANT_RECORD_ID, row.info)
        aad = envelope.record_aad(tenant.raw, KIND_TENANT, TENANT_RECORD_ID, new)
        storage.tenant_update(tenant.value, info=envelope.seal(tk.ciphers[new], new, aad, info))
        kc.drop_data_key_versions(tk, old)
    _report(progress, "re-encrypt", done, done, "records")
    log.info("tenant %s: data key rotated to version %d, %d records re-encrypted, versions %s destroyed",
             tenant.value, new, done, old)
    return RotationReport(new, done)


def _reencrypt_trajectories(store: SealedStore, tk: TenantKeys, new: int, cursor: str | None,
                            progress: ProgressCallback | None, done: int, total: int) -> tuple[int, str | None]:
    """Re-seal every trajectory after ``cursor`` not under ``new``; returns (count, last cursor seen)."""
    moved = 0
    while True:
        rows = store.storage.traj_scan(tk.tenant.value, cursor, _BATCH)
        batch = []
        for row in rows:
            if envelope.sealed_version(row.sealed, "trajectory") != new:
                body = store._open(tk, KIND_TRAJECTORY, row.record_id, row.sealed)
                batch.append((row.record_id, store.keychain.seal(tk, KIND_TRAJECTORY, row.record_id, body)))
        if batch:
            store.storage.traj_replace(tk.tenant.value, batch)
            moved += len(batch)
            _report(progress, "re-encrypt", done + moved, total, "records")
        if rows:
            cursor = rows[-1].cursor
        if len(rows) < _BATCH:
            return moved, cursor


def _reencrypt_blobs(store: SealedStore, tk: TenantKeys, new: int, kinds: tuple[str, ...]) -> int:
    moved = 0
    for kind in kinds:
        for listed in store.storage.blob_list(tk.tenant.value, kind):
            blob = store.storage.blob_get(tk.tenant.value, kind, listed.tag)
            if blob is None or envelope.sealed_version(blob.head, kind) == new:
                continue
            head_rid = blob_record_id(blob.tag, blob.blob_id, 0, 0)
            head = store._open(tk, kind, head_rid, blob.head)
            n = len(blob.chunks or [])
            chunks = []
            for i, c in enumerate(blob.chunks or []):
                rid = blob_record_id(blob.tag, blob.blob_id, i + 1, n)
                chunks.append(store.keychain.seal(tk, kind, rid, store._open(tk, kind, rid, c)))
            store.storage.blob_put(tk.tenant.value, kind, blob.tag, blob.blob_id,
                                   store.keychain.seal(tk, kind, head_rid, head), chunks)
            moved += 1
    return moved


def rotate_master_key(store: SealedStore, progress: ProgressCallback | None = None,
                      retire_old: bool = True) -> RotationReport:
    """See ``HistoryStore.rotate_master_key`` and the module docstring. A keyring from a file gets a new
    version written first; one from the environment must already hold the new version as primary."""
    kc, storage = store.keychain, store.storage
    ring = kc.keyring
    if ring.path is not None:
        ring = ring.with_new_version()
        ring.save()  # both versions on disk before anything is re-wrapped
    elif not _needs_rewrap(store, ring.primary):
        raise MasterKeyError(
            f"every key is already wrapped by master key version {ring.primary}; to rotate, add version "
            f"{ring.primary + 1} to {ring.source} (as {ring.primary + 1}:<base64>, keeping the old one) and restart"
        )
    kc.set_keyring(ring)
    primary = ring.primary
    num = 0
    for name, wrapped in storage.meta_items(SYSTEM_KEY_PREFIX).items():
        if envelope.sealed_version(wrapped, name) != primary:
            key_name = name[len(SYSTEM_KEY_PREFIX):]
            storage.meta_put(name, kc.wrap(envelope.SYSTEM_OWNER, key_name, kc.unwrap(envelope.SYSTEM_OWNER, key_name, wrapped)))
            num += 1
    tids = storage.tenant_ids()
    for i, tid in enumerate(tids):
        owner = TenantId(tid).raw
        rewrapped = {
            name: kc.wrap(owner, name, kc.unwrap(owner, name, w))
            for name, w in storage.keys_get(tid).items()
            if envelope.sealed_version(w, name) != primary
        }
        if rewrapped:
            storage.keys_put(tid, rewrapped)
            num += len(rewrapped)
        _report(progress, "re-wrap", i + 1, len(tids), "tenants")
    if retire_old:
        retire_master_versions(store, [v for v in ring.versions if v != primary])
    log.info("master key rotated to version %d: %d keys re-wrapped", primary, num)
    return RotationReport(primary, num)


def _needs_rewrap(store: SealedStore, primary: int) -> bool:
    storage = store.storage
    if any(envelope.sealed_version(w, n) != primary for n, w in storage.meta_items(SYSTEM_KEY_PREFIX).items()):
        return True
    return any(
        envelope.sealed_version(w, n) != primary for tid in storage.tenant_ids() for n, w in storage.keys_get(tid).items()
    )


def retire_master_versions(store: SealedStore, versions: list[int]) -> None:
    """Forget master key versions that no longer wrap anything: delete their check values and remove them
    from the key file (if Reprise owns it). Refuses while a key is still wrapped by one of them."""
    if not versions:
        return
    storage, kc = store.storage, store.keychain
    if kc.keyring.primary in versions:
        raise MasterKeyError(f"cannot retire the primary master key version {kc.keyring.primary}")
    in_use = {envelope.sealed_version(w, n) for n, w in storage.meta_items(SYSTEM_KEY_PREFIX).items()}
    for tid in storage.tenant_ids():
        in_use |= {envelope.sealed_version(w, n) for n, w in storage.keys_get(tid).items()}
    busy = sorted(set(versions) & in_use)
    if busy:
        raise MasterKeyError(f"master key version(s) {busy} still wrap data keys: rotate before retiring them")
    for v in versions:
        storage.meta_delete(f"{CHECK_PREFIX}{v}")
    ring = kc.keyring.without(versions)
    if ring.path is not None:
        ring.save()
    else:
        log.warning("master key version(s) %s retired: remove them from %s and destroy them", versions, ring.source)
    kc.keyring = ring


