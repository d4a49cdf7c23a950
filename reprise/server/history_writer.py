"""Persists finished requests' trajectories to the encrypted store, off the engine thread.

The engine hands each recorded turn to ``put`` (non-blocking), which returns a ``WriteTicket``; a writer
thread seals and appends the queued turns in batches per tenant (one transaction each), so a slow fsync
or a Redis round trip never delays a decoding step, and turns that finish while one batch commits share
the next commit (group commit). The decode backend waits on a turn's ticket before the request's final
message goes out: a completion a client has seen is in the store. ``flush`` waits until everything
queued so far is stored (graceful shutdown calls it). A turn that cannot be stored (the queue is full,
the store fails) resolves its ticket with the error, is counted, and is never written under another
tenant; a tenant deleted meanwhile has nothing to keep (its tickets resolve as stored).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from privacy.errors import UnknownTenantError
from privacy.records import Trajectory
from privacy.tenants import TenantId
from reprise.engine.request import GenerationResult

log = logging.getLogger(__name__)
STOP = object()  # queued by close(): the writer thread ends after what came before it


class WriteTicket:
    """Resolved once its turn is stored (``ok``) or given up (``ok`` False, ``error`` says why)."""

    __slots__ = ("_callbacks", "_done", "_lock", "error", "ok")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.ok = False
        self.error = ""

    def resolve(self, ok: bool, error: str = "") -> None:
        self.ok, self.error = ok, error
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from the writer's thread) once resolved; at once if it already is."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it was resolved within ``timeout`` seconds."""
        return self._done.wait(timeout)


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


def trajectories_by_tenant(batch: list[tuple[GenerationResult, WriteTicket]]
                           ) -> dict[str, tuple[list[Trajectory], list[WriteTicket]]]:
    """Queued turns as the store's trajectories (prompt then output tokens, the prompt's length, stamped
    now) with their tickets, by tenant. ``privacy.Trajectory`` is the sealed form: privacy imports
    nothing above it."""
    by_tenant: dict[str, tuple[list[Trajectory], list[WriteTicket]]] = defaultdict(lambda: ([], []))
    now = time.time()
    for r, ticket in batch:
        request = r.request
        ids = np.asarray(list(request.prompt_ids) + list(r.token_ids), dtype=np.int32)
        trajectories, tickets = by_tenant[request.tenant]
        trajectories.append(Trajectory(request.session_id, ids, "", len(request.prompt_ids), 0.0, now))
        tickets.append(ticket)
    return by_tenant


class TrajectoryWriter:
    """What the history writers share: ``put`` queues a finished turn without blocking the engine; one
    thread drains the queue in batches and hands each tenant's trajectories to ``_append``, then resolves
    their tickets; ``flush`` waits for what was queued before it; ``close`` stores what is queued, then
    stops. Subclasses say how one tenant's batch is appended (``_append`` returns None when it is stored
    or there is nothing to keep, else why it was given up) and count what they store in ``num_written``."""

    def __init__(self, store: Any, max_queue: int = 10_000, max_batch: int = 64, metrics: Any = None) -> None:
        self._store = store
        self._queue: queue.Queue[Any] = queue.Queue(max_queue)
        self._max_batch = max_batch
        self._metrics = metrics
        self._closing = threading.Event()
        self.num_written = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="reprise-history", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Trajectories queued or being retried (approximate)."""
        return self._queue.qsize()

    def put(self, record: GenerationResult) -> WriteTicket | None:
        """Queue a finished turn (called on the engine thread; never blocks)."""
        ticket = WriteTicket()
        try:
            self._queue.put_nowait((record, ticket))
        except queue.Full:
            why = f"the write queue is full ({self._queue.maxsize}; is the store down?)"
            self._dropped(1, why)
            ticket.resolve(False, why)
        return ticket

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before this call is stored; False on timeout."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Store what is queued (waiting up to ``timeout`` for it), then stop the thread."""
        if not self.flush(timeout):
            log.error("history writer: the store did not come back within %.0f s; %d trajectories are not "
                      "stored", timeout, self.pending)
        self._closing.set()
        try:
            self._queue.put(STOP, timeout=1)
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
                for tenant, (trajectories, tickets) in trajectories_by_tenant(batch).items():
                    error = self._append(tenant, trajectories)
                    for ticket in tickets:
                        ticket.resolve(error is None, error or "")
            for event in events:
                event.set()
            if stop:
                return

    def _append(self, tenant: str, trajectories: list[Trajectory]) -> str | None:
        raise NotImplementedError


class HistoryWriter(TrajectoryWriter):
    """The writer of a single server: one append per tenant and batch; a failed append is dropped and
    logged (history is rebuildable)."""

    def _append(self, tenant: str, trajectories: list[Trajectory]) -> str | None:
        try:
            self._store.append_trajectories(TenantId(tenant), trajectories)
            self.num_written += len(trajectories)
        except UnknownTenantError:
            self.num_dropped += len(trajectories)  # deleted while its requests ran: nothing to keep
        except Exception as exc:
            log.exception("could not store %d trajectories of tenant %s", len(trajectories), tenant)
            self._dropped(len(trajectories), "unexpected error (logged above)")
            return f"the store failed: {type(exc).__name__}"
        return None
