"""fileio: a write replaces the file whole or not at all, with the permissions asked for."""

from __future__ import annotations

import os
import stat

import pytest

from fileio import atomic_writer, current_umask, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path) -> None:
    path = tmp_path / "sub" / "settings.json"
    write_atomic(path, "first")
    write_atomic(path, b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["settings.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~current_umask()


def test_mode_is_the_files_permissions(tmp_path) -> None:
    path = tmp_path / "secret"
    write_atomic(path, b"key", mode=0o600)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_failed_write_keeps_the_old_content(tmp_path) -> None:
    path = tmp_path / "state.bin"
    write_atomic(path, b"old")
    with pytest.raises(RuntimeError, match="half-way"), atomic_writer(path) as fh:
        fh.write(b"new but incomplete")
        raise RuntimeError("failed half-way")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]
