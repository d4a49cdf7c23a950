"""Prompt lookup against a brute-force statement of vLLM's n-gram rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.prompt_lookup import (
    VLLM_MAX_N,
    VLLM_MIN_N,
    PromptLookupProposer,
    ngram_continuation,
)
from retrieval.session import Verified


def brute_force(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last-n tokens occur earlier (ending before the last token),
    the earliest such occurrence, and the up to k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(context):
            continue
        suffix = context[len(context) - n:]
        for start in range(len(context) - n):
            if context[start:start + n] == suffix:
                return context[start + n:start + n + k]
    return []


contexts = st.lists(st.integers(0, 3), max_size=60)


@settings(max_examples=400, deadline=None)
@given(contexts, st.integers(1, 4), st.integers(0, 4), st.integers(0, 10))
def test_matches_brute_force(context, min_n, extra, k):
    max_n = min_n + extra
    got = ngram_continuation(np.asarray(context, dtype=np.int32), min_n, max_n, k)
    assert got.tolist() == brute_force(context, min_n, max_n, k)


@settings(max_examples=100, deadline=None)
@given(contexts, st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=8), st.integers(1, 8))
def test_session_drafts_over_prompt_plus_committed_tokens(prompt, commits, budget):
    session = PromptLookupProposer(2, 5).begin("t", "s", prompt)
    context = list(prompt)
    for ids in commits:
        tree = session.propose(budget)
        tree.validate()
        assert tree.token_ids.tolist() == brute_force(context, 2, 5, budget)
        assert len(tree) <= budget
        assert tree.parents.tolist() == list(range(-1, len(tree) - 1))
        session.commit(Verified.tokens(ids))
        context += ids
    assert session.context.tolist() == context
    session.finish(record=True)


def test_earliest_occurrence_of_the_longest_match_wins():
    #          0  1  2  3  4  5  6  7  8  9 10
    context = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3, 7]
    # suffix [..., 3, 7]: "7" never occurred before -> nothing.
    assert ngram_continuation(np.array(context), 1, 5, 4).tolist() == []
    context = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    # longest: [1, 2, 3] at 0 (n=3) beats the later [2, 3] at 4; draft follows position 2.
    assert ngram_continuation(np.array(context), 2, 5, 4).tolist() == [9, 2, 3, 8]
    assert ngram_continuation(np.array(context), 2, 5, 2).tolist() == [9, 2]
    # with max_n 2 the earliest [2, 3] is also at 1.
    assert ngram_continuation(np.array(context), 2, 2, 3).tolist() == [9, 2, 3]
    # min_n above every match: nothing.
    assert ngram_continuation(np.array(context), 4, 5, 3).tolist() == []


def test_defaults_are_vllms():
    assert (VLLM_MIN_N, VLLM_MAX_N) == (5, 5)
    proposer = PromptLookupProposer()
    assert (proposer.min_n, proposer.max_n) == (5, 5)
    context = [4, 5, 6, 7, 8, 1, 2, 4, 5, 6, 7, 8]
    tree = proposer.begin("t", "s", context).propose(3)
    assert tree.token_ids.tolist() == [1, 2, 4]
    assert tree.source == "prompt_lookup" and tree.score == 3.0
    assert proposer.begin("t", "s", context).propose(0).num_nodes == 0
    assert proposer.begin("t", "s", []).propose(8).num_nodes == 0


@pytest.mark.parametrize(("min_n", "max_n"), [(0, 3), (3, 2), (-1, -1)])
def test_bad_n_range_is_rejected(min_n, max_n):
    with pytest.raises(ValueError, match="min_n"):
        PromptLookupProposer(min_n, max_n)


def test_long_outputs_grow_the_buffer():
    session = PromptLookupProposer(1, 2).begin("t", "s", [1, 2, 3])
    for i in range(3000):
        session.commit(Verified.tokens([i % 7, 5]))
    assert len(session.context) == 3 + 6000
    assert session.propose(4).token_ids.tolist() == brute_force(session.context.tolist(), 1, 2, 4)
