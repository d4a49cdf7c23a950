"""remove() and byte-budget eviction leave the index exactly as if the sequence had never been added."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.suffix_checks import apply_op, same_index

from suffix_index import SuffixIndex

ops_st = st.lists(
    st.tuples(
        st.sampled_from(["add", "extend", "remove"]),
        st.integers(0, 4),
        st.lists(st.integers(0, 3), max_size=70),
    ),
    max_size=10,
)


def run(ops, ix: SuffixIndex, skip: int | None = None) -> None:
    for op in ops:
        if op[1] != skip:
            apply_op(ix, op)


def contexts(ix: SuffixIndex) -> list[list[int]]:
    out = [[0, 1], [2, 2], [3, 1, 0]]
    for sid in ix.sequence_ids().tolist():
        seq = ix.get_sequence(sid).tolist()
        out += [seq[:n] for n in (1, 3, 8, 30)]
    return out


@settings(max_examples=60, deadline=None)
@given(ops_st, ops_st, st.integers(0, 4), st.integers(2, 8))
def test_remove_equals_never_added(before, after, victim, depth) -> None:
    """Operations on other sequences interleave with the victim's; removing it at the end must give
    the index built without it, down to memory_bytes() and which occurrence counts as newest."""
    keys = tuple(k for k in (1, 2, 4) if k < depth)
    with_it = SuffixIndex(max_depth=depth, key_lengths=keys)
    run(before + after, with_it)
    if victim in with_it:
        with_it.remove(victim)
    without = SuffixIndex(max_depth=depth, key_lengths=keys)
    run(before + after, without, skip=victim)
    with_it.check_integrity()
    same_index(without, with_it, contexts(without) + contexts(with_it))


def _corpus(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    base = rng.integers(0, 500, size=400).astype(np.int32)
    return [base[rng.integers(0, 300) :][: rng.integers(20, 100)] for _ in range(n)]


def test_budget_evicts_oldest_first_never_the_written_one() -> None:
    rng = np.random.default_rng(7)
    seqs = _corpus(60, rng)
    unbounded = SuffixIndex()
    for i, s in enumerate(seqs[:10]):
        unbounded.add(i, s)
    budget = unbounded.memory_bytes()  # room for about 10 of them
    ix = SuffixIndex(max_bytes=budget)
    evicted_total = 0
    for i, s in enumerate(seqs):
        evicted_total += ix.add(i, s)
        ids = ix.sequence_ids().tolist()
        assert ids == list(range(i - len(ids) + 1, i + 1))  # a window of the newest, in order
        assert ix.memory_bytes() <= budget
        ix.check_integrity()
    assert evicted_total == len(seqs) - ix.num_sequences > 0
    # The survivors are indexed exactly as if only they had been added, in the same order.
    fresh = SuffixIndex(max_bytes=budget)
    for sid in ix.sequence_ids().tolist():
        fresh.add(sid, seqs[sid])
    same_index(fresh, ix, [s[:n] for s in seqs[-5:] for n in (3, 12)])


def test_growing_sequence_is_never_evicted() -> None:
    ix = SuffixIndex(max_bytes=20_000)
    ix.add(0, np.arange(100, dtype=np.int32))
    for step in range(200):  # a request growing past the whole budget on its own
        ix.extend(1, np.arange(step * 7, step * 7 + 7, dtype=np.int32) % 1000)
    assert ix.sequence_ids().tolist() == [1]
    assert ix.memory_bytes() > ix.max_bytes  # over budget, but the only sequence is the written one
    ix.check_integrity()


def test_extend_evicts_others() -> None:
    ix = SuffixIndex(max_bytes=30_000)
    for i in range(5):
        ix.add(i, np.arange(i * 50, i * 50 + 50, dtype=np.int32))
    n0 = ix.num_sequences
    evicted = sum(ix.extend(99, np.arange(j * 10, j * 10 + 10, dtype=np.int32)) for j in range(40))
    assert evicted > 0 and ix.num_sequences == n0 - evicted + 1 and 99 in ix
    assert ix.memory_bytes() <= ix.max_bytes or ix.sequence_ids().tolist() == [99]
    ix.check_integrity()


@pytest.mark.parametrize("order", ["fifo", "lifo", "middle"])
def test_removing_everything_returns_to_empty(order: str) -> None:
    rng = np.random.default_rng(3)
    seqs = _corpus(30, rng)
    ix = SuffixIndex()
    empty = ix.memory_bytes()
    for i, s in enumerate(seqs):
        ix.add(i, s)
    ids = list(range(len(seqs)))
    if order == "lifo":
        ids.reverse()
    elif order == "middle":
        ids = ids[10:] + ids[:10]
    for k, i in enumerate(ids):
        ix.remove(i)
        if k % 7 == 0:
            ix.check_integrity()
    assert ix.num_tokens == ix.num_sequences == 0
    assert ix.memory_bytes() == empty
    assert ix.stats()["nodes"] == 1 and ix.stats()["keys"] == 0
    ix.check_integrity()


def test_arena_compaction_keeps_everything() -> None:
    """Removing most of a large index compacts the token arena, rewriting every stored position
    (node refs, terminal lists, inline leaves, exact keys, kept tails); nothing observable changes."""
    rng = np.random.default_rng(9)
    base = rng.integers(0, 2000, size=5000).astype(np.int32)
    chunks = [base[s : s + 900] for s in rng.integers(0, 4000, size=110)]
    keep = {5, 50, 108, 109}
    ix, fresh = SuffixIndex(), SuffixIndex()
    for i, c in enumerate(chunks):
        if i % 10 == 5:  # some grow step by step: kept tails, relocations
            for j in range(0, len(c), 300):
                ix.extend(i, c[j : j + 300])
                if i in keep:
                    fresh.extend(i, c[j : j + 300])
        else:
            ix.add(i, c)
            if i in keep:
                fresh.add(i, c)
    arena_before = ix.stats()["arena_tokens"]
    for i in range(len(chunks)):
        if i not in keep:
            ix.remove(i)
    # The last sequence stays, so the arena can only have shrunk by compaction (holes above 65536
    # tokens that outweigh the data trigger it).
    assert ix.stats()["arena_tokens"] < arena_before // 2
    assert ix.stats()["arena_holes"] <= 65536
    ix.check_integrity()
    same_index(fresh, ix, [chunks[i][:n] for i in keep for n in (4, 40, 400)])
    ix.extend(5, base[:100])  # and it keeps working
    fresh.extend(5, base[:100])
    same_index(fresh, ix, [base[:50]])
