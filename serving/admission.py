"""Admission of generation requests: in-flight requests in total and per tenant, on the event loop.

A request counts from admission until its backend stream has ended (so the count is the truth about
model resources held, whichever front it came through), and can be cancelled out of band (``abort``,
tenant deletion, shutdown) through its ``cancel`` event, which the engine reads at every step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serving import errors


class CancelEvent(threading.Event):
    """A ``threading.Event`` (what an engine thread reads at every step) that also calls back whoever
    must act at once when it is set (vLLM's bridge cancels its task; no one polls)."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        with self._callbacks_lock:
            already = self.is_set()
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        if not already:
            for callback in callbacks:
                callback()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the event is set (at once if it already is)."""
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        callback()


@dataclass(eq=False, slots=True)
class ActiveRequest:
    """An admitted request's entry: ``cancel`` stops it at the engine's next step; ``aborted`` says the
    cancel came from ``abort`` (or a deleted tenant), not from the caller going away."""

    tenant: str
    request_id: str
    cancel: CancelEvent = field(default_factory=CancelEvent)
    aborted: bool = False
    started: float = field(default_factory=time.monotonic)


class Admission:
    """In-flight generation requests; all methods run on the event loop."""

    def __init__(self, max_total: int, max_per_tenant: int,
                 on_change: Callable[[int], None] | None = None) -> None:
        self.max_total = max_total
        self.max_per_tenant = max_per_tenant
        self.draining = False
        self._by_tenant: dict[str, dict[str, ActiveRequest]] = {}
        self._total = 0
        self._on_change = on_change
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active(self) -> int:
        return self._total

    def admit(self, tenant: str, request_id: str) -> ActiveRequest:
        if self.draining:
            raise errors.Unavailable("server is shutting down; retry on another replica")
        mine = self._by_tenant.setdefault(tenant, {})
        if request_id in mine:
            raise errors.AlreadyExists(f"request_id {request_id!r} is already in flight")
        if len(mine) >= self.max_per_tenant:
            raise errors.ResourceExhausted(
                f"this tenant already has {len(mine)} requests in flight (limit {self.max_per_tenant})")
        if self._total >= self.max_total:
            raise errors.ResourceExhausted(f"server is at its limit of {self.max_total} requests in flight")
        active = ActiveRequest(tenant, request_id)
        mine[request_id] = active
        self._changed(+1)
        return active

    def release(self, active: ActiveRequest) -> None:
        mine = self._by_tenant.get(active.tenant)
        if mine is None or mine.get(active.request_id) is not active:
            return
        del mine[active.request_id]
        if not mine:
            del self._by_tenant[active.tenant]
        self._changed(-1)

    def abort(self, tenant: str, request_id: str) -> bool:
        """Cancel one of ``tenant``'s requests; False if it has none with that id."""
        active = self._by_tenant.get(tenant, {}).get(request_id)
        if active is None:
            return False
        active.aborted = True
        active.cancel.set()
        return True

    def cancel_tenant(self, tenant: str) -> int:
        requests = list(self._by_tenant.get(tenant, {}).values())
        for active in requests:
            active.aborted = True
            active.cancel.set()
        return len(requests)

    def cancel_all(self) -> None:
        for mine in self._by_tenant.values():
            for active in mine.values():
                active.cancel.set()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no request is in flight (graceful shutdown); False when ``timeout`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _changed(self, delta: int) -> None:
        self._total += delta
        if self._total:
            self._idle.clear()
        else:
            self._idle.set()
        if self._on_change is not None:
            self._on_change(self._total)
