"""The history sink of a replica: finished requests' trajectories, sealed and appended off the engine
thread, announced to the other replicas, applied to this replica's index from the stream.

Like ``reprise.server.history_writer.HistoryWriter`` (batched per tenant, one atomic append each) with two
differences. A write that fails because the store is unreachable is retried with backoff until it
lands (Redis restarting, a failover): the trajectories wait in memory, at most ``max_pending``; more are
dropped and counted, and a shutdown that cannot reach the store reports how many it could not write.
And after each append the replica announces it on the change feed and catches the tenant up from its
stream, which is how the trajectory reaches this replica's own index (``reprise.cluster.replica``).

A write whose reply was lost (the connection broke after Redis executed it) may be stored twice when
retried; a duplicate costs index space, never a wrong token. Deleted tenants' trajectories are dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from privacy.errors import StorageError, UnknownTenantError
from privacy.tenants import TenantId
from reprise.engine.request import GenerationResult
from reprise.server.history_writer import TrajectoryWriter, WriteTicket

log = logging.getLogger(__name__)


class ReplicaWriter(TrajectoryWriter):
    """Sealed, retried, announced appends of finished requests' trajectories. Thread-safe ``put``."""

    def __init__(self, store: Any, replica: Any, max_pending: int = 10_000, max_batch: int = 64,
                 metrics: Any = None) -> None:
        self._replica = replica
        self.num_retries = 0
        super().__init__(store, max_pending, max_batch, metrics)

    def put(self, record: GenerationResult) -> WriteTicket | None:
        """Queue a finished turn (engine thread; never blocks); a deleted tenant's is dropped (None:
        nothing to keep)."""
        if record.request.tenant in self._replica.deleted:
            return None
        return super().put(record)

    def _append(self, tenant: str, trajectories: list[Any]) -> str | None:
        """Append until it lands, the tenant is gone, or the writer closes; why, when given up."""
        backoff = 0.05
        while True:
            if tenant in self._replica.deleted:
                return None
            self._replica.note_write(tenant)
            try:
                refs = self._store.append_trajectories(TenantId(tenant), trajectories)
            except UnknownTenantError:
                return None  # deleted while its requests ran: nothing to keep
            except StorageError as exc:
                if self._closing.is_set():
                    self._dropped(len(trajectories), f"the store is unreachable at shutdown ({exc})")
                    return "the store is unreachable"
                self.num_retries += 1
                if self._metrics is not None:
                    self._metrics.write_retries.inc()
                if backoff == 0.05:
                    log.warning("history writer: the store is unreachable (%s); retrying %d trajectories of "
                                "tenant %s (%d more queued)", exc, len(trajectories), tenant, self.pending)
                time.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            except Exception as exc:
                log.exception("history writer: could not store %d trajectories of tenant %s", len(trajectories), tenant)
                self._dropped(len(trajectories), "unexpected error (logged above)")
                return f"the store failed: {type(exc).__name__}"
            self.num_written += len(trajectories)
            if backoff > 0.05:
                log.warning("history writer: the store is back; stored %d held-back trajectories of tenant %s",
                            len(trajectories), tenant)
            self._replica.after_append(tenant, refs[-1].cursor)
            return None
