"""The service-wide memory budget of the tenants' in-memory drafting indexes (``server.index_memory_bytes``).

Each tenant's index is bounded on its own (``drafting.history_max_bytes``); this bounds them together.
``ResidentIndexes`` knows which tenants' indexes are in memory, how big each was when last measured, in
least-recently-used order, and which are in use (pinned by a request in flight). Past the budget the
least recently used tenants that are not in use are evicted whole (never the most recent one: a single
tenant larger than the budget would otherwise be rebuilt for every request). An evicted index is
rebuilt from the tenant's encrypted history the next time the tenant needs it (``TenantIndexes.ensure``);
the store keeps everything, so eviction costs time, never data.

``IndexResidency`` keeps a request's tenant in memory, and pinned, while it decodes: the load runs on a
worker thread before the request reaches the engine, never on the engine's thread. (Replicas on Redis
have their own loader and budget: ``reprise.cluster``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any


class ResidentIndexes:
    """Tenants whose index is in memory, with their sizes, least recently used first. Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the index memory budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes  # 0: no limit
        self.num_evictions = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._pins: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __contains__(self, tenant: str) -> bool:
        with self._lock:
            return tenant in self._sizes

    def touch(self, tenant: str) -> bool:
        """Mark the tenant most recently used; True if its index is in memory."""
        with self._lock:
            if tenant not in self._sizes:
                return False
            self._sizes.move_to_end(tenant)
            return True

    def set_size(self, tenant: str, num_bytes: int) -> None:
        """The tenant's index is in memory and this big (most recently used)."""
        with self._lock:
            self._sizes[tenant] = int(num_bytes)
            self._sizes.move_to_end(tenant)

    def drop(self, tenant: str) -> None:
        with self._lock:
            self._sizes.pop(tenant, None)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    @property
    def num_tenants(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def full(self) -> bool:
        """True when the budget is reached (start-up stops loading tenants here)."""
        return bool(self.budget_bytes) and self.total_bytes >= self.budget_bytes

    @contextmanager
    def pinned(self, tenant: str) -> Iterator[None]:
        """Keep the tenant's index from eviction meanwhile (a request of it is decoding)."""
        with self._lock:
            self._pins[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[tenant] -= 1
                if self._pins[tenant] <= 0:
                    del self._pins[tenant]

    def take_victims(self) -> list[str]:
        """Tenants to evict, least recently used first, until the rest fit the budget; they leave the
        table here (the caller drops their indexes) and count as evictions."""
        if not self.budget_bytes:
            return []
        with self._lock:
            total = sum(self._sizes.values())
            victims = []
            for tenant in list(self._sizes)[:-1]:
                if total <= self.budget_bytes:
                    break
                if self._pins.get(tenant):
                    continue
                total -= self._sizes.pop(tenant)
                victims.append(tenant)
            self.num_evictions += len(victims)
            return victims


class IndexResidency:
    """``serving.backend.TenantResidency`` in one process: a request's tenant is loaded (off the event
    loop) before it decodes if the budget evicted it, pinned while it decodes, measured afterwards (the
    engine recorded the turn into it), and the budget enforced."""

    def __init__(self, indexes: Any) -> None:
        self.indexes = indexes

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, speculate: bool) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        with self.indexes.resident.pinned(tenant):
            if self.indexes.has_indexes and not self.indexes.resident.touch(tenant):  # in memory: no thread hop
                await loop.run_in_executor(None, self.indexes.ensure, tenant)
            try:
                yield
            finally:
                with contextlib.suppress(RuntimeError):  # the loop's executor is shut down: the service stops
                    loop.run_in_executor(None, self.indexes.after_request, tenant)

    def check(self, tenant: str) -> None:
        pass
