"""One replica's view of the tenants it holds in memory, kept in step with every replica's writes.

The store is the source of truth and each tenant's history is a Redis Stream in commit order
(``privacy.redis_storage``). A replica holds some tenants' indexes in memory (``Held``: the stream cursor
applied so far); the only way a trajectory enters a held index is ``catch_up``, which applies the
stream's entries after the cursor, in order, under the tenant's lock. So a replica never applies a
write twice (the cursor only moves forward) and never misses one (stream ids only grow, so nothing can
land behind the cursor), its own writes included: they are applied from the stream right after the
append returns (``after_append``), not when the request finishes.

Who calls ``catch_up``: the writer after its own appends; the feed listener when another replica
announces an append (``privacy.changefeed``: one blocking XREAD for all tenants); the resync loop every
``resync_interval_s`` for every held tenant (the backstop when an announcement was lost).

A tenant is loaded on first use (``ensure``) from its sealed snapshot plus the stream after the
snapshot's cursor, or rebuilt from the whole stream when it has none; beyond ``index_memory_bytes`` the
least recently used tenants are evicted whole (``reprise.cluster.upkeep`` seals their snapshot first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from privacy import changefeed
from privacy.changefeed import KIND_APPEND, KIND_SNAPSHOT, tenant_state
from privacy.errors import StorageError
from privacy.tenants import TenantId
from reprise.cluster.loading import SNAPSHOT_NAME, Held, apply_stream, restore_snapshot, start_rebuild
from reprise.config import ClusterConfig

log = logging.getLogger(__name__)
_LEFTOVER_WINDOW_S = 120.0  # a write this recent may have landed after another replica's purge
_LEASE_S = 120.0


class Replica:
    """Held tenants, their loading, catching up and eviction. Thread-safe."""

    def __init__(self, store: Any, proposer: Any, config: ClusterConfig, feed: Any, metrics: Any = None) -> None:
        self.store = store
        self.proposer = proposer
        self.config = config
        self.name = config.name
        self.feed = feed
        self.metrics = metrics
        self.set_proposer(proposer)
        self._held: OrderedDict[str, Held] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.deleted: set[str] = set()
        self.last_write: dict[str, float] = {}             # tenant -> monotonic time of this replica's write
        self._gone_callbacks: list[Callable[[str], None]] = []
        self._keys_callbacks: list[Callable[[str], None]] = []
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="reprise-load")
        self._store_down_until = 0.0
        self.evicted_snapshots: list[tuple[str, bytes, str]] = []  # sealed by upkeep, off the caller's thread
        self.purge_pending: dict[str, float] = {}          # deleted tenants this replica wrote to lately
        self._load_errors: dict[str, str] = {}
        self.num_evictions = 0

    def set_proposer(self, proposer: Any) -> None:
        """The proposer whose per-tenant indexes this replica keeps (None: none yet)."""
        self.proposer = proposer
        self.has_indexes = all(hasattr(proposer, m) for m in ("record", "evict", "delete", "index_stats"))
        self.has_snapshots = hasattr(proposer, "snapshot") and hasattr(proposer, "restore")

    # ---- callbacks ----

    def on_tenant_gone(self, callback: Callable[[str], None]) -> None:
        """``callback(tenant)`` after a tenant's deletion reached this replica (auth, admission, figures)."""
        self._gone_callbacks.append(callback)

    def on_keys_changed(self, callback: Callable[[str], None]) -> None:
        """``callback(tenant)`` after another replica rotated a tenant's keys."""
        self._keys_callbacks.append(callback)

    # ---- holding tenants ----

    def is_held(self, tenant: str) -> bool:
        with self._lock:
            held = self._held.get(tenant)
            return held is not None and held.loaded

    def held_tenants(self) -> list[tuple[str, Held]]:
        with self._lock:
            return list(self._held.items())

    def ensure(self, tenant: str, wait_s: float | None = None, rebuild: bool = False) -> bool:
        """Start loading ``tenant`` unless held (``rebuild``: from the whole stream, not the snapshot);
        wait up to ``wait_s`` (None: until done). True if its index is in memory now. While the store
        is down a missing tenant is not loaded (False)."""
        if not self.has_indexes or tenant in self.deleted:
            return False
        with self._lock:
            held = self._held.get(tenant)
            if held is None:
                if time.monotonic() < self._store_down_until and not rebuild:
                    return False
                held = self._held[tenant] = Held()
                self._loader.submit(self._load, tenant, held, rebuild)
            else:
                self._held.move_to_end(tenant)
        held.done.wait(wait_s)
        return held.loaded

    def load_error(self, tenant: str) -> str:
        """Why the tenant's last load failed ("" if it did not)."""
        return self._load_errors.get(tenant, "")

    @contextmanager
    def locked(self, tenant: str) -> Iterator[None]:
        """Hold the tenant's lock (no catch-up or snapshot of it meanwhile); a no-op unless held."""
        with self._lock:
            held = self._held.get(tenant)
        if held is None:
            yield
            return
        with held.lock:
            yield

    @contextmanager
    def pinned(self, tenant: str) -> Iterator[None]:
        """Keep ``tenant`` from eviction while a request of it runs."""
        with self._lock:
            held = self._held.get(tenant)
            if held is not None:
                held.pins += 1
        try:
            yield
        finally:
            if held is not None:
                with self._lock:
                    held.pins -= 1

    def _load(self, tenant: str, held: Held, rebuild: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            with held.lock:
                held.source = restore_snapshot(self.store, self.proposer, tenant, held) if self.has_snapshots and not rebuild else ""
                if not held.source:
                    start_rebuild(self.store, self.proposer, tenant, held)
                    held.source = "rebuild"
                held.since_snapshot += apply_stream(self.store, self.proposer, tenant, held, self.metrics)
                held.loaded = True
            self._load_errors.pop(tenant, None)
            seconds = time.perf_counter() - t0
            log.info("tenant %s: index loaded (%s) in %.2f s up to %s", tenant, held.source, seconds, held.cursor)
            if self.metrics is not None:
                self.metrics.loads.labels(source=held.source).inc()
                self.metrics.load_seconds.observe(seconds)
        except Exception as exc:
            held.load_error = self._load_errors[tenant] = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, StorageError):
                self._store_down_until = time.monotonic() + 1.0
                log.warning("tenant %s: cannot load its index, the store is unavailable (%s)", tenant, exc)
            elif isinstance(exc, KeyError):  # deleted meanwhile
                pass
            else:
                log.exception("tenant %s: loading its index failed; serving it without history", tenant)
            with self._lock:
                if self._held.get(tenant) is held:
                    del self._held[tenant]
            self.proposer.evict(tenant)
        finally:
            held.done.set()
        if held.loaded:
            # An append announced while the load ran was skipped by catch_up (not loaded yet): read the
            # stream once more now that announcements are applied.
            self.catch_up(tenant)
            self.enforce_budget()

    def cursor(self, tenant: str) -> str | None:
        """The stream cursor applied for a held tenant, else None."""
        with self._lock:
            held = self._held.get(tenant)
        return held.cursor if held is not None and held.loaded else None

    def note_write(self, tenant: str) -> None:
        """This replica is about to write for ``tenant`` (a deletion racing it may need a cleanup)."""
        self.last_write[tenant] = time.monotonic()

    def catch_up(self, tenant: str) -> int:
        """Apply whatever the tenant's stream holds past this replica's cursor (no-op unless held)."""
        with self._lock:
            held = self._held.get(tenant)
        if held is None or not held.loaded:
            return 0
        with held.lock:
            if not held.loaded:  # evicted while we waited
                return 0
            n = apply_stream(self.store, self.proposer, tenant, held, self.metrics, lag=True)
            held.since_snapshot += n
        if n and self.metrics is not None:
            self.metrics.applied.inc(n)
        return n

    def after_append(self, tenant: str, cursor: str) -> None:
        """This replica appended up to ``cursor``: tell the others, then apply it here."""
        self.note_write(tenant)
        try:
            self.feed.publish(KIND_APPEND, TenantId(tenant), cursor, self.name)
        except StorageError as exc:  # the others catch up at their next resync
            log.warning("tenant %s: could not announce an append (%s)", tenant, exc)
        try:
            self.catch_up(tenant)
        except StorageError as exc:  # applied at the next resync
            log.warning("tenant %s: could not apply its own append yet (%s)", tenant, exc)

    # ---- eviction ----

    def evict(self, tenant: str, seal: bool = False) -> bool:
        """Drop a held tenant's index (reloaded on next use). With ``seal`` and applied trajectories past
        its snapshot, its current state is kept for ``upkeep`` to seal as the new snapshot."""
        with self._lock:
            held = self._held.pop(tenant, None)
        if held is None:
            return False
        with held.lock:
            if seal and held.loaded and held.since_snapshot and self.has_snapshots:
                with self._lock:
                    self.evicted_snapshots.append((tenant, self.proposer.snapshot(tenant), held.cursor))
            held.loaded = False
            self.proposer.evict(tenant)
        self.num_evictions += 1
        if self.metrics is not None:
            self.metrics.evictions.inc()
        return True

    def memory_bytes(self) -> dict[str, int]:
        """Index memory of every held tenant."""
        out = {}
        for tenant, held in self.held_tenants():
            if held.loaded:
                try:
                    out[tenant] = int(self.proposer.index_stats(tenant).memory_bytes)
                except KeyError:
                    continue
        return out

    def enforce_budget(self) -> int:
        """Evict least recently used tenants (never one in use, never the most recent) until the held
        indexes fit ``index_memory_bytes``; returns how many were evicted."""
        budget = self.config.index_memory_bytes
        if not budget:
            return 0
        sizes = self.memory_bytes()
        total, evicted = sum(sizes.values()), 0
        order = [t for t, _ in self.held_tenants()]
        for tenant in order[:-1]:
            if total <= budget:
                break
            with self._lock:
                held = self._held.get(tenant)
                busy = held is None or held.pins > 0 or not held.loaded
            if busy or tenant not in sizes:
                continue
            if self.evict(tenant, seal=True):
                total -= sizes[tenant]
                evicted += 1
        return evicted

    # ---- deletion and keys ----

    def tenant_deleted(self, tenant: str) -> None:
        """The tenant is gone (deleted here or anywhere): refuse it, drop its index and cached keys,
        tell the callbacks. Idempotent."""
        with self._lock:
            first = tenant not in self.deleted
            self.deleted.add(tenant)
            held = self._held.pop(tenant, None)
        if held is not None:
            with held.lock:  # waits for a load, catch-up or snapshot of it in progress
                held.loaded = False
        if hasattr(self.proposer, "delete"):
            self.proposer.delete(tenant)
        self.store.evict_tenant(TenantId(tenant))
        if time.monotonic() - self.last_write.get(tenant, -1e9) < _LEFTOVER_WINDOW_S:
            with self._lock:
                self.purge_pending.setdefault(tenant, time.monotonic())
        if first:
            log.warning("tenant %s: deleted; its index is dropped on this replica", tenant)
            for callback in self._gone_callbacks:
                try:
                    callback(tenant)
                except Exception:
                    log.exception("tenant-gone callback %r failed for %s", callback, tenant)

    def keys_changed(self, tenant: str) -> None:
        """Another replica rotated the tenant's API or data keys: reload them from the store."""
        self.store.evict_tenant(TenantId(tenant))
        for callback in self._keys_callbacks:
            callback(tenant)

    # ---- upkeep (called from reprise.cluster.upkeep's threads) ----

    def resync(self) -> int:
        """Read every held tenant's stream directly (the backstop for lost announcements) and drop
        tenants deleted behind the service's back; returns trajectories applied."""
        n = 0
        for tenant, held in self.held_tenants():
            if not held.loaded:
                continue
            if tenant_state(self.store, TenantId(tenant)) != "active":
                self.tenant_deleted(tenant)
                continue
            n += self.catch_up(tenant)
        return n

    def seal_snapshot(self, tenant: str, data: bytes | None = None, cursor: str = "") -> bool:
        """Seal the tenant's index as its snapshot: the held index (``data`` None), or bytes taken at
        eviction. Under the tenant's lease, so replicas do not compact the same tenant at once."""
        if tenant in self.deleted or not self.has_snapshots:
            return False
        tid = TenantId(tenant)
        if not self.feed.try_lease(tid, "snapshot", self.name, _LEASE_S):
            return False  # another replica is sealing it
        try:
            self.note_write(tenant)
            if data is not None:
                self.store.put_snapshot(tid, data, cursor, SNAPSHOT_NAME)
            else:
                with self._lock:
                    held = self._held.get(tenant)
                if held is None:
                    return False
                with held.lock:  # appends wait (not decoding); the bytes match the cursor exactly
                    if not held.loaded:
                        return False
                    data, cursor = self.proposer.snapshot(tenant), held.cursor
                    self.store.put_snapshot(tid, data, cursor, SNAPSHOT_NAME)
                    held.since_snapshot = 0
            self.feed.publish(KIND_SNAPSHOT, tid, cursor, self.name)
        finally:
            self.feed.release_lease(tid, "snapshot", self.name)
        if self.metrics is not None:
            self.metrics.snapshots.inc()
            self.metrics.snapshot_bytes.observe(len(data))
        log.info("tenant %s: sealed an index snapshot of %d bytes up to %s", tenant, len(data), cursor)
        return True

    def snapshot_seen(self, tenant: str) -> None:
        """Another replica sealed a snapshot of this tenant: this one's tail restarts from it."""
        with self._lock:
            held = self._held.get(tenant)
        if held is not None:
            held.since_snapshot = 0

    def compact(self) -> int:
        """Seal snapshots that are due (evicted tenants' first); returns how many were sealed."""
        with self._lock:
            evicted, self.evicted_snapshots = self.evicted_snapshots, []
        n = sum(self.seal_snapshot(t, data, cursor) for t, data, cursor in evicted)
        for tenant, held in self.held_tenants():
            if held.loaded and held.since_snapshot >= self.config.snapshot_every:
                n += self.seal_snapshot(tenant)
        return n

    def purge_leftovers(self) -> int:
        """Remove what this replica's writes racing a deletion left behind, once the purge is done."""
        with self._lock:
            pending = list(self.purge_pending.items())
        done = 0
        for tenant, since in pending:
            state = tenant_state(self.store, TenantId(tenant))
            if state == "gone":
                done += changefeed.purge_leftovers(self.store, TenantId(tenant))
            elif state == "deleting" and time.monotonic() - since < 600:
                continue  # its purge is still running somewhere
            with self._lock:
                self.purge_pending.pop(tenant, None)
        return done

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
