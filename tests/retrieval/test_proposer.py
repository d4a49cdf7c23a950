"""The full Reprise proposer: contract, history, copies past the depth, canonical numbers, learning,
session reuse, snapshots, deletion, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from testkit.drafting import verified_along

from retrieval.config import DraftingConfig
from retrieval.draft_tree import DraftTree
from retrieval.proposer import RepriseProposer
from retrieval.registry import make_proposer, proposer_names
from retrieval.session import Verified
from retrieval.vocabulary import CLASS_NUMBER, number_classes
from suffix_index.drafting import KIND_HISTORY, KIND_HISTORY_CANONICAL, KIND_LOCAL, KIND_LOCAL_CANONICAL

KINDS = 10  # calibration rows (source kinds) in a table


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def check_tree(tree: DraftTree, budget: int) -> None:
    """The DraftTree contract, and probabilities as the drafter promises them."""
    assert len(tree) <= budget
    tree.validate()
    assert np.all((tree.probs > 0) & (tree.probs <= 1.0))
    path = tree.probs.astype(np.float64).copy()
    for i, p in enumerate(tree.parents):
        if p >= 0:
            path[i] *= path[p]
    assert tree.score == pytest.approx(path.sum(), rel=1e-4)


def decode_walk(tree: DraftTree, truth: list[int]) -> int:
    """Draft tokens a greedy walk would accept against ``truth``."""
    at, n = -1, 0
    while n < len(truth):
        kids = [i for i, p in enumerate(tree.parents) if p == at and tree.token_ids[i] == truth[n]]
        if not kids:
            break
        at, n = kids[0], n + 1
    return n


def run_request(p, tenant: str, session: str, prompt, output, budget: int = 16, record: bool = True) -> int:
    """Decode ``output`` as the canonical replay does; returns the verification steps taken."""
    s = p.begin(tenant, session, prompt)
    pos = steps = 0
    while pos < len(output):
        tree = s.propose(budget)
        check_tree(tree, budget)
        n = min(decode_walk(tree, list(output[pos:])) + 1, len(output) - pos)
        s.commit(verified_along(tree, output[pos:pos + n]))
        pos += n
        steps += 1
    s.finish(record=record)
    return steps


def test_defaults_and_registry() -> None:
    c = DraftingConfig()
    assert c.max_draft_tokens == 32 and c.lead_in == 16 and c.canonical and c.learn
    assert {"reprise", "suffix", "corpus", "exact_key", "suffixdecoding", "prompt_lookup"} <= set(proposer_names())
    assert isinstance(make_proposer("reprise"), RepriseProposer)
    with pytest.raises(ValueError, match="levels"):
        DraftingConfig(levels=0)
    with pytest.raises(ValueError, match="at least one"):
        DraftingConfig(use_context=False, use_history=False, use_corpus=False)


def test_first_request_drafts_from_its_own_prompt() -> None:
    p = RepriseProposer()
    s = p.begin("t", "s", ids(5, 6, 7, 8, 9, 1, 2, 5, 6))
    tree = s.propose(8)
    check_tree(tree, 8)
    assert decode_walk(tree, [7, 8, 9, 1]) == 4  # copies what followed "5 6" earlier in the prompt


def test_empty_prompt_and_zero_budget() -> None:
    p = RepriseProposer()
    s = p.begin("t", "s", ids())
    assert len(s.propose(8)) == 0
    s.commit(Verified.tokens(ids(3)))
    assert len(s.propose(0)) == 0
    s.finish()


def test_history_drafts_the_next_trial_and_beats_no_history() -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 500, 40).astype(np.int32)
    answer = rng.integers(0, 500, 120).astype(np.int32)
    p = RepriseProposer()
    first = run_request(p, "t", "trial-0", prompt, answer)
    second = run_request(p, "t", "trial-1", prompt, answer)
    assert second < first / 3  # the second trial copies the first one's answer, 16 tokens a step


def test_copies_run_past_the_trie_depth() -> None:
    config = DraftingConfig(max_depth=8)
    p = RepriseProposer(config)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, 30).astype(np.int32)
    answer = rng.integers(0, 1000, 60).astype(np.int32)
    run_request(p, "t", "a", prompt, answer)
    s = p.begin("t", "b", prompt)
    tree = s.propose(32)
    assert decode_walk(tree, list(answer)) == 32  # far beyond max_depth - match length


def test_record_false_keeps_history_unchanged() -> None:
    p = RepriseProposer()
    run_request(p, "t", "a", ids(1, 2, 3), ids(4, 5, 6, 7), record=False)
    assert p.index_stats("t").num_trajectories == 0
    run_request(p, "t", "a", ids(1, 2, 3), ids(4, 5, 6, 7), record=True)
    assert p.index_stats("t").num_trajectories == 1


@pytest.mark.parametrize("live", [True, False])
def test_running_requests_of_a_tenant_draft_from_each_others_output(live: bool) -> None:
    """Two trials of one task at once (``live_history``): the second drafts what the first has generated
    so far, before the first ends; another tenant's request never does; once the first ends unrecorded,
    its live output is gone."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 500, 40).astype(np.int32)
    answer = rng.integers(0, 500, 60).astype(np.int32)
    p = RepriseProposer(DraftingConfig(live_history=live))
    first = p.begin("t", "trial-0", prompt)
    first.commit(Verified.tokens(answer[:40]))  # running: 40 tokens generated, not finished
    assert p.index_stats("t").num_history_tokens == 0  # alone: nobody else would draft from it
    second = p.begin("t", "trial-1", prompt)
    assert p.index_stats("t").num_history_tokens == (16 + 40 if live else 0)  # its lead-in and output
    other = p.begin("u", "trial-0", prompt)
    assert decode_walk(second.propose(16), list(answer)) == (16 if live else 0)
    assert decode_walk(other.propose(16), list(answer)) == 0  # tenants share nothing
    snapshot = p.history("t").snapshot()  # recorded turns only: the running one is recorded when it ends
    first.finish(record=False)
    assert decode_walk(second.propose(16), list(answer)) == 0
    assert snapshot == p.history("t").snapshot()
    assert p.index_stats("t").num_trajectories == 0
    second.commit(Verified.tokens(answer[:8]))
    assert p.index_stats("t").num_trajectories == 0  # a running output is not a recorded turn
    second.finish(record=True)
    assert p.index_stats("t").num_trajectories == 1  # the recorded turn, once


def test_a_restore_while_requests_run_leaves_the_restored_turns_alone() -> None:
    """A restore replaces the index running requests shared: from then on they share nothing, and their
    later tokens and ends touch none of the restored sequences (whose ids may be theirs)."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 500, 30).astype(np.int32)
    p = RepriseProposer()
    first, second = p.begin("t", "a", prompt), p.begin("t", "b", prompt)
    first.commit(Verified.tokens(rng.integers(0, 500, 20).astype(np.int32)))  # shared: in the index
    other = RepriseProposer()
    run_request(other, "t", "x", prompt, rng.integers(0, 500, 30).astype(np.int32))
    restored = other.history("t").snapshot()
    p.history("t").restore(restored)
    first.commit(Verified.tokens(rng.integers(0, 500, 5).astype(np.int32)))
    second.commit(Verified.tokens(rng.integers(0, 500, 5).astype(np.int32)))
    first.finish(record=False)
    second.finish(record=False)
    assert p.history("t").snapshot() == restored


def _toy_vocabulary():
    words = {i: f"w{i}" for i in range(100)}
    words.update({100 + i: str(i) for i in range(50)})  # number tokens
    return (lambda i: words[i]), 150


def test_canonical_matching_drafts_structure_after_a_fresh_number() -> None:
    decode, size = _toy_vocabulary()
    classes = number_classes(decode, size)
    assert classes[105] == CLASS_NUMBER and classes[5] == 5
    p = RepriseProposer()
    p.set_vocabulary(decode, size)
    prompt = ids(1, 2, 3)
    run_request(p, "t", "a", prompt, ids(10, 11, 12, 107, 13, 14, 15, 16, 17))  # "... 7 ..." then structure
    s = p.begin("t", "b", ids(1, 2, 3, 10, 11, 12, 142))  # same structure, another number (42)
    tree = s.propose(8)
    assert decode_walk(tree, [13, 14, 15, 16, 17]) == 5
    assert not np.isin(tree.token_ids, [107, 142]).any() or decode_walk(tree, [13]) == 1
    # exact matching alone: the fallback would guess 13 after a number, having seen it once
    plain = RepriseProposer(dataclasses.replace(DraftingConfig(), canonical=False, fallback=False))
    plain.set_vocabulary(decode, size)
    run_request(plain, "t", "a", prompt, ids(10, 11, 12, 107, 13, 14, 15, 16, 17))
    s2 = plain.begin("t", "b", ids(1, 2, 3, 10, 11, 12, 142))
    assert decode_walk(s2.propose(8), [13, 14, 15, 16, 17]) == 0  # exact matching breaks at 42


def _observed_rows(p: RepriseProposer, tenant: str) -> set[int]:
    """Calibration rows (source kinds) with observations beyond their prior."""
    table = p.history(tenant).calibration.table()
    trials = table[len(table) // 2:].reshape(KINDS, -1)
    return {k for k in range(KINDS) if np.any(trials[k] > DraftingConfig().prior_strength)}


def test_canonical_twins_match_only_where_a_number_is_near_the_end() -> None:
    """Without a number among the last tokens the canonical strings are the real ones (same occurrences):
    the canonical indexes add no cursors, so their calibration rows learn nothing; after a number they do."""
    decode, size = _toy_vocabulary()
    p = RepriseProposer()
    p.set_vocabulary(decode, size)
    rng = np.random.default_rng(5)
    words = rng.integers(0, 100, 300).astype(np.int32)  # no number tokens
    run_request(p, "t", "a", words[:100], words[100:])
    run_request(p, "t", "b", words[:100], words[100:])
    rows = _observed_rows(p, "t")
    assert {KIND_LOCAL, KIND_HISTORY} <= rows
    assert not rows & {KIND_LOCAL_CANONICAL, KIND_HISTORY_CANONICAL}
    # a fresh number right before known structure: the canonical history drafts past it
    run_request(p, "t", "c", ids(1, 2, 3), ids(10, 11, 12, 107, 13, 14, 15, 16, 17))
    s = p.begin("t", "d", ids(1, 2, 3, 10, 11, 12, 142))
    assert decode_walk(s.propose(8), [13, 14, 15, 16, 17]) == 5
    s.commit(Verified.tokens(ids(13)))
    assert KIND_HISTORY_CANONICAL in _observed_rows(p, "t")


def test_a_copy_carries_the_best_calibrated_estimate_of_its_sources() -> None:
    """Along a copy that the request and the history both continue (inside trie edges), every node's
    probability is the better of the two sources' calibrated estimates at its match length."""
    p = RepriseProposer(dataclasses.replace(DraftingConfig(), fallback=False))
    seq = np.arange(1000, 1100, dtype=np.int32)  # tokens that occur once
    run_request(p, "t", "a", ids(1, 2, 3), seq)
    s = p.begin("t", "b", np.concatenate([seq[:40], ids(999), seq[:20]]))
    tree = s.propose(16)
    check_tree(tree, 16)
    assert list(tree.token_ids) == list(seq[20:36]) and list(tree.parents) == list(range(-1, 15))
    cal = p.history("t").calibration
    for i, prob in enumerate(tree.probs):
        best = max(cal.estimate(kind, 20 + i, 1.0, True, 1) for kind in (KIND_LOCAL, KIND_HISTORY))
        assert prob == pytest.approx(best, rel=1e-6)


def test_calibration_learns_from_commits() -> None:
    p = RepriseProposer()
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 50, 400).astype(np.int32)
    before = p.history("t").calibration.num_observations
    run_request(p, "t", "a", tokens[:200], tokens[200:])
    assert p.history("t").calibration.num_observations > before
    frozen = RepriseProposer(dataclasses.replace(DraftingConfig(), learn=False))
    run_request(frozen, "t", "a", tokens[:200], tokens[200:])
    assert frozen.history("t").calibration.num_observations == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_session_reuse_drafts_exactly_as_a_fresh_index(seed: int) -> None:
    """A session's next request reuses its parked indexes; drafts equal rebuilding from scratch."""
    rng = np.random.default_rng(seed)
    cached = RepriseProposer()
    fresh = RepriseProposer(dataclasses.replace(DraftingConfig(), session_cache_bytes=0))
    conversation = rng.integers(0, 80, 30).astype(np.int32)
    for turn in range(4):
        output = rng.integers(0, 80, 25).astype(np.int32)
        trees = []
        for p in (cached, fresh):
            s = p.begin("t", "sess", conversation)
            trees.append(s.propose(16))
            s.commit(verified_along(trees[-1], output))
            trees.append(s.propose(16))
            s.finish()
        for a, b in zip(trees[:2], trees[2:]):  # cached vs fresh, before and after the commit
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            np.testing.assert_array_equal(a.parents, b.parents)
        # the next prompt extends this one: the output plus a new user turn
        conversation = np.concatenate([conversation, output, rng.integers(0, 80, 10).astype(np.int32)])


def test_snapshot_restore_drafts_identically_and_rejects_corruption() -> None:
    rng = np.random.default_rng(3)
    config = dataclasses.replace(DraftingConfig(), collapse_threshold=0.0)  # random data collapses acceptance
    p = RepriseProposer(config)
    for k in range(5):
        run_request(p, "t", f"s{k}", rng.integers(0, 60, 20).astype(np.int32),
                    rng.integers(0, 60, 30).astype(np.int32))
    p.add_corpus("t", [rng.integers(0, 60, 50).astype(np.int32)])
    data = p.snapshot("t")
    q = RepriseProposer(config)
    q.restore("t", data)
    for _ in range(10):
        ctx = rng.integers(0, 60, 12).astype(np.int32)
        a, b = p.begin("t", "x", ctx).propose(16), q.begin("t", "x", ctx).propose(16)
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.probs, b.probs)
    assert dataclasses.replace(q.index_stats("t"), calibration_observations=0) == \
        dataclasses.replace(p.index_stats("t"), calibration_observations=0)
    np.testing.assert_array_equal(q.history("t").calibration.table(), p.history("t").calibration.table())
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(ValueError, match="corrupt"):
        q.restore("t", bytes(bad))
    with pytest.raises(ValueError):
        q.restore("t", data[:-10])
    with pytest.raises(ValueError, match="magic"):
        q.restore("t", b"nonsense" * 10)
    with pytest.raises(TypeError):
        q.restore("t", "text")  # type: ignore[arg-type]


def test_deleted_tenant_is_not_recreated_by_a_late_request() -> None:
    p = RepriseProposer()
    s = p.begin("t", "s", ids(1, 2, 3))
    s.commit(Verified.tokens(ids(4, 5)))
    p.delete("t")
    s.finish(record=True)  # finishing after the deletion records nothing
    assert "t" not in p.tenants()
    with pytest.raises(KeyError):
        p.begin("t", "s", ids(1))


def test_corpus_only_drafts_from_the_corpus() -> None:
    corpus_only = make_proposer("corpus")
    corpus_only.add_corpus("t", [ids(20, 21, 22, 23, 24, 25)])
    s = corpus_only.begin("t", "s", ids(9, 9, 7, 8, 20, 21))
    assert decode_walk(s.propose(8), [22, 23, 24, 25]) == 4
    s2 = corpus_only.begin("t", "s2", ids(7, 8, 30, 7, 8))  # only its own prompt would draft this
    assert len(s2.propose(8)) == 0


@pytest.mark.parametrize("bad", [np.array([1.5, 2.0]), np.array([1, -2]), ["a", "b"]])
def test_bad_tokens_are_rejected(bad) -> None:
    p = RepriseProposer()
    with pytest.raises((TypeError, ValueError)):
        p.begin("t", "s", bad)
    s = p.begin("t", "s", ids(1, 2))
    with pytest.raises((TypeError, ValueError)):
        s.commit(Verified(bad))


def test_past_prompts_source_indexes_each_session_once_and_survives_snapshots() -> None:
    config = dataclasses.replace(DraftingConfig(), use_prompts=True)
    p = RepriseProposer(config)
    conversation = ids(1, 2, 3, 4, 5, 6)
    run_request(p, "t", "s", conversation, ids(7, 8))
    run_request(p, "t", "s", np.concatenate([conversation, ids(7, 8, 9, 10)]), ids(11))
    h = p.history("t")
    assert h.prompts.num_tokens == 10  # the second prompt added only its 4 new tokens
    s = p.begin("t", "other", ids(40, 3, 4))
    assert decode_walk(s.propose(8), [5, 6]) == 2  # another session's prompt drafts
    q = RepriseProposer(config)
    q.restore("t", p.snapshot("t"))
    assert q.history("t").prompts.num_tokens == 10


def test_per_tenant_settings_apply_to_that_tenant_only() -> None:
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 500, 40).astype(np.int32)
    answer = rng.integers(0, 500, 120).astype(np.int32)
    p = RepriseProposer()
    p.set_tenant_config("small", DraftingConfig(max_draft_tokens=4, lead_in=0))
    assert p.settings("small")[0].max_draft_tokens == 4 and p.settings("other") == (p.config, p._params)
    for tenant in ("small", "other"):
        run_request(p, tenant, "trial-0", prompt, answer)
    sizes = {}
    for tenant in ("small", "other"):
        s = p.begin(tenant, "trial-1", prompt)
        s.commit(Verified.tokens(answer[:8]))
        sizes[tenant] = len(s.propose(16))
    assert sizes == {"small": 4, "other": 16}  # both copy the first trial; the cap is the tenant's
    assert p.history("small").config.lead_in == 0 and p.history("other").config.lead_in == 16
    p.set_tenant_config("small", None)
    assert p.settings("small")[0] is p.config


def test_source_names_where_the_first_node_came_from() -> None:
    p = RepriseProposer()
    answer = np.arange(100, 160, dtype=np.int32)
    run_request(p, "t", "trial-0", ids(1, 2, 3), answer)
    s = p.begin("t", "trial-1", ids(1, 2, 3))
    assert s.propose(8).source == "reprise:history"  # the first trial's answer
    s = p.begin("t", "loop", ids(5, 6, 7, 5, 6, 7, 5, 6))
    assert s.propose(8).source == "reprise:context"  # the request repeats itself
    assert p.begin("u", "new", ids(1)).propose(8).source == "reprise"  # nothing drafted
