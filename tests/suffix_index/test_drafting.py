"""Multi-source drafting (suffix_index.drafting, csrc/drafter.h) through its own API: the fallback table,
the calibration table, the drafter's settings, and DraftingSession's propose / commit / rebase over its
own and shared indexes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import retrieval.proposer  # noqa: F401  registers DraftTree, the record DraftingSession.propose builds
from suffix_index import SuffixIndex
from suffix_index.drafting import (
    CLASS_BASE,
    FALLBACK_CATEGORIES,
    KIND_HISTORY,
    KIND_LOCAL,
    Calibration,
    DrafterParams,
    DraftingSession,
    FallbackTable,
    native_index,
)

PRIOR = 8  # FallbackTable's pseudo-misses
NO_CLASSES = np.zeros(0, dtype=np.int32)


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def params(**changes) -> DrafterParams:
    """The drafter's settings; skip cursors off unless asked for (they guess past the last token)."""
    args = {"min_prob": 1e-4, "levels": 2, "max_copy": 256, "canonical_below": 16, "wide": 32, "skip_below": 0,
            "skip_min": 3}
    return DrafterParams(**{**args, **changes})


def session(max_depth: int = 64, use_context: bool = True, calibration: Calibration | None = None,
            **changes) -> DraftingSession:
    return DraftingSession(max_depth, calibration or Calibration(8.0), NO_CLASSES, params(**changes),
                           use_context=use_context)


def path_probs(tree) -> np.ndarray:
    """Each node's probability of being accepted: its conditional prob times its ancestors'."""
    path = tree.probs.astype(np.float64).copy()
    for i, p in enumerate(tree.parents.tolist()):
        assert -1 <= p < i
        if p >= 0:
            path[i] *= path[p]
    return path


# ---- FallbackTable ----

def test_table_ranks_exactly_below_capacity_and_keeps_categories_apart() -> None:
    rng = np.random.default_rng(0)
    table = FallbackTable()
    counts: Counter[int] = Counter()
    misses = 0
    for _ in range(2000):
        token = int(rng.zipf(1.5)) % 200
        missed = bool(rng.random() < 0.7)
        table.observe(3, token, missed)
        if missed:
            counts[token] += 1
            misses += 1
    top = table.top(3, 10)
    assert [c for _, c in top] == sorted((c for _, c in top), reverse=True)
    expected = sorted(counts.values(), reverse=True)[:10]
    assert [round(p * (misses + PRIOR)) for _, p in top] == expected
    assert all(counts[t] == round(p * (misses + PRIOR)) for t, p in top)
    assert table.num_observations == 2000
    assert table.top(4, 10) == []  # another category saw nothing


def test_table_keeps_heavy_tokens_past_its_capacity() -> None:
    table = FallbackTable()
    for k in range(5000):  # 2000 distinct rare tokens (far more than the counters), two frequent ones
        table.observe(0, 1000 + k % 2000, True)
        if k % 4 == 0:
            table.observe(0, 7, True)
        if k % 10 == 0:
            table.observe(0, 9, True)
    assert [t for t, _ in table.top(0, 2)] == [7, 9]


def test_table_round_trips_and_rejects_bad_tables() -> None:
    table = FallbackTable()
    for token, missed in [(5, True), (5, True), (6, True), (7, False)]:
        table.observe(2, token, missed)
    copy = FallbackTable()
    copy.set_table(table.table())
    assert copy.top(2, 5) == table.top(2, 5) and copy.num_observations == 4
    flat = table.table()
    with pytest.raises(ValueError, match="truncated"):
        copy.set_table(flat[:10])
    with pytest.raises(ValueError, match="trailing"):
        copy.set_table(np.concatenate([flat, [0]]))
    bad = flat.copy()
    bad[2 * 3 + 3 + 1] = 1  # category 2's first count below its second: not ranked
    bad[2 * 3 + 3 + 3] = 2
    with pytest.raises(ValueError, match="ranked"):
        copy.set_table(bad)
    with pytest.raises(ValueError, match="category"):
        table.observe(FALLBACK_CATEGORIES, 1, True)


# ---- Calibration and DrafterParams ----

def test_calibration_prior_rises_with_the_match_and_falls_with_the_share() -> None:
    cal = Calibration(8.0)
    by_match = [cal.estimate(KIND_HISTORY, m, 1.0, False, 1) for m in (1, 2, 4, 8, 16, 32, 64, 100)]
    assert by_match == sorted(by_match) and len(set(by_match)) == len(by_match)
    assert all(0 < p < 0.99 for p in by_match)
    assert cal.estimate(KIND_HISTORY, 100, 1.0, True, 1) == pytest.approx(0.99)  # estimates stop at 0.99
    by_share = [cal.estimate(KIND_HISTORY, 8, s, True, 4) for s in (1.0, 0.8, 0.6, 0.3, 0.1)]
    assert by_share == sorted(by_share, reverse=True)
    assert cal.estimate(KIND_HISTORY, 8, 1.0, False, 1) < cal.estimate(KIND_HISTORY, 8, 1.0, True, 1)
    assert cal.num_observations == 0 and cal.prior_strength == 8.0


def test_calibration_table_round_trips_and_rejects_bad_tables() -> None:
    cal = Calibration(4.0)
    table = cal.table()
    copy = Calibration(8.0)
    copy.set_table(table)
    assert copy.estimate(KIND_LOCAL, 5, 0.5, True, 3) == cal.estimate(KIND_LOCAL, 5, 0.5, True, 3)
    with pytest.raises(ValueError, match="wrong size"):
        copy.set_table(table[:-1])
    bad = table.copy()
    bad[0] = bad[len(bad) // 2] + 1  # more hits than trials
    with pytest.raises(ValueError, match="cell 0 is not a hit rate"):
        copy.set_table(bad)
    with pytest.raises(ValueError, match="prior strength"):
        Calibration(0.0)
    with pytest.raises(ValueError, match="kind"):
        cal.estimate(-1, 1, 1.0, True, 1)


@pytest.mark.parametrize(
    "changes, match",
    [({"min_prob": 1.0}, "min_prob"), ({"min_prob": -0.1}, "min_prob"), ({"levels": 0}, "levels"),
     ({"levels": 9}, "levels"), ({"wide": 0}, "wide")],
)
def test_bad_drafter_params(changes, match) -> None:
    with pytest.raises(ValueError, match=match):
        params(**changes)


# ---- DraftingSession ----

def test_empty_context_and_zero_budget_give_empty_drafts() -> None:
    s = session()
    assert len(s.propose(8)) == 0 and s.context_length == 0
    s.rebase(ids(1, 2, 3), 0)
    assert len(s.propose(0)) == 0
    assert len(s.propose(8)) == 0  # nothing in the prompt repeats


def test_a_session_drafts_what_its_own_prompt_continued() -> None:
    s = session()
    s.rebase(ids(5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7), 0)
    tree = s.propose(4)
    assert tree.token_ids.tolist() == [8, 9, 1, 2] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.match_len == 3 and tree.source == "reprise:context"
    assert tree.score == pytest.approx(path_probs(tree).sum())


def test_commit_reports_the_verifiers_accepted_nodes_and_learns_only_when_asked() -> None:
    cal = Calibration(8.0)
    s = session(calibration=cal)
    s.rebase(ids(5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7), 0)
    tree = s.propose(4)  # 8 9 1 2
    expected, accepted = s.commit(ids(8, 9), ids(0, 1), True, False)  # both drafted nodes were accepted
    assert accepted == 2 and expected == pytest.approx(tree.score)
    assert s.context_length == 13 and s.context().tolist()[-3:] == [7, 8, 9]
    assert cal.num_observations == 0
    assert s.propose(4).token_ids.tolist()[0] == 1
    assert s.commit(ids(4, 1), ids(), True, True)[1] == 0  # the draft's root was 1: nothing accepted
    assert cal.num_observations > 0
    s.propose(4)
    assert s.commit(ids(1, 2), ids(0), False, True) == (0.0, 0)  # a draft nobody verified reports nothing
    assert s.commit(ids(), ids(), True, True) == (0.0, 0)


def test_a_shared_index_drafts_for_a_session_without_its_own() -> None:
    history = SuffixIndex(max_depth=16)
    history.add(0, [1, 2, 3, 4, 5])
    s = session(max_depth=16, use_context=False)
    s.add_source(native_index(history), KIND_HISTORY, False)
    s.rebase(ids(9, 1, 2), 0)
    tree = s.propose(8)
    assert tree.token_ids.tolist() == [3, 4, 5] and tree.source == "reprise:history"
    assert tree.match_len == 2
    history.add(1, [1, 2, 6])  # the session reads the index as it is at each draft
    tree = s.propose(8)
    assert sorted(tree.token_ids[tree.parents < 0].tolist()) == [3, 6]


def test_rebase_keeps_a_context_that_extends_and_starts_over_otherwise() -> None:
    s = session()
    s.rebase(ids(1, 2, 3, 1, 2), 0)
    s.rebase(ids(1, 2, 3, 1, 2, 3, 4), 0)
    assert s.context().tolist() == [1, 2, 3, 1, 2, 3, 4]
    s.rebase(ids(7, 8, 7), 2)
    assert s.context().tolist() == [7, 8, 7] and s.propose(2).token_ids.tolist() == [8, 7]


def test_bad_session_input() -> None:
    s = session()
    with pytest.raises(ValueError, match="token id -1 at index 1 of prompt"):
        s.rebase(ids(1, -1), 0)
    with pytest.raises(ValueError, match="outside"):
        s.rebase(ids(CLASS_BASE), 0)
    with pytest.raises(ValueError, match="1-D"):
        s.rebase(np.zeros((2, 2), dtype=np.int32), 0)
    with pytest.raises(ValueError, match="budget"):
        s.propose(-1)
    with pytest.raises(ValueError, match="budget"):
        s.propose(4097)
    with pytest.raises(ValueError, match="token_ids"):
        s.commit(ids(-5), ids(), True, True)
    with pytest.raises(ValueError, match="not a node of the last draft"):
        s.commit(ids(5), ids(3), True, True)  # no draft is due
    with pytest.raises(ValueError, match="accepted nodes but only"):
        s.commit(ids(5), ids(0, 1), True, True)
    with pytest.raises(ValueError, match="source kind"):
        s.add_source(native_index(SuffixIndex()), 99, False)
    with pytest.raises(TypeError, match="SuffixIndex"):
        native_index(object())


def occurs(seq: list[int], s: list[int]) -> bool:
    return any(seq[i : i + len(s)] == s for i in range(len(seq) - len(s) + 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 16), st.integers(1, 3))
def test_every_drafted_path_continues_an_occurrence_of_the_context(prompt, budget, levels) -> None:
    """No copies past the trie (depth 64 > prompt + budget) and no skip cursors: every node's path
    string follows some suffix of the context somewhere in the prompt, and the tree keeps its contract
    (one child per token, path probabilities summing to the score)."""
    s = session(levels=levels)
    s.rebase(np.array(prompt, dtype=np.int32), 0)
    tree = s.propose(budget)
    assert len(tree) <= budget
    path = path_probs(tree)
    assert np.all((tree.probs > 0) & (tree.probs <= 1)) and tree.score == pytest.approx(path.sum(), rel=1e-5)
    parents, tokens = tree.parents.tolist(), tree.token_ids.tolist()
    siblings = Counter(zip(parents, tokens))
    assert max(siblings.values(), default=1) == 1
    for i in range(len(tree)):
        string, j = [], i
        while j >= 0:
            string.insert(0, tokens[j])
            j = parents[j]
        assert any(occurs(prompt, prompt[len(prompt) - m :] + string) for m in range(1, len(prompt) + 1)), i


@pytest.mark.parametrize("shared", [False, True])
def test_a_session_grown_by_commits_drafts_as_a_fresh_one(shared: bool) -> None:
    """Match hints (the previous draft's match bounds the next search) change no draft: a session that
    commits token by token drafts exactly as one rebased onto the whole context at once."""
    rng = np.random.default_rng(3)
    phrases = [rng.integers(0, 50, 12).tolist() for _ in range(4)]
    text = [t for k in rng.integers(0, 4, 30) for t in phrases[k]]
    history = SuffixIndex(max_depth=24)
    history.add(0, text[:200])

    def fresh(context: list[int]) -> DraftingSession:
        s = session(max_depth=24, use_context=not shared, skip_below=2)
        if shared:
            s.add_source(native_index(history), KIND_HISTORY, False)
        s.rebase(np.array(context, dtype=np.int32), 0)
        return s

    grown = fresh(text[:5])
    for end in range(5, 120):
        if end > 5:
            grown.commit(ids(text[end - 1]), ids(), True, False)
        a, b = grown.propose(16), fresh(text[:end]).propose(16)
        assert (a.token_ids.tolist(), a.parents.tolist(), a.probs.tolist(), a.match_len) == (
            b.token_ids.tolist(), b.parents.tolist(), b.probs.tolist(), b.match_len), end
