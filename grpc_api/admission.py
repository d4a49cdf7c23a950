"""Admission of generation requests, and the bridge from worker threads to the event loop.

``Admission`` counts in-flight requests in total and per tenant. A request counts from admission until
its worker thread has returned (so the count is the truth about model resources held), and can be
cancelled out of band (``abort``, tenant deletion, shutdown) through its ``cancel`` event.

``ThreadPump`` runs a blocking function in an executor; what it emits arrives on an asyncio queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpc_api import errors


@dataclass(eq=False, slots=True)
class ActiveRequest:
    tenant: str
    request_id: str
    cancel: threading.Event = field(default_factory=threading.Event)
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


@dataclass(frozen=True, slots=True)
class _End:
    result: Any = None
    error: BaseException | None = None


class ThreadPump:
    """Run ``fn(pump, *args)`` in an executor; ``pump.put(item)`` from that thread reaches ``get()``."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None,
                 on_end: Callable[[], None] | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._on_end = on_end

    def put(self, item: Any) -> None:
        """Thread-safe; dropped silently once the loop is closed (nobody is listening)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass

    def start(self, executor: concurrent.futures.Executor, fn: Callable[..., Any],
              *args: Any) -> concurrent.futures.Future:
        def job() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop, re-raised there
                self.put(_End(error=exc))
            else:
                self.put(_End(result=result))

        return executor.submit(job)

    async def items(self):
        """Emitted items, in order; then returns (the function's result in ``self.result``) or raises.

        ``on_end`` runs first: the function has returned by then, so what it held can be let go before
        the caller answers its client.
        """
        while True:
            item = await self.queue.get()
            if isinstance(item, _End):
                if self._on_end is not None:
                    self._on_end()
                if item.error is not None:
                    raise item.error
                self.result = item.result
                return
            yield item
