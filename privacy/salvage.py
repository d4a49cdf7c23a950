"""A damaged SQLite store (a bad page: ``database disk image is malformed``): find out, and copy every
readable row into a new file, keeping the damaged one beside it.

    problems = check_sqlite(path)      # SQLite's integrity check; [] when the file is sound
    report = salvage_sqlite(path)      # run with the service stopped; the new file takes the old one's name

Salvage reads each table in rowid order through the table's own b-tree (never an index, which may be
the damaged part). A read that fails is retried one row at a time; a row that still fails lies on a
damaged page, and the rows a damaged page holds form one rowid range (a leaf covers a contiguous range),
so the copy probes forward (doubling steps, then bisecting) for the first rowid past the damage and
goes on from there. What it skipped is reported per table as rowid ranges. Indexes are rebuilt in the
new file, so a damaged index page costs nothing. Rows are copied as stored (sealed), so record-level
checks (``privacy.integrity``) work on the salvaged file as on any other.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from privacy.errors import StorageError
from privacy.sqlite_storage import _SCHEMA, is_damage

TABLES = ("meta", "tenants", "tenant_keys", "counters", "credentials", "trajectories", "blobs")
_BATCH = 256
_MAX_ROWID = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class TableSalvage:
    """One table: rows copied, and the rowid ranges ``(after, upto]`` that could not be read."""

    table: str
    num_rows: int
    lost: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SalvageReport:
    """The salvaged file (at the original path) and where the damaged one was kept."""

    path: Path
    kept: Path
    tables: tuple[TableSalvage, ...] = field(default=())

    @property
    def num_rows(self) -> int:
        return sum(t.num_rows for t in self.tables)


def check_sqlite(path: Path, max_problems: int = 100) -> list[str]:
    """SQLite's ``PRAGMA integrity_check`` of the file: the problems it lists ([] when sound)."""
    if not path.is_file():
        raise StorageError(f"no SQLite store at {path}")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(f"PRAGMA integrity_check({int(max_problems)})").fetchall()
    except sqlite3.DatabaseError as exc:
        return [f"the check stopped: {exc}"]
    finally:
        db.close()
    lines = [str(r[0]) for r in rows]
    return [] if lines == ["ok"] else lines


def salvage_sqlite(path: Path) -> SalvageReport:
    """Copy every readable row of the store at ``path`` into a new file, move the damaged file (and its
    WAL) aside as ``<name>.damaged-<unix time>``, and put the new file in its place. Run it with the
    service stopped."""
    if not path.is_file():
        raise StorageError(f"no SQLite store at {path}")
    fresh = path.with_name(path.name + ".salvage")
    fresh.unlink(missing_ok=True)
    os.close(os.open(fresh, os.O_WRONLY | os.O_CREAT, 0o600))
    old = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    new = sqlite3.connect(str(fresh), isolation_level=None)
    try:
        new.executescript(_SCHEMA)
        new.execute("BEGIN")
        tables = tuple(_copy_table(old, new, table) for table in TABLES)
        top = max((r[0] for r in _try(old, "SELECT seq FROM sqlite_sequence WHERE name='trajectories'")), default=0)
        top = max(top, new.execute("SELECT coalesce(max(seq), 0) FROM trajectories").fetchone()[0])
        new.execute("INSERT OR REPLACE INTO sqlite_sequence (name, seq) VALUES ('trajectories', ?)", (top,))
        new.execute("COMMIT")
    except BaseException:
        new.close()
        old.close()
        fresh.unlink(missing_ok=True)
        raise
    new.close()
    old.close()
    kept = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    for suffix in ("", "-wal", "-shm"):
        companion = Path(f"{path}{suffix}")
        if companion.exists():
            companion.rename(Path(f"{kept}{suffix}"))
    fresh.rename(path)
    return SalvageReport(path, kept, tables)


def _try(db: sqlite3.Connection, sql: str, args: tuple = ()) -> list[tuple]:
    try:
        return db.execute(sql, args).fetchall()
    except sqlite3.DatabaseError:
        return []


def _copy_table(old: sqlite3.Connection, new: sqlite3.Connection, table: str) -> TableSalvage:
    info = new.execute(f"PRAGMA table_info({table})").fetchall()  # (cid, name, type, notnull, default, pk)
    columns = [r[1] for r in info]
    # A table whose INTEGER PRIMARY KEY is the rowid (trajectories.seq) keeps it through that column.
    alias = [r[1] for r in info if r[5] and r[2].upper() == "INTEGER"] if sum(bool(r[5]) for r in info) == 1 else []
    key = alias[0] if alias else "rowid"
    names = columns if alias else ["rowid", *columns]
    select = f"SELECT {', '.join(names)} FROM {table} NOT INDEXED WHERE rowid > ? ORDER BY rowid LIMIT ?"
    insert = f"INSERT OR IGNORE INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    position = names.index(key)
    cursor, batch, copied, lost = -_MAX_ROWID - 1, _BATCH, 0, []
    while True:
        try:
            rows = old.execute(select, (cursor, batch)).fetchall()
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise
            if batch > 1:  # the damage may lie past some good rows: read one at a time up to it
                batch = 1
                continue
            resume = _past_damage(old, table, cursor)
            lost.append((cursor, resume if resume is not None else _MAX_ROWID))
            if resume is None:
                break
            cursor, batch = resume, _BATCH
            continue
        if not rows:
            break
        new.executemany(insert, rows)
        copied += len(rows)
        cursor, batch = rows[-1][position], _BATCH
    return TableSalvage(table, copied, tuple(lost))


def _readable_after(old: sqlite3.Connection, table: str, rowid: int) -> bool:
    """Whether the first row past ``rowid`` (or the table's end) can be read."""
    try:
        old.execute(f"SELECT * FROM {table} NOT INDEXED WHERE rowid > ? ORDER BY rowid LIMIT 1", (rowid,)).fetchall()
        return True
    except sqlite3.DatabaseError as exc:
        if not is_damage(exc):
            raise
        return False


def _past_damage(old: sqlite3.Connection, table: str, cursor: int) -> int | None:
    """The smallest rowid ``s > cursor`` from which reading works again (None: nothing readable after)."""
    step = 1
    while not _readable_after(old, table, min(cursor + step, _MAX_ROWID)):
        if cursor + step >= _MAX_ROWID:
            return None
        step *= 2
    lo, hi = cursor + step // 2, min(cursor + step, _MAX_ROWID)  # unreadable after lo, readable after hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _readable_after(old, table, mid):
            hi = mid
        else:
            lo = mid
    return hi
