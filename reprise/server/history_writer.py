"""Persists finished requests' trajectories to the encrypted store, off the engine thread.

The engine hands each recorded request to ``put`` (non-blocking); a writer thread seals and appends
them in batches per tenant (one transaction each), so a slow fsync or a Redis round trip never delays a
decoding step. ``flush`` waits until everything queued so far is stored (graceful shutdown calls it).
History is rebuildable: if the queue is full, or the tenant was deleted meanwhile, a record is dropped
and counted, never retried forever and never written under another tenant.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
STOP = object()  # queued by close(): the writer thread ends after what came before it
_STOP = STOP


def drain(q: queue.Queue[Any], item: Any, max_batch: int) -> tuple[list[Any], list[threading.Event], bool]:
    """``item`` and what else is queued, up to ``max_batch`` records: (records, flush events waiting
    for them, whether the stop marker came)."""
    batch: list[Any] = []
    events: list[threading.Event] = []
    stop = False
    while True:
        if item is STOP:
            stop = True
        elif isinstance(item, threading.Event):
            events.append(item)
        else:
            batch.append(item)
        if len(batch) >= max_batch:
            return batch, events, stop
        try:
            item = q.get_nowait()
        except queue.Empty:
            return batch, events, stop


def trajectories_by_tenant(batch: list[Any]) -> dict[str, list[Any]]:
    """Finished requests (``reprise.engine.request.HistoryRecord``) as the store's trajectories, by tenant:
    prompt then output tokens, the prompt's length, stamped now."""
    from privacy.records import Trajectory

    by_tenant: dict[str, list[Any]] = defaultdict(list)
    now = time.time()
    for r in batch:
        ids = np.asarray(list(r.prompt_ids) + list(r.output_ids), dtype=np.int32)
        by_tenant[r.tenant].append(Trajectory(r.session_id, ids, "", len(r.prompt_ids), 0.0, now))
    return by_tenant


class HistoryWriter:
    def __init__(self, store: Any, max_queue: int = 10_000, max_batch: int = 64) -> None:
        self._store = store
        self._queue: queue.Queue[Any] = queue.Queue(max_queue)
        self._max_batch = max_batch
        self.num_written = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="reprise-history", daemon=True)
        self._thread.start()

    def put(self, record: Any) -> None:
        """Queue a ``reprise.engine.request.HistoryRecord`` (called on the engine thread; never blocks)."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.num_dropped += 1
            log.warning("history queue full: dropped the trajectory of request %s", record.request_id)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before this call is stored; False on timeout."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Store what is queued, then stop the thread."""
        self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch, events, stop = drain(self._queue, self._queue.get(), self._max_batch)
            if batch:
                self._write(batch)
            for event in events:
                event.set()
            if stop:
                return

    def _write(self, batch: list[Any]) -> None:
        from privacy.errors import UnknownTenantError
        from privacy.tenants import TenantId

        for tenant, trajectories in trajectories_by_tenant(batch).items():
            try:
                self._store.append_trajectories(TenantId(tenant), trajectories)
                self.num_written += len(trajectories)
            except UnknownTenantError:
                self.num_dropped += len(trajectories)  # deleted while its requests ran: nothing to keep
            except Exception:
                self.num_dropped += len(trajectories)
                log.exception("could not store %d trajectories of tenant %s", len(trajectories), tenant)
