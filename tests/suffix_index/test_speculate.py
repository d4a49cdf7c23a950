"""SuffixIndex.speculate phase by phase (csrc/speculate.cc), each against the brute-force oracle: the
longest-match search at its edges, the lengths whose suffix occurs once (one chain, and the bisections
for where that range starts), and the remaining lengths taken in decreasing order of their bound."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.suffix_checks import assert_same_draft
from testkit.suffix_oracle import Oracle

from suffix_index import SuffixIndex


def indexed(depth: int, *seqs: list[int]) -> tuple[SuffixIndex, Oracle]:
    ix = SuffixIndex(max_depth=depth, key_lengths=())
    oracle = Oracle(depth, ())
    for i, seq in enumerate(seqs):
        ix.add(i, seq)
        oracle.add(i, seq)
    return ix, oracle


def speculate(ix: SuffixIndex, oracle: Oracle, ctx: list[int], max_tokens: int, factor: float = 1.0,
              offset: float = 0.0, min_prob: float = 0.1, use_tree: bool = False):
    """The index's draft, checked against the oracle's."""
    got = ix.speculate(ctx, max_tokens, max_spec_factor=factor, max_spec_offset=offset, min_token_prob=min_prob,
                       use_tree=use_tree)
    assert_same_draft(got, oracle.speculate(ctx, max_tokens, factor, offset, min_prob, use_tree),
                      f"speculate({ctx}, {max_tokens}, tree={use_tree})")
    return got


R = list(range(1, 13))  # 12 distinct tokens
LONG = list(range(1, 21))  # 20 distinct tokens


# ---- the longest match: its search's edges ----

@pytest.mark.parametrize("use_tree", [False, True])
def test_longest_match_at_its_bounds(use_tree: bool) -> None:
    """Every suffix ending in 8 continues with 9 or 10 (0.5 each): with min_prob 0.6 nothing is drafted,
    and the empty draft reports the longest match the search found."""
    ix, oracle = indexed(8, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 10])
    longest = {
        (): 0,
        (11,): 0,  # the last token is new
        (11, 8): 1,  # one token, shorter than the context
        (8,): 1,  # the whole one-token context
        (3, 4, 5, 6, 7, 8): 6,  # the whole context: the first probe holds
        (9, 1, 2, 3, 4, 5, 6, 7, 8): 8,  # capped at max_depth though 9 context tokens occur
    }
    for ctx, m in longest.items():
        d = speculate(ix, oracle, list(ctx), 4, min_prob=0.6, use_tree=use_tree)
        assert len(d) == 0 and d.match_len == m, ctx
        speculate(ix, oracle, list(ctx), 4, factor=2.0, min_prob=0.1, use_tree=use_tree)
    assert len(SuffixIndex(max_depth=8).speculate([1, 2], 4)) == 0  # an empty index


# ---- lengths whose suffix occurs once ----

def test_unique_peak_below_the_unique_range_bisects_above_it() -> None:
    """Suffixes up to 12 tokens occur twice, the 13-token context once. The chain's length peaks at m = 8
    (budget m against depth room 16 - m), which is not unique: the unique range is bisected for in
    (8, 13] and starts at 13, whose chain (3 tokens of depth room) beats the twice-seen shorter lengths."""
    ix, oracle = indexed(16, R + [20, 21, 22, 23], [30] + R + list(range(40, 50)))
    d = speculate(ix, oracle, [30] + R, 16)
    assert d.token_ids.tolist() == [40, 41, 42] and d.probs.tolist() == [1.0] * 3
    assert (d.score, d.match_len) == (3.0, 13)
    speculate(ix, oracle, [30] + R, 16, use_tree=True)


@pytest.mark.parametrize("elsewhere", [[60, 61, 62, 63, 64, 65], [50, 51, 52, 53, 54, 55]])
def test_unique_peak_with_many_open_shorter_lengths_bisects_below_it(elsewhere: list[int]) -> None:
    """The 20-token context occurs once with 2 tokens after it: every unique length drafts the same
    2-token chain, so the peak is the longest; 17 shorter lengths have bounds above 2, so where the unique
    range starts (11: the last 10 tokens occur elsewhere too) is bisected for. Where the other occurrence
    goes on differently, a path from 10 tokens scores 1 and the chain wins (a tree takes both branches and
    wins); where it agrees and goes on longer, the shorter match wins in both modes."""
    ix, oracle = indexed(32, LONG + [50, 51], LONG[10:] + elsewhere)
    d = speculate(ix, oracle, LONG, 32)
    if elsewhere[0] != 50:
        assert d.token_ids.tolist() == [50, 51] and (d.score, d.match_len) == (2.0, 20)
    else:
        assert d.token_ids.tolist()[:2] == [50, 51] and d.match_len == 10 and d.score > 2
    assert speculate(ix, oracle, LONG, 32, use_tree=True).match_len == 10


def test_unique_peak_with_few_open_lengths_leaves_them_to_the_bound_order() -> None:
    """Budgets of 2 leave no shorter length above the chain's score: the unique range starts at the peak,
    and the unique lengths below it, which tie with it, lose to the longer match."""
    ix, oracle = indexed(32, LONG + [50, 51], LONG[10:] + [60, 61])
    for use_tree in (False, True):
        d = speculate(ix, oracle, LONG, 2, use_tree=use_tree)
        assert d.token_ids.tolist() == [50, 51] and (d.score, d.match_len) == (2.0, 20)


def test_unique_match_at_a_sequence_end_leaves_the_draft_to_shorter_lengths() -> None:
    """The whole first sequence is the context: its one occurrence is followed by nothing (chain length
    0), and its last 3 tokens, seen in the second sequence too, draft what followed there."""
    ix, oracle = indexed(16, [9, 8, 1, 2, 3], [1, 2, 3, 4, 5])
    for use_tree in (False, True):
        d = speculate(ix, oracle, [9, 8, 1, 2, 3], 8, factor=4.0, use_tree=use_tree)
        assert d.token_ids.tolist() == [4, 5] and d.match_len == 3 and d.probs.tolist() == [0.5, 0.5]


# ---- the other lengths, by bound ----

@pytest.mark.parametrize("use_tree", [False, True])
def test_a_shorter_match_with_more_occurrences_wins_on_score(use_tree: bool) -> None:
    """Path bounds rise then fall with m (budget m, depth room 10 - m), so lengths are tried from the
    middle outwards; the 2-token match's frequent continuation outscores the 4-token match."""
    seqs = [[7, 8, 1, 2, 9, 9, 9]] + [[5, 1, 2, 3, 4, 5, 6]] * 4 + [[8, 1, 2, 6]]
    ix, oracle = indexed(10, *seqs)
    for offset in (0.0, 2.0, -1.0):
        speculate(ix, oracle, [6, 7, 8, 1, 2], 6, factor=2.0, offset=offset, min_prob=0.0, use_tree=use_tree)
        speculate(ix, oracle, [6, 7, 8, 1, 2], 6, factor=0.5, offset=offset, min_prob=0.3, use_tree=use_tree)


def test_ties_go_to_the_longer_match() -> None:
    ix, oracle = indexed(8, [1, 2, 3, 4], [2, 3, 4])
    d = speculate(ix, oracle, [1, 2, 3], 4, factor=2.0, min_prob=0.0)
    assert d.match_len == 3 and d.token_ids.tolist() == [4]


# ---- all phases together, deeper than test_properties' tries ----

phrase_st = st.lists(st.integers(0, 4), min_size=1, max_size=10)


@st.composite
def corpora(draw):
    phrases = draw(st.lists(phrase_st, min_size=1, max_size=4))
    seqs = draw(st.lists(st.lists(st.sampled_from(range(len(phrases))), min_size=1, max_size=5), min_size=1,
                         max_size=3))
    return [[t for k in seq for t in phrases[k]] for seq in seqs]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpora(), st.integers(8, 20), st.sampled_from([2, 8, 16]), st.sampled_from([0.5, 1.0, 3.0]),
       st.sampled_from([0.0, 0.2]), st.data())
def test_deep_tries_match_the_oracle(seqs, depth, max_tokens, factor, min_prob, data) -> None:
    """Repeated phrases make long matches, unique and not, at many lengths."""
    ix, oracle = indexed(depth, *seqs)
    for _ in range(3):
        seq = data.draw(st.sampled_from(seqs))
        ctx = seq[: data.draw(st.integers(1, len(seq)))] + data.draw(st.lists(st.integers(0, 4), max_size=1))
        for use_tree in (False, True):
            speculate(ix, oracle, ctx, max_tokens, factor, 0.0, min_prob, use_tree)
