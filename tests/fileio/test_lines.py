"""Bounded line reading (fileio/lines.py): a long line is found without being held whole."""

from __future__ import annotations

import io

import pytest

from fileio.lines import bounded_lines


def test_lines_up_to_the_bound_come_whole_and_a_longer_one_as_none() -> None:
    data = b"abc\n" + b"x" * 10 + b"\n" + b"12345\n" + b"tail"
    assert list(bounded_lines(io.BytesIO(data), 6)) == [b"abc\n", None, b"12345\n", b"tail"]


def test_a_reader_that_stops_at_a_long_line_reads_no_further() -> None:
    source = io.BytesIO(b"ok\n" + b"y" * 1000 + b"\nmore\n")
    lines = bounded_lines(source, 8)
    assert next(lines) == b"ok\n" and next(lines) is None
    assert source.tell() == 3 + 9  # the line's first max_bytes + 1 bytes, no more


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        next(bounded_lines(io.BytesIO(b"x"), 0))
