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
from typing import Any

import numpy as np

from privacy.errors import UnknownTenantError
from privacy.records import Trajectory
from privacy.tenants import TenantId
from reprise.engine.request import GenerationResult

log = logging.getLogger(__name__)
STOP = object()  # queued by close(): the writer thread ends after what came before it
_STOP = STOP


class WriteTicket:
    """Resolved once its turn is stored (``ok``) or given up (``ok`` False, ``error`` says why)."""

    __slots__ = ("_done", "error", "ok")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.ok = False
        self.error = ""

    def resolve(self, ok: bool, error: str = "") -> None:
        self.ok, self.error = ok, error
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it was resolved within ``timeout`` seconds."""
        return self._done.wait(timeout)


def failed_ticket(error: str) -> WriteTicket:
    ticket = WriteTicket()
    ticket.resolve(False, error)
    return ticket


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


def resolve_all(tickets: list[WriteTicket], ok: bool, error: str = "") -> None:
    for ticket in tickets:
        ticket.resolve(ok, error)


class HistoryWriter:
    def __init__(self, store: Any, max_queue: int = 10_000, max_batch: int = 64) -> None:
        self._store = store
        self._queue: queue.Queue[Any] = queue.Queue(max_queue)
        self._max_batch = max_batch
        self.num_written = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="reprise-history", daemon=True)
        self._thread.start()

    def put(self, record: GenerationResult) -> WriteTicket:
        """Queue a finished turn (called on the engine thread; never blocks)."""
        ticket = WriteTicket()
        try:
            self._queue.put_nowait((record, ticket))
        except queue.Full:
            self.num_dropped += 1
            log.warning("history queue full: dropped the trajectory of request %s", record.request_id)
            ticket.resolve(False, f"the history queue is full ({self._queue.maxsize} turns waiting for the store)")
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
        for tenant, (trajectories, tickets) in trajectories_by_tenant(batch).items():
            try:
                self._store.append_trajectories(TenantId(tenant), trajectories)
                self.num_written += len(trajectories)
                resolve_all(tickets, True)
            except UnknownTenantError:
                self.num_dropped += len(trajectories)  # deleted while its requests ran: nothing to keep
                resolve_all(tickets, True)
            except Exception as exc:
                self.num_dropped += len(trajectories)
                resolve_all(tickets, False, f"the store failed: {type(exc).__name__}")
                log.exception("could not store %d trajectories of tenant %s", len(trajectories), tenant)
