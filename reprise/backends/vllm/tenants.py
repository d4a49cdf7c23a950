"""The tenants' drafting state inside vLLM's worker, as the service's ``TenantIndexes`` sees it.

With the ``vllm`` engine each tenant's history and corpus indexes live in the worker process, next to
the proposer that drafts from them (``worker.RepriseWorkerExtension``); the service keeps none of its
own. ``WorkerTenants`` offers the methods ``reprise.server.indexes.TenantIndexes`` and a replica's
``reprise.cluster.replica.Replica`` call on a proposer (``load_history``, ``record``, ``add_corpus``,
``evict``, ``delete``, ``index_stats``, ``set_tenant_config``, ``snapshot``, ``restore``) and forwards each
to the worker over vLLM's ``collective_rpc``. So the encrypted
store stays the source of truth and the same code loads it: at start-up ``TenantIndexes.load_all``
streams each tenant's stored trajectories (decrypted in the service) to the worker in batches; a
recorded turn, an imported corpus, a rebuild or a deletion reaches the worker the same way; each
tenant's indexes are bounded there by ``drafting.history_max_bytes``, as in the own engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from retrieval.tenant_history import HistoryStats, Trajectory

LOAD_BATCH = 512  # trajectories per collective_rpc while loading a tenant


def token_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as the int32 bytes the worker's methods take."""
    return np.asarray(ids, dtype=np.int32).tobytes()


class WorkerTenants:
    """Proxy for the worker's ``RepriseProposer``: same methods, each one ``collective_rpc`` call."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def _first(self, method: str, *args: Any) -> Any:
        return self._engine.rpc(method, *args)[0]  # every rank holds the same state

    def load_history(self, tenant: str, trajectories: Iterable[Trajectory]) -> int:
        total, batch, first = 0, [], True
        for t in trajectories:
            batch.append((t.session_id, token_bytes(t.prompt_ids), token_bytes(t.output_ids)))
            if len(batch) >= LOAD_BATCH:
                total += self._first("reprise_load", tenant, batch, first)
                batch, first = [], False
        if batch or first:
            total += self._first("reprise_load", tenant, batch, first)
        return total

    def record(self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray,
               output_ids: Sequence[int] | np.ndarray) -> None:
        if not self._first("reprise_record", tenant, session_id, token_bytes(prompt_ids), token_bytes(output_ids)):
            raise KeyError(f"tenant {tenant!r} was deleted")

    def add_corpus(self, tenant: str, documents: Iterable[Sequence[int] | np.ndarray], replace: bool = False) -> int:
        return int(self._first("reprise_add_corpus", tenant, [token_bytes(d) for d in documents], replace))

    def evict(self, tenant: str) -> None:
        self._first("reprise_evict", tenant)

    def delete(self, tenant: str) -> None:
        self._first("reprise_delete", tenant)

    def set_tenant_config(self, tenant: str, config: Any) -> None:
        self._first("reprise_set_tenant_config", tenant, config.to_dict() if config is not None else None)

    def index_stats(self, tenant: str) -> HistoryStats:
        return HistoryStats(**self._first("reprise_index_stats", tenant))

    def snapshot(self, tenant: str) -> bytes:
        """The tenant's drafting state as bytes (a replica seals it as the tenant's snapshot)."""
        return bytes(self._first("reprise_snapshot", tenant))

    def restore(self, tenant: str, data: bytes) -> None:
        """Replace the tenant's drafting state on every rank; ValueError for bytes that are no snapshot,
        KeyError for a deleted tenant (as ``RepriseProposer.restore``)."""
        refused = self._first("reprise_restore", tenant, data)
        if refused == "deleted":
            raise KeyError(f"tenant {tenant!r} was deleted")
        if refused:
            raise ValueError(refused)
