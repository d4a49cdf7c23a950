"""Durable file writes: after a crash a file holds its old content or its new one, never part of either.

``write_atomic(path, data)`` writes to a temporary file in the same folder, fsyncs it, renames it over
``path`` and fsyncs the folder, so that the rename itself survives a crash. ``atomic_writer(path)`` does
the same around a binary file object, for writers that stream (``torch.save(state, fh)``).
``reprise_home()`` is where Reprise keeps its local files when no folder is given. ``fileio.lines``
reads the lines of untrusted files with a bound on each line's length. This package imports
nothing of the project: every layer may use it (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

__all__ = ["HOME_ENV", "atomic_writer", "current_umask", "fsync_dir", "reprise_home", "write_atomic"]

HOME_ENV = "REPRISE_HOME"


def reprise_home(env: Mapping[str, str] | None = None) -> Path:
    """``$REPRISE_HOME`` (of ``env``, default the process's), else ``~/.reprise``: the data directory
    (store, keys, tenants' settings), converted models, trained drafters and caches."""
    env = os.environ if env is None else env
    return Path(env.get(HOME_ENV) or Path.home() / ".reprise").expanduser()


def current_umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    current = os.umask(0)
    os.umask(current)
    return current


@contextlib.contextmanager
def atomic_writer(path: str | Path, *, mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file whose content replaces ``path`` when the block ends without an error; on an error
    the temporary file is removed and ``path`` is untouched. ``mode``: the file's permissions (default:
    0666 less the umask, what ``open`` gives); the parent folder is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask() if mode is None else mode)  # mkstemp makes 0600
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | str, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) atomically and durably."""
    with atomic_writer(path, mode=mode) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def fsync_dir(path: str | Path) -> None:
    """Make the creations and renames in folder ``path`` durable; a no-op where the file system cannot
    open or sync a folder."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
