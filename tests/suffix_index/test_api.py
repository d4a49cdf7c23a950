"""The SuffixIndex facade: defaults, input forms, Draft records, and what bad input gets."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from suffix_index import DEFAULT_KEY_LENGTHS, Draft, SuffixIndex


@pytest.fixture
def small() -> SuffixIndex:
    ix = SuffixIndex(max_depth=8, key_lengths=(2, 4))
    ix.add(0, [1, 2, 3, 1, 2, 4, 1, 2, 3, 5])
    return ix


def test_defaults() -> None:
    ix = SuffixIndex()
    assert (ix.max_depth, ix.max_bytes, ix.key_lengths) == (64, 0, DEFAULT_KEY_LENGTHS)
    assert ix.num_sequences == ix.num_tokens == len(ix) == 0
    assert SuffixIndex(max_depth=10).key_lengths == (4, 8)  # default keys shorter than max_depth only
    assert SuffixIndex(max_depth=3, key_lengths=()).key_lengths == ()
    ix.check_integrity()
    assert ix.memory_bytes() > 0


def test_speculate_with_every_default(small: SuffixIndex) -> None:
    # max_spec_factor 1.0: a match of m tokens drafts at most m; min_token_prob 0.1; path mode.
    d = small.speculate([1, 2], 8)
    assert d.token_ids.tolist() == [3, 1]  # "1 2" -> 3 (2 of 3), then a tie 1 vs 5 -> smaller token
    assert d.parents.tolist() == [-1, 0]
    assert d.probs.tolist() == pytest.approx([2 / 3, 1 / 3])
    assert d.score == pytest.approx(1.0)
    assert d.match_len == 2
    tree = small.speculate([1, 2], 8, use_tree=True, max_spec_factor=2.0)
    assert tree.token_ids.tolist() == [3, 4, 1, 5]
    assert tree.parents.tolist() == [-1, -1, 0, 0]
    exact = small.speculate_exact([7, 1, 2], 8)  # key "1 2" (k=2): newest occurrence continues 3 5
    assert exact.token_ids.tolist() == [3, 5] and exact.match_len == 2
    assert exact.probs.tolist() == pytest.approx([2 / 3, 1 / 3])


def test_count(small: SuffixIndex) -> None:
    assert small.count([1, 2]) == 3 and small.count([1, 2, 3]) == 2 and small.count([2, 4, 1]) == 1
    assert small.count([7]) == 0 and small.count([]) == small.num_tokens == 10
    with pytest.raises(ValueError, match="longer than max_depth=8"):
        small.count([1] * 9)


def test_draft_is_a_frozen_typed_record(small: SuffixIndex) -> None:
    d = small.speculate([1, 2, 3], 4, max_spec_factor=3.0)
    assert isinstance(d, Draft)
    assert (d.token_ids.dtype, d.parents.dtype, d.probs.dtype) == (np.int32, np.int32, np.float32)
    assert len(d) == d.num_nodes == len(d.token_ids) == len(d.parents) == len(d.probs)
    assert all(-1 <= p < i for i, p in enumerate(d.parents.tolist()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.score = 3.0  # type: ignore[misc]
    assert not hasattr(d, "__dict__")


@pytest.mark.parametrize("context", [[], [9, 9, 9], np.zeros(0, dtype=np.int32)])
def test_empty_context_or_no_match_gives_empty_draft(small: SuffixIndex, context) -> None:
    for d in (
        small.speculate(context, 4),
        small.speculate(context, 4, use_tree=True),
        small.speculate_exact(context, 4),
    ):
        assert len(d) == 0 and d.score == 0.0 and d.match_len == 0
    assert len(SuffixIndex().speculate([1, 2, 3], 4)) == 0  # empty index


def test_input_forms_agree(small: SuffixIndex) -> None:
    ref = small.speculate(np.array([1, 2], dtype=np.int32), 8)
    arr = np.array([5, 1, 5, 2], dtype=np.int32)[1::2]  # non-contiguous view
    for ctx in (
        [1, 2],
        (1, 2),
        np.array([1, 2], dtype=np.int64),
        np.array([1, 2], dtype=np.uint16),
        arr,
        iter([1, 2]),
    ):
        d = small.speculate(ctx, 8)
        assert d.token_ids.tolist() == ref.token_ids.tolist() and d.score == ref.score


def test_sequences_roundtrip_and_order() -> None:
    ix = SuffixIndex(max_depth=6)
    ix.add(5, [1, 2, 3])
    ix.extend(2, [4, 5])  # creates
    ix.extend(5, [6])
    ix.add(9, [])
    assert ix.sequence_ids().tolist() == [5, 2, 9]
    assert ix.sequence_ids().dtype == np.int64
    assert ix.get_sequence(5).tolist() == [1, 2, 3, 6]
    assert ix.get_sequence(9).dtype == np.int32 and len(ix.get_sequence(9)) == 0
    assert 5 in ix and 3 not in ix and "5" not in ix and -1 not in ix
    assert (ix.num_sequences, ix.num_tokens) == (3, 6)
    assert "sequences=3" in repr(ix)
    ix.check_integrity()


def test_pickle_roundtrip(small: SuffixIndex) -> None:
    clone = pickle.loads(pickle.dumps(small))
    assert clone.speculate([1, 2], 8).token_ids.tolist() == small.speculate([1, 2], 8).token_ids.tolist()
    clone.check_integrity()


@pytest.mark.parametrize(
    "tokens, exc, match",
    [
        ([1.0, 2.0], TypeError, r"\[0\] = 1.0 is not an int"),
        (np.array([1.5]), TypeError, "float64"),
        ([True, False], TypeError, r"\[0\] = True is not an int"),
        ("abc", TypeError, "str"),
        ([1, "x"], TypeError, "'x'"),
        ([1, None], TypeError, "None"),
        ([3, -1], ValueError, "token id -1 at index 1"),
        (np.array([0, -7], dtype=np.int32), ValueError, "token id -7 at index 1"),
        ([2**31], ValueError, "2147483648"),
        ([2**70], ValueError, str(2**70)),
        (np.array([2**40], dtype=np.int64), ValueError, str(2**40)),
        (np.zeros((2, 2), dtype=np.int32), ValueError, "1-D"),
    ],
)
def test_bad_tokens(tokens, exc, match) -> None:
    ix = SuffixIndex(max_depth=4)
    with pytest.raises(exc, match=match):
        ix.add(0, tokens)
    with pytest.raises(exc, match=match):
        ix.extend(1, tokens)
    with pytest.raises(exc, match=match):
        ix.speculate(tokens, 4)
    with pytest.raises(exc, match=match):
        ix.speculate_exact(tokens, 4)
    assert ix.num_sequences == 0  # nothing half-done
    ix.check_integrity()


def test_bad_ids_and_unknown_sequences(small: SuffixIndex) -> None:
    with pytest.raises(ValueError, match="0 already exists"):
        small.add(0, [1])
    with pytest.raises(ValueError, match="unknown sequence id 42"):
        small.remove(42)
    with pytest.raises(ValueError, match="unknown sequence id 42"):
        small.get_sequence(42)
    small.remove(0)
    with pytest.raises(ValueError, match="unknown sequence id 0"):
        small.remove(0)
    with pytest.raises(ValueError, match="sequence id must be >= 0, got -1"):
        small.add(-1, [1])
    with pytest.raises(TypeError, match="seq_id must be an int"):
        small.add("a", [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq_id must be an int"):
        small.extend(1.0, [1])  # type: ignore[arg-type]
    small.check_integrity()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be in"),
        ({"max_tokens": -3}, ValueError, "got -3"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int"),
        ({"max_spec_factor": -1.0}, ValueError, "max_spec_factor"),
        ({"max_spec_factor": float("nan")}, ValueError, "max_spec_factor"),
        ({"max_spec_factor": "2"}, TypeError, "max_spec_factor must be a number"),
        ({"max_spec_offset": float("inf")}, ValueError, "max_spec_offset"),
        ({"min_token_prob": 1.5}, ValueError, "min_token_prob"),
        ({"min_token_prob": -0.1}, ValueError, "min_token_prob"),
    ],
)
def test_bad_speculate_arguments(small: SuffixIndex, kwargs, exc, match) -> None:
    args = {"max_tokens": 4, **kwargs}
    max_tokens = args.pop("max_tokens")
    with pytest.raises(exc, match=match):
        small.speculate([1, 2], max_tokens, **args)


def test_bad_exact_arguments(small: SuffixIndex) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        small.speculate_exact([1, 2], 0)
    with pytest.raises(ValueError, match="min_key_len"):
        small.speculate_exact([1, 2], 4, min_key_len=0)
    assert small.speculate_exact([1, 2], 4, min_key_len=3).match_len == 0  # only k=4 allowed, not matched


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"max_depth": 0}, ValueError, "max_depth must be in"),
        ({"max_depth": 5000}, ValueError, "max_depth must be in"),
        ({"max_depth": 8.0}, TypeError, "max_depth must be an int"),
        ({"max_bytes": -1}, ValueError, "max_bytes"),
        ({"max_depth": 8, "key_lengths": (8,)}, ValueError, "key length must be in"),
        ({"max_depth": 8, "key_lengths": (0,)}, ValueError, "key length must be in"),
        ({"key_lengths": 4}, TypeError, "key_lengths"),
        ({"key_lengths": tuple(range(1, 11))}, ValueError, "at most 8 key lengths"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        SuffixIndex(**kwargs)


def test_deep_and_large_vocabulary() -> None:
    rng = np.random.default_rng(0)
    ix = SuffixIndex(max_depth=300, key_lengths=(4, 64, 200))
    base = rng.integers(0, 2**31 - 1, size=400).astype(np.int32)
    ix.add(0, base)
    ix.add(1, np.concatenate([base[:250], rng.integers(0, 2**31 - 1, size=50).astype(np.int32)]))
    ix.check_integrity()
    d = ix.speculate(base[:100], 64)
    assert d.token_ids.tolist() == base[100:164].tolist() and d.match_len >= 64
    e = ix.speculate_exact(base[:210], 100)  # a key of 200 tokens, continued past max_depth - k
    newest = ix.get_sequence(1)  # both sequences hold the key; the newer one is copied
    assert e.match_len == 200 and e.token_ids.tolist() == newest[210:310].tolist()
    assert e.probs[:40].tolist() == [1.0] * 40  # both occurrences agree for 40 tokens
    assert e.probs[40:].tolist() == pytest.approx([0.5] * 50)  # then only the copied one


@pytest.mark.parametrize("use_tree", [False, True])
def test_unique_match_stops_at_its_sequence_end(use_tree: bool) -> None:
    """A context whose end occurs once drafts that occurrence's continuation, and no further."""
    ix = SuffixIndex(max_depth=16, key_lengths=(2,))
    ix.add(0, [1, 2, 3, 4, 5])
    ix.add(1, [9, 9, 9, 1])
    d = ix.speculate([7, 1, 2, 3], 8, use_tree=use_tree, max_spec_factor=4.0)
    assert d.token_ids.tolist() == [4, 5] and d.probs.tolist() == [1.0, 1.0]
    assert d.score == 2.0 and d.match_len == 3


def test_many_small_indexes_live_at_once() -> None:
    """One index per request: ten thousand small ones fit (small buffers do not each take a kernel
    mapping, of which a process gets about 65k)."""
    indexes = []
    for i in range(10_000):
        ix = SuffixIndex(max_depth=16)
        ix.add(0, [i % 7, 1, 2, 3, i % 5])
        indexes.append(ix)
    assert sum(ix.num_tokens for ix in indexes) == 50_000
    assert indexes[-1].speculate([1, 2], 4).token_ids.tolist() == [3, 4]  # [3, 1, 2, 3, 4] indexed
