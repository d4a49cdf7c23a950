"""replay_traces.headroom: what other first tokens would have won a chain, on a scripted drafter."""

from __future__ import annotations

import numpy as np
import pytest
from testkit.replay import CharTokenizer, ScriptedProposer, conversation, write_trace

from replay_traces.headroom import ChainHeadroom
from replay_traces.replay import replay_calls
from replay_traces.traces import iter_calls
from retrieval.chain import ChainProposer
from retrieval.draft_tree import DraftTree

WRONG = (1, 2, 3)  # code points that never occur in the response


def _tree(truth: np.ndarray, pos: int) -> DraftTree:
    """Four roots, by expected accepted tokens: two wrong ones, the right one (with the next token under
    it while there is one), a last wrong one."""
    nxt = int(truth[pos + 1]) if pos + 1 < len(truth) else WRONG[0]
    ids = [WRONG[0], WRONG[1], WRONG[1], int(truth[pos]), nxt, WRONG[2]]
    parents = [-1, 0, -1, -1, 3, -1]
    probs = [0.9, 0.9, 0.95, 0.5, 0.5, 0.1]  # conditional; root values 1.71, 0.95, 0.75, 0.1
    chained = [0.9, 0.81, 0.95, 0.5, 0.25, 0.1]
    return DraftTree(np.asarray(ids, np.int32), np.asarray(parents, np.int32), np.asarray(probs, np.float32),
                     float(sum(chained)), "scripted")


def test_headroom_counts_what_each_first_token_choice_would_accept(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [conversation("t", "s", ("user", "go"), ("assistant", "abcdefgh"))])
    headroom = ChainHeadroom(budget=3)
    proposer = ChainProposer(ScriptedProposer(["abcdefgh"], lambda pos, truth: _tree(truth, pos)))
    report = replay_calls(iter_calls(path), proposer, CharTokenizer(), budget=3, on_step=headroom.observe)
    # The chain always starts with the first wrong root: 8 steps of one token.
    assert (report.steps, report.tau) == (8, 1.0)
    taus = headroom.taus()
    assert taus["chain"] == taus["best_of_2"] == 1.0  # the right root is third
    # Under the right root, at each of the 8 steps (positions 0-7): 2 tokens accepted and a bonus while
    # 3 are left (positions 0-5), then what is left: 2 at position 6, 1 at position 7.
    assert taus["best_of_4"] == taus["any_root"] == taus["tree"] == pytest.approx((6 * 3 + 2 + 1) / 8)


def test_headroom_before_any_step_is_zero():
    assert set(ChainHeadroom(budget=4).taus().values()) == {0.0}


def test_turns_headroom_drafts_a_repeated_turn_from_the_history():
    from replay_traces.headroom import turns_headroom
    from retrieval.config import DraftingConfig
    from retrieval.proposer import RepriseProposer

    def chains():  # chains of 8 from trees of 16
        return ChainProposer(RepriseProposer(DraftingConfig(max_draft_tokens=16)))

    prompt, output = list(range(100, 140)), list(range(200, 260))
    once = turns_headroom(chains(), "t", [(prompt, output)], budget=8).taus()
    twice = turns_headroom(chains(), "t", [(prompt, output), (prompt, output)], budget=8).taus()
    assert once["chain"] == 1.0  # nothing to draft from: one token a step
    # The second turn repeats the first: drafted from the history, 60 tokens in far fewer steps.
    assert twice["chain"] > 1.5 and twice["chain"] <= twice["best_of_2"] <= twice["any_root"] <= twice["tree"]
