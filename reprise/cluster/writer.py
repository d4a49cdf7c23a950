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
import queue
import threading
import time
from typing import Any

from reprise.server.history_writer import STOP, drain, trajectories_by_tenant

log = logging.getLogger(__name__)
_STOP = STOP  # the shared stop marker: drain() recognises it


class ReplicaWriter:
    """Sealed, retried, announced appends of finished requests' trajectories. Thread-safe ``put``."""

    def __init__(self, store: Any, replica: Any, max_pending: int = 10_000, max_batch: int = 64,
                 metrics: Any = None) -> None:
        self._store = store
        self._replica = replica
        self._queue: queue.Queue[Any] = queue.Queue(max_pending)
        self._max_batch = max_batch
        self._metrics = metrics
        self._closing = threading.Event()
        self.num_written = 0
        self.num_dropped = 0
        self.num_retries = 0
        self._thread = threading.Thread(target=self._run, name="reprise-history", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Trajectories queued or being retried (approximate)."""
        return self._queue.qsize()

    def put(self, record: Any) -> None:
        """Queue a ``reprise.engine.request.HistoryRecord`` (engine thread; never blocks)."""
        if record.tenant in self._replica.deleted:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._dropped(1, f"the write queue is full ({self._queue.maxsize}; is the store down?)")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before this call is stored; False on timeout."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Store what is queued (waiting up to ``timeout`` for an unreachable store), then stop."""
        if not self.flush(timeout):
            log.error("history writer: the store did not come back within %.0f s; %d trajectories are not "
                      "stored", timeout, self.pending)
        self._closing.set()
        try:
            self._queue.put(_STOP, timeout=1)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _dropped(self, n: int, why: str) -> None:
        self.num_dropped += n
        if self._metrics is not None:
            self._metrics.writes_dropped.inc(n)
        log.warning("history writer: dropped %d trajectories: %s", n, why)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._closing.is_set():  # closed without room for the stop marker
                    return
                continue
            batch, events, stop = drain(self._queue, item, self._max_batch)
            if batch:
                self._write(batch)
            for event in events:
                event.set()
            if stop:
                return

    def _write(self, batch: list[Any]) -> None:
        for tenant, trajectories in trajectories_by_tenant(batch).items():
            self._append(tenant, trajectories)

    def _append(self, tenant: str, trajectories: list[Any]) -> None:
        """Append until it lands, the tenant is gone, or the writer closes."""
        from privacy.errors import StorageError, UnknownTenantError
        from privacy.tenants import TenantId

        backoff = 0.05
        while True:
            if tenant in self._replica.deleted:
                return
            self._replica.note_write(tenant)
            try:
                refs = self._store.append_trajectories(TenantId(tenant), trajectories)
            except UnknownTenantError:
                return  # deleted while its requests ran: nothing to keep
            except StorageError as exc:
                if self._closing.is_set():
                    self._dropped(len(trajectories), f"the store is unreachable at shutdown ({exc})")
                    return
                self.num_retries += 1
                if self._metrics is not None:
                    self._metrics.write_retries.inc()
                if backoff == 0.05:
                    log.warning("history writer: the store is unreachable (%s); retrying %d trajectories of "
                                "tenant %s (%d more queued)", exc, len(trajectories), tenant, self.pending)
                time.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            except Exception:
                log.exception("history writer: could not store %d trajectories of tenant %s", len(trajectories), tenant)
                self._dropped(len(trajectories), "unexpected error (logged above)")
                return
            self.num_written += len(trajectories)
            if backoff > 0.05:
                log.warning("history writer: the store is back; stored %d held-back trajectories of tenant %s",
                            len(trajectories), tenant)
            self._replica.after_append(tenant, refs[-1].cursor)
            return
