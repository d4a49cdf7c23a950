"""The Redis backend (single server or Redis Cluster).

Keys: ``<prefix>:{t:<tenant id>}:...`` for everything a tenant owns (one hash tag, so one Cluster slot
and per-tenant MULTI/EXEC works) and ``<prefix>:{meta}:...`` for the registry:

    {meta}:meta       hash   master key checks, wrapped system keys
    {meta}:tenants    zset   tenant ids by creation time
    {meta}:names      hash   name tag -> tenant id
    {meta}:creds      hash   key id -> credential row (keyed hash, owner)
    {t:T}:tenant      hash   name_tag, info (sealed), dek_version, state
    {t:T}:keys        hash   dek:<version> / tag -> wrapped key
    {t:T}:ctr         hash   data key version -> encryptions reserved
    {t:T}:traj        stream commit order: r = record id, s = session tag
    {t:T}:trajdata    hash   record id -> sealed trajectory
    {t:T}:blobidx:K   hash   tag -> blob id, per blob kind K
    {t:T}:blob:K:TAG  list   blob id, sealed head, sealed chunks

Writes of one operation go in one MULTI/EXEC pipeline (one round trip, all or nothing). Durability is
the server's: see docs/privacy.md for ``appendonly``/``appendfsync``.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from privacy.config import RedisConfig
from privacy.errors import StorageError, TenantExistsError
from privacy.storage import CredentialRow, StoredBlob, StoredTrajectory, TenantRow

_STREAM_ID_RE = re.compile(r"^\d+-\d+$")
_F = TypeVar("_F", bound=Callable[..., Any])


def _wrap_errors(fn: _F) -> _F:
    @functools.wraps(fn)
    def wrapper(self: RedisStorage, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except redis.RedisError as exc:
            raise StorageError(f"Redis at {self.config.host}:{self.config.port}: {type(exc).__name__}: {exc}") from None

    return wrapper  # type: ignore[return-value]


def connect(config: RedisConfig) -> Any:
    """A redis-py client (``Redis`` or ``RedisCluster``) for ``config``; bytes in, bytes out."""
    kwargs: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "username": config.username,
        "password": config.password,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "decode_responses": False,
        # Transient errors are retried twice with short backoff; redis-py's default (10 retries, up to
        # 1 s apart) makes a misconfigured start-up hang for seconds before saying what is wrong.
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=2),
    }
    if config.tls:
        kwargs.update(
            ssl=True,
            ssl_ca_certs=str(config.tls_ca_file) if config.tls_ca_file else None,
            ssl_certfile=str(config.tls_cert_file) if config.tls_cert_file else None,
            ssl_keyfile=str(config.tls_key_file) if config.tls_key_file else None,
            ssl_cert_reqs="required",
        )
    if config.cluster:
        return RedisCluster(**kwargs)
    return redis.Redis(db=config.db, **kwargs)


class RedisStorage:
    """``Storage`` on Redis. Thread-safe (redis-py pools connections)."""

    backend = "redis"

    def __init__(self, config: RedisConfig, client: Any = None) -> None:
        self.config = config
        self.prefix = config.key_prefix
        try:
            self.r = client if client is not None else connect(config)
            self.r.ping()
        except redis.RedisError as exc:
            raise StorageError(f"cannot reach Redis at {config.host}:{config.port} (db {config.db}): {exc}") from None
        m = f"{self.prefix}:{{meta}}:"
        self._meta, self._tenants, self._names, self._creds = m + "meta", m + "tenants", m + "names", m + "creds"

    def __repr__(self) -> str:
        return f"RedisStorage({self.config.host}:{self.config.port}/{self.config.db}, prefix={self.prefix!r})"

    def _k(self, tid: str, *parts: str) -> str:
        return ":".join((f"{self.prefix}:{{t:{tid}}}", *parts))

    def _tx(self) -> Any:
        return self.r.pipeline(transaction=True)

    def close(self) -> None:
        self.r.close()

    # meta
    @_wrap_errors
    def meta_get(self, name: str) -> bytes | None:
        return self.r.hget(self._meta, name)

    @_wrap_errors
    def meta_items(self, prefix: str) -> dict[str, bytes]:
        items = self.r.hgetall(self._meta)
        return {k.decode(): v for k, v in items.items() if k.decode().startswith(prefix)}

    @_wrap_errors
    def meta_put(self, name: str, value: bytes, only_new: bool = False) -> bool:
        if only_new:
            return bool(self.r.hsetnx(self._meta, name, value))
        self.r.hset(self._meta, name, value)
        return True

    @_wrap_errors
    def meta_delete(self, name: str) -> None:
        self.r.hdel(self._meta, name)

    # tenants: the row goes first, then the name claim, then the registry entry, so that a claim
    # always points at an existing row unless a purge was interrupted (such a claim is taken over).
    @_wrap_errors
    def tenant_insert(self, row: TenantRow, keys: Mapping[str, bytes]) -> None:
        p = self._tx()
        p.hset(self._k(row.tid, "tenant"), mapping={
            "name_tag": row.name_tag, "info": row.info, "dek_version": row.dek_version, "state": row.state,
        })
        p.hset(self._k(row.tid, "keys"), mapping=dict(keys))
        p.execute()
        if not self._claim_name(row.name_tag, row.tid):
            self.r.unlink(self._k(row.tid, "tenant"), self._k(row.tid, "keys"))
            raise TenantExistsError("a tenant with this name already exists")
        self.r.zadd(self._tenants, {row.tid: time.time()})

    def _claim_name(self, name_tag: bytes, tid: str) -> bool:
        if self.r.hsetnx(self._names, name_tag, tid):
            return True
        with self.r.pipeline(transaction=True) as p:
            try:
                p.watch(self._names)
                holder = p.hget(self._names, name_tag)
                if holder is not None and self.r.exists(self._k(holder.decode(), "tenant")):
                    return False
                p.multi()
                p.hset(self._names, name_tag, tid)
                p.execute()
                return True
            except redis.WatchError:
                return False

    @_wrap_errors
    def tenant_get(self, tid: str) -> TenantRow | None:
        h = self.r.hgetall(self._k(tid, "tenant"))
        if not h:
            return None
        return TenantRow(tid, h[b"name_tag"], h[b"info"], int(h[b"dek_version"]), h[b"state"].decode())

    @_wrap_errors
    def tenant_by_name_tag(self, name_tag: bytes) -> str | None:
        tid = self.r.hget(self._names, name_tag)
        if tid is None or not self.r.exists(self._k(tid.decode(), "tenant")):
            return None
        return tid.decode()

    @_wrap_errors
    def tenant_ids(self) -> list[str]:
        return [t.decode() for t in self.r.zrange(self._tenants, 0, -1)]

    @_wrap_errors
    def tenant_update(self, tid: str, info: bytes | None = None, dek_version: int | None = None) -> None:
        mapping: dict[str, Any] = {}
        if info is not None:
            mapping["info"] = info
        if dek_version is not None:
            mapping["dek_version"] = dek_version
        if mapping:
            self.r.hset(self._k(tid, "tenant"), mapping=mapping)

    @_wrap_errors
    def tenant_shred(self, tid: str) -> None:
        p = self._tx()
        p.hset(self._k(tid, "tenant"), "state", "deleting")
        p.delete(self._k(tid, "keys"))
        p.execute()
        self._drop_creds(tid)

    def _drop_creds(self, owner: str) -> None:
        ids = [r.key_id for r in self.cred_list(owner)]
        if ids:
            self.r.hdel(self._creds, *ids)

    @_wrap_errors
    def tenant_purge(self, tid: str) -> int:
        n = self.r.xlen(self._k(tid, "traj"))
        pattern = self._k(tid, "*").replace("[", "\\[")
        keys = list(self.r.scan_iter(match=pattern, count=1000))
        n += sum(self.r.hlen(k) for k in keys if b":blobidx:" in k)
        keep_last = self._k(tid, "tenant").encode()
        for i in range(0, len(keys), 500):
            batch = [k for k in keys[i:i + 500] if k != keep_last]
            if batch:
                self.r.unlink(*batch)
        # The row goes last: while it exists, the tenant shows as "deleting" and a purge can resume.
        row = self.tenant_get(tid)
        with self.r.pipeline(transaction=True) as p:
            try:
                p.watch(self._names)
                holder = p.hget(self._names, row.name_tag) if row else None
                p.multi()
                if row is not None and holder == tid.encode():
                    p.hdel(self._names, row.name_tag)
                p.zrem(self._tenants, tid)
                p.execute()
            except redis.WatchError:
                self.r.zrem(self._tenants, tid)
        self._drop_creds(tid)
        self.r.unlink(keep_last)
        return n

    @_wrap_errors
    def keys_get(self, tid: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self.r.hgetall(self._k(tid, "keys")).items()}

    @_wrap_errors
    def keys_put(self, tid: str, keys: Mapping[str, bytes]) -> None:
        self.r.hset(self._k(tid, "keys"), mapping=dict(keys))

    @_wrap_errors
    def keys_add(self, tid: str, name: str, wrapped: bytes) -> bool:
        return bool(self.r.hsetnx(self._k(tid, "keys"), name, wrapped))

    @_wrap_errors
    def keys_delete(self, tid: str, names: Sequence[str]) -> None:
        if names:
            self.r.hdel(self._k(tid, "keys"), *names)

    @_wrap_errors
    def counter_reserve(self, tid: str, version: int, n: int) -> int:
        return int(self.r.hincrby(self._k(tid, "ctr"), str(version), n))

    @_wrap_errors
    def counter_get(self, tid: str, version: int) -> int:
        return int(self.r.hget(self._k(tid, "ctr"), str(version)) or 0)

    # credentials
    @_wrap_errors
    def cred_put(self, row: CredentialRow) -> None:
        self.r.hset(self._creds, row.key_id, row.encode())

    @_wrap_errors
    def cred_get(self, key_id: str) -> CredentialRow | None:
        data = self.r.hget(self._creds, key_id)
        return CredentialRow.decode(key_id, data) if data is not None else None

    @_wrap_errors
    def cred_list(self, owner: str | None = None) -> list[CredentialRow]:
        rows = [CredentialRow.decode(k.decode(), v) for k, v in self.r.hgetall(self._creds).items()]
        rows.sort(key=lambda r: r.created_at)
        return [r for r in rows if owner is None or r.owner == owner]

    @_wrap_errors
    def cred_delete(self, key_ids: Sequence[str]) -> None:
        if key_ids:
            self.r.hdel(self._creds, *key_ids)

    # trajectories
    @_wrap_errors
    def traj_append(self, tid: str, items: Sequence[tuple[bytes, bytes, bytes]]) -> list[str]:
        stream, data = self._k(tid, "traj"), self._k(tid, "trajdata")
        p = self._tx()
        for rid, tag, sealed in items:
            p.hset(data, rid, sealed)
            p.xadd(stream, {"r": rid, "s": tag})
        results = p.execute()
        return [results[i].decode() for i in range(1, len(results), 2)]

    @_wrap_errors
    def traj_scan(self, tid: str, after: str | None, limit: int, session_tag: bytes | None = None) -> list[StoredTrajectory]:
        if after and not _STREAM_ID_RE.match(after):
            raise ValueError(f"cursor must be a value returned by this store, got {after!r}")
        start = f"({after}" if after else "-"
        stream = self._k(tid, "traj")
        picked: list[tuple[bytes, bytes]] = []
        while len(picked) < limit:
            entries = self.r.xrange(stream, min=start, max="+", count=limit if session_tag is None else 4 * limit)
            if not entries:
                break
            for entry_id, fields in entries:
                if session_tag is None or fields.get(b"s") == session_tag:
                    picked.append((entry_id, fields.get(b"r", b"")))
                    if len(picked) == limit:
                        break
            start = "(" + entries[-1][0].decode()
            if session_tag is None:
                break
        if not picked:
            return []
        sealed = self.r.hmget(self._k(tid, "trajdata"), [rid for _, rid in picked])
        return [StoredTrajectory(i.decode(), rid, s or b"") for (i, rid), s in zip(picked, sealed)]

    @_wrap_errors
    def traj_replace(self, tid: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        p = self._tx()
        for rid, sealed in items:
            p.hset(self._k(tid, "trajdata"), rid, sealed)
        p.execute()

    @_wrap_errors
    def traj_delete(self, tid: str, items: Sequence[tuple[str, bytes]]) -> int:
        if not items:
            return 0
        for cursor, _ in items:
            if not _STREAM_ID_RE.match(cursor):
                raise ValueError(f"cursor must be a value returned by this store, got {cursor!r}")
        p = self._tx()
        p.xdel(self._k(tid, "traj"), *[c for c, _ in items])
        p.hdel(self._k(tid, "trajdata"), *[rid for _, rid in items])
        return int(p.execute()[0])

    @_wrap_errors
    def traj_count(self, tid: str) -> int:
        return int(self.r.xlen(self._k(tid, "traj")))

    # blobs
    def _blob_key(self, tid: str, kind: str, tag: bytes) -> str:
        return self._k(tid, "blob", kind, tag.hex())

    @_wrap_errors
    def blob_put(self, tid: str, kind: str, tag: bytes, blob_id: bytes, head: bytes, chunks: Sequence[bytes]) -> None:
        key = self._blob_key(tid, kind, tag)
        p = self._tx()
        p.delete(key)
        p.rpush(key, blob_id, head, *chunks)
        p.hset(self._k(tid, "blobidx", kind), tag, blob_id)
        p.execute()

    @_wrap_errors
    def blob_get(self, tid: str, kind: str, tag: bytes, with_chunks: bool = True) -> StoredBlob | None:
        items = self.r.lrange(self._blob_key(tid, kind, tag), 0, -1 if with_chunks else 1)
        if len(items) < 2:
            return None
        return StoredBlob(tag, items[0], items[1], list(items[2:]) if with_chunks else None)

    @_wrap_errors
    def blob_list(self, tid: str, kind: str) -> list[StoredBlob]:
        tags = sorted(self.r.hkeys(self._k(tid, "blobidx", kind)))
        p = self.r.pipeline(transaction=False)
        for tag in tags:
            p.lrange(self._blob_key(tid, kind, tag), 0, 1)
        return [StoredBlob(t, items[0], items[1], None) for t, items in zip(tags, p.execute()) if len(items) == 2]

    @_wrap_errors
    def blob_delete(self, tid: str, kind: str, tag: bytes) -> bool:
        p = self._tx()
        p.delete(self._blob_key(tid, kind, tag))
        p.hdel(self._k(tid, "blobidx", kind), tag)
        return bool(p.execute()[0])

    @_wrap_errors
    def blob_count(self, tid: str) -> int:
        pattern = self._k(tid, "blobidx", "*")
        return sum(self.r.hlen(k) for k in self.r.scan_iter(match=pattern, count=1000))

    def shred_sync(self) -> None:
        """Nothing to do from a client: old AOF/RDB files are the operator's (docs/privacy.md)."""
