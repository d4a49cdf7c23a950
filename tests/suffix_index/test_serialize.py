"""serialize()/deserialize(): exact round trips; truncated, corrupt, wrong-version or inconsistent bytes
give ValueError, never a crash or a silently different index."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.suffix_checks import apply_op, same_index

from suffix_index import SuffixIndex

MASK = 2**64 - 1
P1, P2, P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def checksum(payload: bytes) -> int:
    """The format's payload checksum (suffix_index/csrc/serialize.cc), in Python."""
    h = P3 ^ len(payload)
    n8 = len(payload) // 8 * 8
    for (w,) in struct.iter_unpack("<Q", payload[:n8]):
        h ^= _rotl(w * P2 & MASK, 31) * P1 & MASK
        h = (_rotl(h, 27) * P1 + P3) & MASK
    for b in payload[n8:]:
        h ^= b * P3 & MASK
        h = _rotl(h, 11) * P1 & MASK
    h ^= h >> 33
    h = h * P2 & MASK
    h ^= h >> 29
    h = h * P3 & MASK
    h ^= h >> 32
    return h


def frame(payload: bytes, version: int = 1) -> bytes:
    return b"RPRSXIDX" + struct.pack("<IIQQ", version, 0, len(payload), checksum(payload)) + payload


def payload(
    max_depth=8, keys=(2,), max_bytes=0, next_created=2, seqs=((0, 0, 0, [1, 2, 3]), (1, 1, 0, [2, 3]))
):
    out = struct.pack("<II", max_depth, len(keys)) + b"".join(struct.pack("<I", k) for k in keys)
    out += struct.pack("<QQQ", max_bytes, next_created, len(seqs))
    for sid, created, flags, toks in seqs:
        out += struct.pack("<qQII", sid, created, len(toks), flags) + struct.pack(f"<{len(toks)}i", *toks)
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "extend", "remove"]),
            st.integers(0, 4),
            st.lists(st.integers(0, 3), max_size=40),
        ),
        max_size=10,
    ),
    st.integers(2, 9),
)
def test_round_trip_is_exact(ops, depth) -> None:
    ix = SuffixIndex(max_depth=depth, key_lengths=tuple(k for k in (1, 3) if k < depth), max_bytes=10**9)
    for op in ops:
        apply_op(ix, op)
    data = ix.serialize()
    clone = SuffixIndex.deserialize(data)
    contexts = [ix.get_sequence(s).tolist()[:n] for s in ix.sequence_ids().tolist() for n in (2, 5, 40)]
    same_index(ix, clone, contexts + [[0, 1], [3, 3, 3]])
    assert clone.serialize() == data  # and it stays the same bytes
    # The clone keeps working like the original.
    ix.extend(77, [1, 2, 3, 1])
    clone.extend(77, [1, 2, 3, 1])
    same_index(ix, clone, [[1, 2], [2, 3, 1]])


def test_round_trip_of_a_real_sized_index() -> None:
    rng = np.random.default_rng(1)
    ix = SuffixIndex()
    base = rng.integers(0, 50_000, size=3000).astype(np.int32)
    for i in range(40):
        seq = base[rng.integers(0, 2000) :][: rng.integers(10, 800)].copy()
        seq[rng.integers(0, len(seq), size=3)] = rng.integers(0, 50_000, size=3)
        ix.add(i, seq)
    data = ix.serialize()
    same_index(ix, SuffixIndex.deserialize(bytearray(data)), [base[:n] for n in (5, 50, 500)])
    assert SuffixIndex.deserialize(memoryview(data)).num_tokens == ix.num_tokens


@pytest.fixture(scope="module")
def blob() -> bytes:
    ix = SuffixIndex(max_depth=6, key_lengths=(2, 4))
    ix.add(3, [1, 2, 3, 4, 1, 2, 5])
    ix.extend(8, [2, 3, 4, 9])
    return ix.serialize()


def test_every_truncation_is_rejected(blob: bytes) -> None:
    for n in range(len(blob)):
        with pytest.raises(ValueError):
            SuffixIndex.deserialize(blob[:n])


def test_every_single_byte_change_is_rejected(blob: bytes) -> None:
    for i in range(len(blob)):
        for delta in (1, 0x80):
            bad = bytearray(blob)
            bad[i] = (bad[i] + delta) % 256
            with pytest.raises(ValueError):
                SuffixIndex.deserialize(bytes(bad))
    with pytest.raises(ValueError, match="trailing|length"):
        SuffixIndex.deserialize(blob + b"\0")


def test_header_errors_name_the_problem(blob: bytes) -> None:
    with pytest.raises(ValueError, match="bad magic"):
        SuffixIndex.deserialize(b"NOTANIDX" + blob[8:])
    with pytest.raises(ValueError, match="version 2"):
        SuffixIndex.deserialize(frame(payload(), version=2))
    with pytest.raises(ValueError, match="checksum"):
        SuffixIndex.deserialize(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(ValueError, match="32"):
        SuffixIndex.deserialize(b"")
    with pytest.raises(TypeError):
        SuffixIndex.deserialize("not bytes")  # type: ignore[arg-type]


def test_checksum_model_matches(blob: bytes) -> None:
    assert SuffixIndex.deserialize(frame(payload())).num_tokens == 5
    assert struct.unpack("<Q", blob[24:32])[0] == checksum(blob[32:])


@pytest.mark.parametrize(
    "bad, match",
    [
        (payload(max_depth=0), "max_depth"),
        (payload(max_depth=9000), "max_depth"),
        (payload(keys=(8,)), "key length"),
        (payload(keys=tuple(range(1, 10)), max_depth=64), "too many key lengths"),
        (payload(seqs=((0, 0, 0, [1, -2]),), next_created=1), "negative token id -2"),
        (payload(seqs=((0, 0, 0, [1]), (0, 1, 0, [2]))), "duplicate sequence id 0"),
        (payload(seqs=((-4, 0, 0, [1]),), next_created=1), "negative sequence id -4"),
        (payload(seqs=((0, 0, 0, [1]), (1, 0, 0, [2]))), "creation ordinal"),
        (payload(next_created=1), "creation ordinal"),
        (payload(seqs=((0, 0, 7, [1]),), next_created=1), "flags"),
        (payload() + b"\0\0\0\0", "trailing"),
        (payload()[:-4], "past the payload|truncated"),
        (payload(seqs=())[:-8] + struct.pack("<Q", 2**40), "sequence count"),
    ],
)
def test_consistent_checksum_but_bad_content(bad: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SuffixIndex.deserialize(frame(bad))
