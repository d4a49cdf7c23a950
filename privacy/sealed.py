"""What key rotation (``privacy.rotation``), export/import (``privacy.transfer``) and the integrity check
(``privacy.integrity``) need of the store they work on: ``SealedStore``, exactly the members they use.
``privacy.history.HistoryStore`` implements it and calls them; they import nothing of it, so none of them
forms an import circle with the history store (``tools/import_graph.py`` checks, TYPE_CHECKING included).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from privacy.keychain import Keychain, TenantKeys
from privacy.records import (
    BadRecordCallback,
    CorpusInfo,
    DeletionReport,
    Trajectory,
    TrajectoryRecord,
    TrajectoryRef,
)
from privacy.storage import Storage, StoredBlob
from privacy.tenants import Tenant, TenantId


class SealedStore(Protocol):
    """The encrypted history store as rotation, transfer and the integrity check see it: its storage and
    keychain, opening a sealed record, telling other processes a tenant's keys changed, and the public
    calls an import replays (tenants, trajectories, blobs)."""

    storage: Storage
    keychain: Keychain

    def _open(self, tk: TenantKeys, kind: str, record_id: bytes, sealed: bytes) -> bytes:
        """A sealed record's plaintext (IntegrityError when it does not authenticate)."""
        ...

    def _keys_changed(self, tenant: TenantId) -> None:
        """Run the key-change hooks: other processes drop their cached keys of ``tenant``."""
        ...

    def _blob_head(self, tk: TenantKeys, kind: str, blob: StoredBlob) -> dict[str, Any]:
        """A stored blob's opened head record."""
        ...

    def _get_blob(self, tk: TenantKeys, kind: str, tag: bytes) -> tuple[dict[str, Any], bytes] | None:
        """A blob's head and its opened body, or None."""
        ...

    def get_tenant(self, tenant: TenantId) -> Tenant: ...

    def create_tenant(self, name: str) -> Tenant: ...

    def delete_tenant(self, tenant: TenantId, dry_run: bool = False) -> DeletionReport: ...

    def count_trajectories(self, tenant: TenantId) -> int: ...

    def iter_trajectories(self, tenant: TenantId, after: str | None = None, session_id: str | None = None,
                          batch_size: int = 512, on_bad: BadRecordCallback | None = None) -> Iterator[TrajectoryRecord]: ...

    def append_trajectories(self, tenant: TenantId, trajectories: Sequence[Trajectory]) -> list[TrajectoryRef]: ...

    def put_snapshot(self, tenant: TenantId, data: bytes, cursor: str = "", name: str = "default") -> None: ...

    def add_corpus_documents(self, tenant: TenantId, documents: Sequence[Sequence[int] | np.ndarray],
                             name: str = "default", replace: bool = False) -> CorpusInfo: ...

    def put_hidden_states(self, tenant: TenantId, key: str, positions: Sequence[int] | np.ndarray,
                          states: np.ndarray) -> None: ...

    def put_response(self, tenant: TenantId, response_id: str, body: bytes, expires_at: float) -> None: ...
