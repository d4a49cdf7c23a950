"""SuffixIndex against the brute-force oracle: counts, canonical shape, exact keys, drafts in both modes,
exact-key drafts, and check_integrity() after every mutation, over random add/extend/remove histories."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.suffix_checks import assert_same_draft
from testkit.suffix_oracle import Oracle

from suffix_index import SuffixIndex

# A tiny vocabulary makes repeats (and so branching, shared edges, promotions, splits) common.
tokens_st = st.lists(st.integers(0, 3), max_size=14)
op_st = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), tokens_st),
    st.tuples(st.just("extend"), st.integers(0, 5), tokens_st),
    st.tuples(st.just("remove"), st.integers(0, 5), st.just([])),
)
params_st = st.tuples(
    st.integers(1, 8),  # max_tokens
    st.sampled_from([0.5, 1.0, 2.0, 3.5]),  # max_spec_factor
    st.sampled_from([0.0, 1.0, -1.0]),  # max_spec_offset
    st.sampled_from([0.0, 0.1, 0.3, 0.6]),  # min_token_prob
)


@st.composite
def histories(draw):
    depth = draw(st.integers(1, 7))
    keys = tuple(sorted(draw(st.sets(st.integers(1, depth - 1), max_size=3)))) if depth > 1 else ()
    ops = draw(st.lists(op_st, min_size=1, max_size=12))
    return depth, keys, ops


def apply(ix: SuffixIndex, oracle: Oracle, op: tuple) -> None:
    kind, sid, toks = op
    if kind == "add":
        if sid in oracle.seqs:
            return
        ix.add(sid, toks)
        oracle.add(sid, toks)
    elif kind == "extend":
        ix.extend(sid, toks)
        oracle.extend(sid, toks)
    elif sid in oracle.seqs:
        ix.remove(sid)
        oracle.remove(sid)


def contexts(oracle: Oracle, rng: np.random.Generator) -> list[list[int]]:
    """Contexts that hit the index: sequence suffixes, prefixes with a perturbed end, random ones."""
    out: list[list[int]] = [[], [2], [0, 1, 2, 3]]
    for seq in oracle.seqs.values():
        if seq:
            cut = int(rng.integers(1, len(seq) + 1))
            out.append(seq[:cut])
            out.append(seq[:cut] + [int(rng.integers(0, 4))])
    out.extend(rng.integers(0, 4, size=int(rng.integers(1, 10))).tolist() for _ in range(3))
    return out


def check_state(ix: SuffixIndex, oracle: Oracle, rng: np.random.Generator, params) -> None:
    ix.check_integrity()
    stats = ix.stats()
    assert ix.num_tokens == sum(len(s) for s in oracle.seqs.values())
    assert ix.num_sequences == len(oracle.seqs)
    assert ix.sequence_ids().tolist() == oracle.created
    for sid, seq in oracle.seqs.items():
        assert ix.get_sequence(sid).tolist() == seq
    assert stats["nodes"] - 1 == oracle.num_nodes()
    for s, c in oracle.counts.items():  # every indexed string's count
        assert ix.count(list(s)) == c, s
    assert ix.count([0] * (oracle.depth - 1) + [9]) == 0
    for k in oracle.keys:
        assert stats[f"keys_k{k}"] == oracle.num_keys(k)
    max_tokens, factor, offset, min_prob = params
    for ctx in contexts(oracle, rng):
        for use_tree in (False, True):
            got = ix.speculate(
                ctx,
                max_tokens,
                max_spec_factor=factor,
                max_spec_offset=offset,
                min_token_prob=min_prob,
                use_tree=use_tree,
            )
            want = oracle.speculate(ctx, max_tokens, factor, offset, min_prob, use_tree)
            assert_same_draft(got, want, f"speculate({ctx}, tree={use_tree})")
        for min_key in (None, 2):
            got = ix.speculate_exact(ctx, max_tokens, min_key_len=min_key)
            ids, probs, score, k = oracle.speculate_exact(ctx, max_tokens, min_key or 0)
            assert got.token_ids.tolist() == ids, f"speculate_exact({ctx})"
            assert got.parents.tolist() == list(range(-1, len(ids) - 1))
            assert got.probs.tolist() == np.array(probs, dtype=np.float32).tolist()
            assert math.isclose(got.score, score, rel_tol=1e-12), f"speculate_exact({ctx})"
            assert got.match_len == k


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), params_st, st.integers(0, 2**32 - 1))
def test_index_matches_oracle_after_every_mutation(history, params, seed) -> None:
    depth, keys, ops = history
    rng = np.random.default_rng(seed)
    ix = SuffixIndex(max_depth=depth, key_lengths=keys)
    oracle = Oracle(depth, keys)
    for op in ops:
        apply(ix, oracle, op)
        check_state(ix, oracle, rng, params)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=5), st.integers(2, 5)
)
def test_token_by_token_extend_equals_add(chunks, depth) -> None:
    """A sequence grown one token at a time indexes exactly what adding it whole does."""
    whole = [t for c in chunks for t in c]
    grown = SuffixIndex(max_depth=depth, key_lengths=(1,))
    for c in chunks:
        for t in c:
            grown.extend(7, [t])
        grown.check_integrity()
    added = SuffixIndex(max_depth=depth, key_lengths=(1,))
    added.add(7, whole)
    assert grown.stats()["nodes"] == added.stats()["nodes"]
    assert grown.stats()["keys_k1"] == added.stats()["keys_k1"]
    oracle = Oracle(depth, (1,))
    oracle.add(7, whole)
    for m in range(1, len(whole) + 1):
        ctx = whole[:m]
        assert_same_draft(
            grown.speculate(ctx, 8, use_tree=True), oracle.speculate(ctx, 8, use_tree=True), str(ctx)
        )
