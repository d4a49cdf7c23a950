"""What replicas sharing one Redis tell each other: a change feed, per-tenant leases, leftover cleanup.

Each tenant's history already is a Redis Stream (``{t:<id>}:traj``, see ``privacy.redis_storage``): a
replica holding a tenant's index tails it with ``HistoryStore.iter_trajectories(after=cursor)``. The feed
says *which* tenants changed, so a replica need not poll every stream it holds:

    feed = open_feed(store)                          # ValueError unless the store is on Redis
    feed.publish(KIND_APPEND, tenant, cursor=ref.cursor, origin="replica-a")
    for event in feed.read(after=last_id, block_ms=1000):   # blocks up to a second for new events
        ...

Keys (one more ``{meta}`` key, one more per tenant, inside the tenant's hash tag and so removed with it):

    <prefix>:{meta}:feed                    stream  k = event kind, t = tenant id, c = cursor, o = origin
    <prefix>:{t:<id>}:lease:<name>          string  owner, with an expiry (SET NX PX)

The feed is a notification, not the record: an event lost (a writer that dies between its append and its
publish, a feed trimmed past a slow reader, a Redis restart without persistence) only delays a replica
until its periodic resync reads the tenant's stream itself. Events carry opaque tenant ids and stream
cursors, never content. The feed is capped at ``max_len`` entries (approximate trimming).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from privacy.errors import StorageError
from privacy.tenants import TenantId

if TYPE_CHECKING:
    from privacy.history import HistoryStore

KIND_APPEND = "append"      # trajectories committed, up to ``cursor``
KIND_DELETE = "delete"      # tenant crypto-shredded: evict, refuse its requests
KIND_KEYS = "keys"          # API keys or data keys rotated: drop cached credentials and keys
KIND_RELOAD = "reload"      # corpus replaced or index rebuilt: reload from the store on next use
KIND_SNAPSHOT = "snapshot"  # a new index snapshot covers the stream up to ``cursor``
EVENT_KINDS = (KIND_APPEND, KIND_DELETE, KIND_KEYS, KIND_RELOAD, KIND_SNAPSHOT)
_ID_RE = re.compile(r"^\d+-\d+$")
_F = TypeVar("_F", bound=Callable[..., Any])


def _wrap_errors(fn: _F) -> _F:
    @functools.wraps(fn)
    def wrapper(self: ChangeFeed, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except redis.RedisError as exc:
            raise StorageError(f"Redis at {self.where}: {type(exc).__name__}: {exc}") from None

    return wrapper  # type: ignore[return-value]


def stream_position(cursor: str) -> tuple[int, int]:
    """A Redis stream id (``"<ms>-<seq>"``) as a comparable pair; ``""`` is before everything."""
    if not cursor:
        return (-1, -1)
    if not _ID_RE.match(cursor):
        raise ValueError(f"not a stream cursor: {cursor!r}")
    ms, seq = cursor.split("-")
    return (int(ms), int(seq))


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One feed entry: ``id`` (its feed position), ``kind`` (``EVENT_KINDS``), the tenant id, the stream
    ``cursor`` the event reaches (appends) and the ``origin`` replica."""

    id: str
    kind: str
    tenant: str
    cursor: str
    origin: str


class ChangeFeed:
    """The change feed and leases over a ``RedisStorage``'s connection. Thread-safe."""

    def __init__(self, client: Any, prefix: str, where: str, max_len: int = 100_000) -> None:
        if max_len < 100:
            raise ValueError(f"feed max_len must be >= 100, got {max_len}")
        self.r = client
        self.prefix = prefix
        self.where = where
        self.max_len = max_len
        self.key = f"{prefix}:{{meta}}:feed"

    def _lease_key(self, tenant: TenantId, name: str) -> str:
        return f"{self.prefix}:{{t:{tenant.value}}}:lease:{name}"

    @_wrap_errors
    def publish(self, kind: str, tenant: TenantId, cursor: str = "", origin: str = "") -> str:
        """Append an event; returns its feed id."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {EVENT_KINDS}, got {kind!r}")
        if not isinstance(tenant, TenantId):
            raise TypeError(f"tenant must be a TenantId, got {type(tenant).__name__}")
        fields = {"k": kind, "t": tenant.value, "c": cursor, "o": origin}
        return self.r.xadd(self.key, fields, maxlen=self.max_len, approximate=True).decode()

    @_wrap_errors
    def last_id(self) -> str:
        """The id of the newest event (``"0-0"`` when the feed is empty): read after it for new events."""
        newest = self.r.xrevrange(self.key, "+", "-", count=1)
        return newest[0][0].decode() if newest else "0-0"

    @_wrap_errors
    def read(self, after: str, block_ms: int = 1000, count: int = 512) -> list[FeedEvent]:
        """Events after feed id ``after``, oldest first; waits up to ``block_ms`` when there are none
        (0 = do not wait)."""
        stream_position(after)  # ValueError for anything but a stream id
        if block_ms < 0 or count < 1:
            raise ValueError(f"block_ms must be >= 0 and count >= 1, got {block_ms} and {count}")
        reply = self.r.xread({self.key: after}, count=count, block=block_ms or None)
        events: list[FeedEvent] = []
        for _key, entries in reply or ():
            for entry_id, f in entries:
                events.append(FeedEvent(entry_id.decode(), f.get(b"k", b"").decode(), f.get(b"t", b"").decode(),
                                        f.get(b"c", b"").decode(), f.get(b"o", b"").decode()))
        return events

    @_wrap_errors
    def try_lease(self, tenant: TenantId, name: str, owner: str, ttl_s: float) -> bool:
        """Take the tenant's lease ``name`` for ``ttl_s`` seconds unless someone holds it; True if taken."""
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        return bool(self.r.set(self._lease_key(tenant, name), owner, nx=True, px=int(ttl_s * 1000)))

    @_wrap_errors
    def release_lease(self, tenant: TenantId, name: str, owner: str) -> None:
        """Give a lease back if ``owner`` still holds it (a lease that expired and was taken stays)."""
        key = self._lease_key(tenant, name)
        if self.r.get(key) == owner.encode():
            self.r.delete(key)


def open_feed(store: HistoryStore, max_len: int = 100_000) -> ChangeFeed:
    """The change feed of a Redis-backed store (its connection, prefix and Cluster mode);
    ValueError for any other backend."""
    storage: Any = store.storage
    if storage.backend != "redis":
        raise ValueError(f"replicas share history through Redis; this store's backend is {storage.backend!r}")
    c = storage.config
    return ChangeFeed(storage.r, storage.prefix, f"{c.host}:{c.port}", max_len)


def tenant_state(store: HistoryStore, tenant: TenantId) -> str:
    """``active``, ``deleting`` or ``gone``, read from the store (not from any cache)."""
    row = store.storage.tenant_get(tenant.value)
    return "gone" if row is None else row.state


def purge_leftovers(store: HistoryStore, tenant: TenantId) -> int:
    """Delete whatever a write racing the tenant's deletion left behind (a replica that appended or
    sealed a snapshot with keys it still held in memory); returns records deleted. Refuses a tenant that
    still exists (``ValueError``): this never deletes live data."""
    state = tenant_state(store, tenant)
    if state != "gone":
        raise ValueError(f"tenant {tenant.value} is {state}, not gone: nothing to clean up")
    store.keychain.evict(tenant)
    return store.storage.tenant_purge(tenant.value)


def delete_keyspace(store: HistoryStore) -> int:
    """Delete every key under the store's key prefix, on every node (benchmarks and tests that ran on a
    shared Redis under a prefix of their own); returns how many. Refuses the default prefix ``reprise``:
    this is never how a deployment deletes anything."""
    storage: Any = store.storage
    if storage.backend != "redis":
        raise ValueError(f"only a Redis store has a key prefix; this one is {storage.backend!r}")
    if storage.prefix == "reprise":
        raise ValueError("refusing to delete the keys of the default prefix 'reprise'")
    try:
        keys = list(storage.r.scan_iter(match=f"{storage.prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            for key in keys[i:i + 500]:  # one by one: a Cluster refuses multi-slot UNLINK
                storage.r.unlink(key)
    except redis.RedisError as exc:
        raise StorageError(f"Redis at {storage.config.host}:{storage.config.port}: {exc}") from None
    return len(keys)
