"""The embedded backend: one SQLite file in WAL mode.

Durability: every write is one transaction; with ``synchronous=FULL`` (the default) SQLite fsyncs the
WAL before COMMIT returns, so an acknowledged write survives ``kill -9`` and power loss (``NORMAL``:
``kill -9`` only). A row is written whole or not at all, so a half-written record is never read back.
``secure_delete`` zeroes deleted content and deletion ends with a WAL checkpoint (TRUNCATE), so a
shredded tenant's wrapped keys do not linger in free pages or the WAL file.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from privacy.config import SqliteConfig
from privacy.errors import StorageError, StoreDamagedError, TenantExistsError, UnknownTenantError
from privacy.storage import CredentialRow, StoredBlob, StoredTrajectory, TenantRow

SCHEMA_VERSION = b"1"
_DAMAGED_CODES = (11, 26)  # SQLITE_CORRUPT ("database disk image is malformed"), SQLITE_NOTADB
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS tenants (
    tid TEXT PRIMARY KEY, name_tag BLOB NOT NULL UNIQUE, info BLOB NOT NULL,
    dek_version INTEGER NOT NULL, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tenant_keys (
    tid TEXT NOT NULL, name TEXT NOT NULL, wrapped BLOB NOT NULL, PRIMARY KEY (tid, name));
CREATE TABLE IF NOT EXISTS counters (
    tid TEXT NOT NULL, version INTEGER NOT NULL, used INTEGER NOT NULL, PRIMARY KEY (tid, version));
CREATE TABLE IF NOT EXISTS credentials (key_id TEXT PRIMARY KEY, owner TEXT NOT NULL, row BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS credentials_owner ON credentials (owner);
CREATE TABLE IF NOT EXISTS trajectories (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, tid TEXT NOT NULL, record_id BLOB NOT NULL,
    session_tag BLOB NOT NULL, sealed BLOB NOT NULL, UNIQUE (tid, record_id));
CREATE INDEX IF NOT EXISTS trajectories_tenant ON trajectories (tid, seq);
CREATE INDEX IF NOT EXISTS trajectories_session ON trajectories (tid, session_tag, seq);
CREATE TABLE IF NOT EXISTS blobs (
    tid TEXT NOT NULL, kind TEXT NOT NULL, tag BLOB NOT NULL, chunk INTEGER NOT NULL,
    blob_id BLOB NOT NULL, sealed BLOB NOT NULL, PRIMARY KEY (tid, kind, tag, chunk));
"""


class SqliteStorage:
    """``Storage`` on one SQLite file; safe to share between threads (one connection, one lock)."""

    backend = "sqlite"

    def __init__(self, config: SqliteConfig) -> None:
        self.path = config.path
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.path.exists():
            # Create it 0600 ourselves: SQLite gives the -wal and -shm files the database's mode.
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(
                str(self.path), isolation_level=None, check_same_thread=False, timeout=config.busy_timeout_ms / 1000
            )
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StorageError(f"SQLite refused WAL mode for {self.path} (got {mode})")
            self._db.execute(f"PRAGMA synchronous={config.synchronous}")
            self._db.execute("PRAGMA secure_delete=ON")
            self._db.execute(f"PRAGMA busy_timeout={config.busy_timeout_ms}")
            self._db.executescript(_SCHEMA)  # idempotent; executescript commits on its own
            with self._tx() as db:
                row = db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
                elif bytes(row[0]) != SCHEMA_VERSION:
                    raise StorageError(f"{self.path} has schema {bytes(row[0])!r}, this Reprise reads {SCHEMA_VERSION!r}")
        except sqlite3.DatabaseError as exc:
            if is_damage(exc):
                raise damaged(self.path, exc) from None
            raise StorageError(f"cannot open SQLite store {self.path}: {exc}") from None

    def __repr__(self) -> str:
        return f"SqliteStorage({str(self.path)!r})"

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._damage_reported():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def _damage_reported(self) -> Iterator[None]:
        """A damaged page or file becomes ``StoreDamagedError`` naming the file and the repair command
        (other SQLite errors, a taken name among them, pass unchanged)."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if is_damage(exc):
                raise damaged(self.path, exc) from None
            raise

    def _one(self, sql: str, args: tuple = ()) -> tuple | None:
        with self._lock, self._damage_reported():
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock, self._damage_reported():
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # meta
    def meta_get(self, name: str) -> bytes | None:
        row = self._one("SELECT value FROM meta WHERE name=?", (name,))
        return bytes(row[0]) if row else None

    def meta_items(self, prefix: str) -> dict[str, bytes]:
        rows = self._all("SELECT name, value FROM meta WHERE substr(name, 1, ?) = ?", (len(prefix), prefix))
        return {n: bytes(v) for n, v in rows}

    def meta_put(self, name: str, value: bytes, only_new: bool = False) -> bool:
        verb = "INSERT OR IGNORE" if only_new else "INSERT OR REPLACE"
        with self._tx() as db:
            return db.execute(f"{verb} INTO meta VALUES (?, ?)", (name, value)).rowcount == 1

    def meta_delete(self, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM meta WHERE name=?", (name,))

    # tenants
    def tenant_insert(self, row: TenantRow, keys: Mapping[str, bytes]) -> None:
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO tenants VALUES (?, ?, ?, ?, ?)",
                    (row.tid, row.name_tag, row.info, row.dek_version, row.state),
                )
                db.executemany("INSERT INTO tenant_keys VALUES (?, ?, ?)", [(row.tid, n, w) for n, w in keys.items()])
        except sqlite3.IntegrityError:
            raise TenantExistsError("a tenant with this name already exists") from None

    def tenant_get(self, tid: str) -> TenantRow | None:
        row = self._one("SELECT tid, name_tag, info, dek_version, state FROM tenants WHERE tid=?", (tid,))
        return TenantRow(row[0], bytes(row[1]), bytes(row[2]), row[3], row[4]) if row else None

    def tenant_by_name_tag(self, name_tag: bytes) -> str | None:
        row = self._one("SELECT tid FROM tenants WHERE name_tag=?", (name_tag,))
        return row[0] if row else None

    def tenant_ids(self) -> list[str]:
        return [r[0] for r in self._all("SELECT tid FROM tenants ORDER BY rowid")]

    def tenant_update(self, tid: str, info: bytes | None = None, dek_version: int | None = None) -> None:
        with self._tx() as db:
            if info is not None:
                db.execute("UPDATE tenants SET info=? WHERE tid=?", (info, tid))
            if dek_version is not None:
                db.execute("UPDATE tenants SET dek_version=? WHERE tid=?", (dek_version, tid))

    def tenant_shred(self, tid: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE tenants SET state='deleting' WHERE tid=?", (tid,))
            db.execute("DELETE FROM tenant_keys WHERE tid=?", (tid,))
            db.execute("DELETE FROM credentials WHERE owner=?", (tid,))
        self.shred_sync()

    def tenant_purge(self, tid: str) -> int:
        with self._tx() as db:
            n = db.execute("DELETE FROM trajectories WHERE tid=?", (tid,)).rowcount
            n += db.execute("SELECT count(*) FROM blobs WHERE tid=? AND chunk=0", (tid,)).fetchone()[0]
            for table in ("blobs", "counters", "tenant_keys", "credentials", "tenants"):
                column = "owner" if table == "credentials" else "tid"
                db.execute(f"DELETE FROM {table} WHERE {column}=?", (tid,))
        self.shred_sync()
        return n

    def keys_get(self, tid: str) -> dict[str, bytes]:
        return {n: bytes(w) for n, w in self._all("SELECT name, wrapped FROM tenant_keys WHERE tid=?", (tid,))}

    def keys_put(self, tid: str, keys: Mapping[str, bytes]) -> None:
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO tenant_keys VALUES (?, ?, ?)", [(tid, n, w) for n, w in keys.items()])

    def keys_add(self, tid: str, name: str, wrapped: bytes) -> bool:
        with self._tx() as db:
            return db.execute("INSERT OR IGNORE INTO tenant_keys VALUES (?, ?, ?)", (tid, name, wrapped)).rowcount == 1

    def keys_delete(self, tid: str, names: Sequence[str]) -> None:
        with self._tx() as db:
            db.executemany("DELETE FROM tenant_keys WHERE tid=? AND name=?", [(tid, n) for n in names])

    def counter_reserve(self, tid: str, version: int, n: int) -> int:
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO counters VALUES (?, ?, 0)", (tid, version))
            db.execute("UPDATE counters SET used = used + ? WHERE tid=? AND version=?", (n, tid, version))
            return db.execute("SELECT used FROM counters WHERE tid=? AND version=?", (tid, version)).fetchone()[0]

    def counter_get(self, tid: str, version: int) -> int:
        row = self._one("SELECT used FROM counters WHERE tid=? AND version=?", (tid, version))
        return int(row[0]) if row else 0

    # credentials
    def cred_put(self, row: CredentialRow) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO credentials VALUES (?, ?, ?)", (row.key_id, row.owner, row.encode()))

    def cred_get(self, key_id: str) -> CredentialRow | None:
        row = self._one("SELECT row FROM credentials WHERE key_id=?", (key_id,))
        return CredentialRow.decode(key_id, bytes(row[0])) if row else None

    def cred_list(self, owner: str | None = None) -> list[CredentialRow]:
        if owner is None:
            rows = self._all("SELECT key_id, row FROM credentials ORDER BY rowid")
        else:
            rows = self._all("SELECT key_id, row FROM credentials WHERE owner=? ORDER BY rowid", (owner,))
        return [CredentialRow.decode(k, bytes(r)) for k, r in rows]

    def cred_delete(self, key_ids: Sequence[str]) -> None:
        with self._tx() as db:
            db.executemany("DELETE FROM credentials WHERE key_id=?", [(k,) for k in key_ids])

    # trajectories
    def traj_append(self, tid: str, items: Sequence[tuple[bytes, bytes, bytes]]) -> list[str]:
        with self._tx() as db:
            # Checked in the same transaction, so nothing lands after a concurrent deletion.
            state = db.execute("SELECT state FROM tenants WHERE tid=?", (tid,)).fetchone()
            if state is None or state[0] != "active":
                raise UnknownTenantError(f"no tenant {tid}")
            return [
                str(db.execute("INSERT INTO trajectories (tid, record_id, session_tag, sealed) VALUES (?, ?, ?, ?)",
                               (tid, rid, tag, sealed)).lastrowid)
                for rid, tag, sealed in items
            ]

    def traj_scan(self, tid: str, after: str | None, limit: int, session_tag: bytes | None = None) -> list[StoredTrajectory]:
        start = _parse_cursor(after)
        if session_tag is None:
            rows = self._all(
                "SELECT seq, record_id, sealed FROM trajectories WHERE tid=? AND seq>? ORDER BY seq LIMIT ?",
                (tid, start, limit),
            )
        else:
            rows = self._all(
                "SELECT seq, record_id, sealed FROM trajectories WHERE tid=? AND session_tag=? AND seq>? "
                "ORDER BY seq LIMIT ?",
                (tid, session_tag, start, limit),
            )
        return [StoredTrajectory(str(s), bytes(r), bytes(d)) for s, r, d in rows]

    def traj_replace(self, tid: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        with self._tx() as db:
            db.executemany("UPDATE trajectories SET sealed=? WHERE tid=? AND record_id=?", [(s, tid, r) for r, s in items])

    def traj_delete(self, tid: str, items: Sequence[tuple[str, bytes]]) -> int:
        with self._tx() as db:
            return sum(db.execute("DELETE FROM trajectories WHERE tid=? AND record_id=?", (tid, rid)).rowcount
                       for _, rid in items)

    def traj_count(self, tid: str) -> int:
        return self._one("SELECT count(*) FROM trajectories WHERE tid=?", (tid,))[0]  # type: ignore[index]

    # blobs: chunk 0 holds the sealed head, chunks 1.. the sealed body
    def blob_put(self, tid: str, kind: str, tag: bytes, blob_id: bytes, head: bytes, chunks: Sequence[bytes]) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM blobs WHERE tid=? AND kind=? AND tag=?", (tid, kind, tag))
            db.executemany(
                "INSERT INTO blobs VALUES (?, ?, ?, ?, ?, ?)",
                [(tid, kind, tag, i, blob_id, c) for i, c in enumerate([head, *chunks])],
            )

    def blob_get(self, tid: str, kind: str, tag: bytes, with_chunks: bool = True) -> StoredBlob | None:
        sql = "SELECT blob_id, sealed FROM blobs WHERE tid=? AND kind=? AND tag=?"
        rows = self._all(sql + " ORDER BY chunk" if with_chunks else sql + " AND chunk=0", (tid, kind, tag))
        if not rows:
            return None
        return StoredBlob(tag, bytes(rows[0][0]), bytes(rows[0][1]), [bytes(r[1]) for r in rows[1:]] if with_chunks else None)

    def blob_list(self, tid: str, kind: str) -> list[StoredBlob]:
        rows = self._all("SELECT tag, blob_id, sealed FROM blobs WHERE tid=? AND kind=? AND chunk=0 ORDER BY rowid", (tid, kind))
        return [StoredBlob(bytes(t), bytes(b), bytes(h), None) for t, b, h in rows]

    def blob_delete(self, tid: str, kind: str, tag: bytes) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM blobs WHERE tid=? AND kind=? AND tag=?", (tid, kind, tag)).rowcount > 0

    def blob_count(self, tid: str) -> int:
        return self._one("SELECT count(*) FROM blobs WHERE tid=? AND chunk=0", (tid,))[0]  # type: ignore[index]

    def shred_sync(self) -> None:
        """Fold the WAL into the database and truncate it, so deleted values leave the WAL file."""
        with self._lock, self._damage_reported():
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def files(self) -> list[Path]:
        """The database file and its WAL/shared-memory companions that exist now."""
        return [p for p in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")) if p.exists()]


def is_damage(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite reports a damaged page or a file that is not a database."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGED_CODES
    return "malformed" in str(exc) or "not a database" in str(exc)


def damaged(path: Path, exc: sqlite3.DatabaseError) -> StoreDamagedError:
    """The error that names the damaged file and what to run."""
    return StoreDamagedError(
        f"the SQLite store {path} is damaged ({exc}); stop the service, copy the file somewhere safe, then run "
        f"`python -m privacy verify --data-dir {path.parent}` to see what is affected and "
        f"`python -m privacy repair --data-dir {path.parent}` to salvage every readable record into a new file "
        f"(the damaged one is kept beside it)")


def _parse_cursor(after: str | None) -> int:
    if after is None or after == "":
        return 0
    if not isinstance(after, str) or not after.isdigit():
        raise ValueError(f"cursor must be a value returned by this store, got {after!r}")
    return int(after)
