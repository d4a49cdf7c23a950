"""Verifying and repairing a tenant's stored history: which records fail authentication or parsing, and
setting them aside so that everything else keeps serving.

    check = verify_history(store, tenant)        # every trajectory and blob opened and parsed; nothing written
    check = repair_history(store, tenant)        # the same, then each bad record moved to quarantine

A bad record is one that does not authenticate under the tenant's keys (a flipped byte, a truncation, a
record moved from elsewhere) or that authenticates but does not parse. Readers that can go on without
it (``HistoryStore.iter_trajectories(on_bad=...)``, ``iter_corpus(on_bad=...)``, the export) skip it
and report it as a ``BadRecord``; repair moves its stored bytes, unchanged, into the tenant's
quarantine (a blob kind of its own that no reader, export or index load ever opens) and deletes the
original, so a later load, verify or export no longer meets it. Quarantined records stay until the
tenant is deleted (crypto-shredding covers them: they are sealed under the tenant's keys).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from privacy.errors import IntegrityError
from privacy.records import (
    BLOB_KINDS,
    KIND_CORPUS,
    KIND_HIDDEN,
    KIND_SNAPSHOT,
    KIND_TRAJECTORY,
    BadRecord,
    decode_documents,
    decode_hidden_states,
    decode_trajectory,
)
from privacy.storage import StoredBlob
from privacy.tenants import Progress, ProgressCallback, TenantId

if TYPE_CHECKING:
    from privacy.keychain import TenantKeys
    from privacy.sealed import SealedStore

KIND_QUARANTINE = "quarantine"
_BATCH = 512


@dataclass(frozen=True, slots=True)
class HistoryCheck:
    """What a verification found (``repaired``: the bad records were moved to quarantine and removed
    from the history). ``num_records`` counts the trajectories and blobs checked; ``num_quarantined``
    the records in the tenant's quarantine afterwards (set aside by this or earlier repairs)."""

    tenant: TenantId
    num_records: int
    bad: tuple[BadRecord, ...]
    repaired: bool
    num_quarantined: int


def trajectory_bad_record(cursor: str, record_id: bytes, exc: Exception) -> BadRecord:
    return BadRecord(KIND_TRAJECTORY, record_id.hex(), cursor, _reason(exc))


def blob_bad_record(kind: str, tag: bytes, exc: Exception) -> BadRecord:
    return BadRecord(kind, tag.hex(), "", _reason(exc))


def _reason(exc: Exception) -> str:
    if isinstance(exc, IntegrityError):
        return str(exc)
    return f"does not parse ({type(exc).__name__}: {exc})"


# A blob whose head authenticates but holds the wrong fields raises one of these while it is read.
BLOB_PARSE_ERRORS: tuple[type[Exception], ...] = (IntegrityError, ValueError, KeyError, TypeError)


def check_blob(store: SealedStore, tk: TenantKeys, kind: str,
               blob: StoredBlob) -> tuple[dict[str, Any], bytes] | None:
    """Open and parse one blob whole: its head and body (None if deleted meanwhile); IntegrityError or
    a parse error (``BLOB_PARSE_ERRORS``) when it is bad."""
    got = store._get_blob(tk, kind, blob.tag)
    if got is None:  # deleted meanwhile
        return None
    head, body = got
    if kind == KIND_CORPUS:
        decode_documents(body)
        _fields(head, part=int, name=str)
    elif kind == KIND_HIDDEN:
        decode_hidden_states(body)
    elif kind == KIND_SNAPSHOT:
        _fields(head, name=str, cursor=str)
    return got


def _fields(head: dict[str, Any], **types: type) -> None:
    for name, kind in types.items():
        if not isinstance(head[name], kind):
            raise TypeError(f"head field {name!r} is {type(head[name]).__name__}, not {kind.__name__}")


def verify_history(store: SealedStore, tenant: TenantId, progress: ProgressCallback | None = None) -> HistoryCheck:
    """Open and parse every trajectory and blob of ``tenant``; report the bad ones. Writes nothing."""
    num, bad = _scan(store, tenant, progress)
    return HistoryCheck(tenant, num, tuple(b for b, _ in bad), False, count_quarantined(store, tenant))


def repair_history(store: SealedStore, tenant: TenantId, progress: ProgressCallback | None = None) -> HistoryCheck:
    """``verify_history``, then move each bad record to the tenant's quarantine and delete it from the
    history (one atomic write per record: a crash leaves it either in place or in quarantine)."""
    num, bad = _scan(store, tenant, progress)
    for record, stored in bad:
        _quarantine(store, tenant, record, stored)
    if progress is not None:
        progress(Progress("repair", len(bad), len(bad), "records"))
    return HistoryCheck(tenant, num, tuple(b for b, _ in bad), True, count_quarantined(store, tenant))


def count_quarantined(store: SealedStore, tenant: TenantId) -> int:
    """Records in the tenant's quarantine."""
    return len(store.storage.blob_list(tenant.value, KIND_QUARANTINE))


def list_quarantined(store: SealedStore, tenant: TenantId) -> list[dict[str, Any]]:
    """What the tenant's quarantine holds: kind, record id, cursor, reason and when it was set aside."""
    return [json.loads(b.head) for b in store.storage.blob_list(tenant.value, KIND_QUARANTINE)]


def _scan(store: SealedStore, tenant: TenantId,
          progress: ProgressCallback | None) -> tuple[int, list[tuple[BadRecord, list[bytes]]]]:
    tk = store.keychain.tenant_keys(tenant)
    total = store.storage.traj_count(tenant.value)
    bad: list[tuple[BadRecord, list[bytes]]] = []
    num, cursor = 0, None
    while True:
        rows = store.storage.traj_scan(tenant.value, cursor, _BATCH)
        for row in rows:
            try:
                decode_trajectory(store._open(tk, KIND_TRAJECTORY, row.record_id, row.sealed))
            except IntegrityError as exc:
                bad.append((trajectory_bad_record(row.cursor, row.record_id, exc), [row.sealed]))
        num += len(rows)
        if progress is not None:
            progress(Progress("verify", num, total, "trajectories"))
        if len(rows) < _BATCH:
            break
        cursor = rows[-1].cursor
    for kind in BLOB_KINDS:
        for blob in store.storage.blob_list(tenant.value, kind):
            num += 1
            try:
                check_blob(store, tk, kind, blob)
            except BLOB_PARSE_ERRORS as exc:
                whole = store.storage.blob_get(tenant.value, kind, blob.tag)
                stored = [whole.head, *(whole.chunks or [])] if whole is not None else [blob.head]
                bad.append((blob_bad_record(kind, blob.tag, exc), stored))
    return num, bad


def _quarantine(store: SealedStore, tenant: TenantId, record: BadRecord, stored: list[bytes]) -> None:
    """Keep the record's stored bytes (still sealed, unchanged) under the tenant's quarantine, then
    delete the original. The quarantine head is plain JSON: ids, cursor and reason, never content."""
    head = json.dumps({"kind": record.kind, "record_id": record.record_id, "cursor": record.cursor,
                       "reason": record.reason, "quarantined_at": time.time()}).encode()
    tag = bytes.fromhex(record.record_id)
    store.storage.blob_put(tenant.value, KIND_QUARANTINE, tag, os.urandom(16), head, stored)
    if record.kind == KIND_TRAJECTORY:
        store.storage.traj_delete(tenant.value, [(record.cursor, tag)])
    else:
        store.storage.blob_delete(tenant.value, record.kind, tag)
