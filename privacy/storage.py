"""The ``Storage`` protocol: what a backend keeps, as opaque bytes. It never sees plaintext or keys.

``HistoryStore`` seals everything before calling a backend, so the backends (SQLite, Redis) only move
sealed values, wrapped keys, random record ids and keyed-hash tags. Tenant ids are the 32-hex opaque
ids; ``tag``s are 16-byte keyed hashes of user-chosen names (session ids, snapshot names).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TenantRow:
    """``info`` is sealed (name, creation time); ``state`` is ``active`` or ``deleting``."""

    tid: str
    name_tag: bytes
    info: bytes
    dek_version: int
    state: str


@dataclass(frozen=True, slots=True)
class CredentialRow:
    """A stored credential: ``owner`` is a tenant id or ``admin``; ``digest`` is a keyed hash."""

    key_id: str
    owner: str
    digest: bytes
    created_at: float

    def encode(self) -> bytes:
        """JSON bytes (no secret in it)."""
        return json.dumps(
            {"owner": self.owner, "digest": self.digest.hex(), "created_at": self.created_at}
        ).encode()

    @classmethod
    def decode(cls, key_id: str, data: bytes) -> CredentialRow:
        """The row stored by :meth:`encode`."""
        d = json.loads(data)
        return cls(key_id, d["owner"], bytes.fromhex(d["digest"]), float(d["created_at"]))


@dataclass(frozen=True, slots=True)
class StoredTrajectory:
    """A trajectory as a backend returns it: commit-order cursor, random record id, sealed bytes."""

    cursor: str
    record_id: bytes
    sealed: bytes


@dataclass(frozen=True, slots=True)
class StoredBlob:
    """A chunked sealed object: a small sealed ``head`` and, when asked for, its sealed ``chunks``."""

    tag: bytes
    blob_id: bytes
    head: bytes
    chunks: list[bytes] | None


class Storage(Protocol):
    """A backend. Every method is atomic; multi-record writes are all-or-nothing. ``tid`` is a tenant id's
    32 hex digits; a ``cursor`` is the backend's commit-order position (SQLite row id, Redis stream id)."""

    backend: str

    def close(self) -> None:
        """Release connections."""

    # Global metadata: master key check values, wrapped system keys, flags.
    def meta_get(self, name: str) -> bytes | None:
        """The value stored under ``name``, or None."""

    def meta_items(self, prefix: str) -> dict[str, bytes]:
        """Every name starting with ``prefix`` and its value."""

    def meta_put(self, name: str, value: bytes, only_new: bool = False) -> bool:
        """Store a value; with ``only_new`` only if absent. True if it was written."""

    def meta_delete(self, name: str) -> None:
        """Delete a value (no error if absent)."""

    # Tenants, their wrapped keys (``dek:<version>``, ``tag``) and per-key encryption counters.
    def tenant_insert(self, row: TenantRow, keys: Mapping[str, bytes]) -> None:
        """Create a tenant row with its wrapped keys; TenantExistsError if ``row.name_tag`` is taken."""

    def tenant_get(self, tid: str) -> TenantRow | None:
        """The tenant's row (active or being deleted), or None."""

    def tenant_by_name_tag(self, name_tag: bytes) -> str | None:
        """The id of the tenant whose name has this tag, or None."""

    def tenant_ids(self) -> list[str]:
        """Every tenant id, oldest first."""

    def tenant_update(self, tid: str, info: bytes | None = None, dek_version: int | None = None) -> None:
        """Replace the sealed info and/or the current data key version."""

    def tenant_shred(self, tid: str) -> None:
        """In one step: mark the tenant ``deleting``, delete its wrapped keys and its credentials."""

    def tenant_purge(self, tid: str) -> int:
        """Delete everything of the tenant (records, blobs, counters, row, name); returns records deleted."""

    def keys_get(self, tid: str) -> dict[str, bytes]:
        """The tenant's wrapped keys by name."""

    def keys_put(self, tid: str, keys: Mapping[str, bytes]) -> None:
        """Insert or replace wrapped keys."""

    def keys_add(self, tid: str, name: str, wrapped: bytes) -> bool:
        """Insert a wrapped key only if the name is free; True if inserted."""

    def keys_delete(self, tid: str, names: Sequence[str]) -> None:
        """Destroy wrapped keys."""

    def counter_reserve(self, tid: str, version: int, n: int) -> int:
        """Atomically add ``n`` to the encryptions counted for a data key version; returns the new total."""

    def counter_get(self, tid: str, version: int) -> int:
        """Encryptions counted (reserved) for a data key version."""

    # Credentials.
    def cred_put(self, row: CredentialRow) -> None:
        """Insert or replace a credential row."""

    def cred_get(self, key_id: str) -> CredentialRow | None:
        """The credential row of a key id, or None."""

    def cred_list(self, owner: str | None = None) -> list[CredentialRow]:
        """Credential rows of ``owner`` (a tenant id or ``admin``), or all, oldest first."""

    def cred_delete(self, key_ids: Sequence[str]) -> None:
        """Delete credential rows."""

    # Trajectories, in commit order.
    def traj_append(self, tid: str, items: Sequence[tuple[bytes, bytes, bytes]]) -> list[str]:
        """Append ``(record id, session tag, sealed)`` items in one atomic write; returns their cursors."""

    def traj_scan(
        self, tid: str, after: str | None, limit: int, session_tag: bytes | None = None
    ) -> list[StoredTrajectory]:
        """Up to ``limit`` records after cursor ``after`` in commit order (optionally one session's);
        ValueError for a cursor this backend did not produce."""

    def traj_replace(self, tid: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Replace the sealed bytes of ``(record id, sealed)`` records in place (re-encryption)."""

    def traj_delete(self, tid: str, items: Sequence[tuple[str, bytes]]) -> int:
        """Delete the ``(cursor, record id)`` records in one atomic write (repair sets bad records
        aside this way); returns how many existed."""

    def traj_count(self, tid: str) -> int:
        """How many trajectories the tenant has."""

    # Chunked blobs: index snapshots, corpus parts, hidden states.
    def blob_put(self, tid: str, kind: str, tag: bytes, blob_id: bytes, head: bytes, chunks: Sequence[bytes]) -> None:
        """Atomically replace the blob (kind, tag) with a sealed head and sealed chunks."""

    def blob_get(self, tid: str, kind: str, tag: bytes, with_chunks: bool = True) -> StoredBlob | None:
        """The blob (head, and chunks in order when asked), or None."""

    def blob_list(self, tid: str, kind: str) -> list[StoredBlob]:
        """Every blob of a kind, heads only."""

    def blob_delete(self, tid: str, kind: str, tag: bytes) -> bool:
        """Delete a blob; True if it existed."""

    def blob_count(self, tid: str) -> int:
        """How many blobs (of all kinds) the tenant has."""

    def shred_sync(self) -> None:
        """Make deletions reach the backing files where the backend can (SQLite: truncate the WAL)."""
