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
        return json.dumps(
            {"owner": self.owner, "digest": self.digest.hex(), "created_at": self.created_at}
        ).encode()

    @classmethod
    def decode(cls, key_id: str, data: bytes) -> CredentialRow:
        d = json.loads(data)
        return cls(key_id, d["owner"], bytes.fromhex(d["digest"]), float(d["created_at"]))


@dataclass(frozen=True, slots=True)
class StoredTrajectory:
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
    """A backend. Every method is atomic; multi-record writes are all-or-nothing."""

    backend: str

    def close(self) -> None: ...

    # Global metadata: master key check values, wrapped system keys, flags.
    def meta_get(self, name: str) -> bytes | None: ...
    def meta_items(self, prefix: str) -> dict[str, bytes]: ...
    def meta_put(self, name: str, value: bytes, only_new: bool = False) -> bool: ...
    def meta_delete(self, name: str) -> None: ...

    # Tenants and their wrapped keys (``dek:<version>``, ``tag``) and per-key encryption counters.
    def tenant_insert(self, row: TenantRow, keys: Mapping[str, bytes]) -> None: ...
    def tenant_get(self, tid: str) -> TenantRow | None: ...
    def tenant_by_name_tag(self, name_tag: bytes) -> str | None: ...
    def tenant_ids(self) -> list[str]: ...
    def tenant_update(self, tid: str, info: bytes | None = None, dek_version: int | None = None) -> None: ...
    def tenant_shred(self, tid: str) -> None: ...
    def tenant_purge(self, tid: str) -> int: ...
    def keys_get(self, tid: str) -> dict[str, bytes]: ...
    def keys_put(self, tid: str, keys: Mapping[str, bytes]) -> None: ...
    def keys_add(self, tid: str, name: str, wrapped: bytes) -> bool: ...
    def keys_delete(self, tid: str, names: Sequence[str]) -> None: ...
    def counter_reserve(self, tid: str, version: int, n: int) -> int: ...
    def counter_get(self, tid: str, version: int) -> int: ...

    # Credentials.
    def cred_put(self, row: CredentialRow) -> None: ...
    def cred_get(self, key_id: str) -> CredentialRow | None: ...
    def cred_list(self, owner: str | None = None) -> list[CredentialRow]: ...
    def cred_delete(self, key_ids: Sequence[str]) -> None: ...

    # Trajectories, in commit order.
    def traj_append(self, tid: str, items: Sequence[tuple[bytes, bytes, bytes]]) -> list[str]: ...
    def traj_scan(
        self, tid: str, after: str | None, limit: int, session_tag: bytes | None = None
    ) -> list[StoredTrajectory]: ...
    def traj_replace(self, tid: str, items: Sequence[tuple[bytes, bytes]]) -> None: ...
    def traj_count(self, tid: str) -> int: ...

    # Chunked blobs: index snapshots, corpus parts, hidden states.
    def blob_put(self, tid: str, kind: str, tag: bytes, blob_id: bytes, head: bytes, chunks: Sequence[bytes]) -> None: ...
    def blob_get(self, tid: str, kind: str, tag: bytes, with_chunks: bool = True) -> StoredBlob | None: ...
    def blob_list(self, tid: str, kind: str) -> list[StoredBlob]: ...
    def blob_delete(self, tid: str, kind: str, tag: bytes) -> bool: ...
    def blob_count(self, tid: str) -> int: ...

    def shred_sync(self) -> None: ...
