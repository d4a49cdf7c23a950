"""Helpers for the privacy tests: raw dumps of everything a backend holds."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import redis

from privacy import StoreConfig

REDIS_HOST, REDIS_PORT, REDIS_DB = "127.0.0.1", 6379, 0  # the real Redis the tests talk to


def raw_dump(config: StoreConfig) -> list[bytes]:
    """Every byte the backend holds for this config: for SQLite the database, WAL and shared-memory
    files as they are on disk plus every column of every row; for Redis every key name and every value
    of every type under the config's prefix."""
    out: list[bytes] = []
    if config.backend == "sqlite":
        path = config.sqlite.path
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            if p.exists():
                out.append(p.read_bytes())
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for table in tables:
                for row in db.execute(f"SELECT * FROM {table}"):
                    out += [v if isinstance(v, bytes) else str(v).encode() for v in row]
        finally:
            db.close()
        return out

    r = redis.Redis(host=config.redis.host, port=config.redis.port, db=config.redis.db)
    for key in r.scan_iter(match=f"{config.redis_key_prefix}:*", count=1000):
        out.append(key)
        kind = r.type(key).decode()
        if kind == "string":
            out.append(r.get(key))
        elif kind == "hash":
            for f, v in r.hgetall(key).items():
                out += [f, v]
        elif kind == "list":
            out += r.lrange(key, 0, -1)
        elif kind == "set":
            out += list(r.smembers(key))
        elif kind == "zset":
            out += [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            for entry_id, fields in r.xrange(key):
                out.append(entry_id)
                for f, v in fields.items():
                    out += [f, v]
        else:
            raise AssertionError(f"unexpected Redis type {kind} for {key!r}")
    return out


def contains(dump: list[bytes], needle: bytes) -> bool:
    return any(needle in blob for blob in dump)


def damage_page_holding(path: Path, needle: bytes) -> None:
    """Zero the SQLite page of the database file ``path`` that holds ``needle`` (a page whose type byte
    is 0 is malformed: reading it gives SQLITE_CORRUPT, as a bad disk sector would)."""
    data = path.read_bytes()
    offset = data.find(needle)
    assert offset > 0, "the record is not in the main database file (checkpoint the WAL first)"
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with path.open("r+b") as f:
        f.seek(offset // page_size * page_size)
        f.write(bytes(page_size))
