"""Replay arithmetic on hand-made traces with scripted drafters (figures computed by hand)."""

from __future__ import annotations

import numpy as np
import pytest
from testkit.replay import CharTokenizer, ScriptedProposer, conversation, write_trace

from replay_traces.replay import accepted_path, pool_reports, replay_calls, replay_file
from replay_traces.traces import iter_calls
from retrieval.draft_tree import DraftTree
from retrieval.prompt_lookup import PromptLookupProposer

WRONG = 0  # code point 0 never occurs in the responses below


def _replay(tmp_path, responses, script, budget=3, tenant="t"):
    turns = []
    for r in responses:
        turns += [("user", "go"), ("assistant", r)]
    path = write_trace(tmp_path / "t.jsonl", [conversation(tenant, "s", *turns)])
    proposer = ScriptedProposer(responses, script)
    report = replay_calls(iter_calls(path), proposer, CharTokenizer(), budget=budget, drafter="scripted")
    return report, proposer


def test_no_draft_means_one_token_per_step(tmp_path):
    report, proposer = _replay(tmp_path, ["abcdefghij"], lambda pos, truth: DraftTree.empty())
    assert (report.tokens, report.steps, report.calls) == (10, 10, 1)
    assert report.tau == 1.0
    assert report.hit_rate == report.acceptance_rate == report.draft_tokens_per_step == 0.0
    assert report.acceptance_by_position == (0.0, 0.0, 0.0)
    assert proposer.sessions[0].committed == CharTokenizer.encode("abcdefghij").tolist()
    assert proposer.sessions[0].finished is True
    assert set(proposer.budgets) == {3}


def test_perfect_chains_accept_everything_plus_a_bonus(tmp_path):
    # 10 tokens, budget 3: steps at 0 (3+1), 4 (3+1), 8 (2: the rest, no bonus past the end) -> 3 steps.
    report, proposer = _replay(tmp_path, ["abcdefghij"], lambda pos, truth: DraftTree.chain(truth[pos:pos + 3]))
    assert report.steps == 3 and report.tau == pytest.approx(10 / 3)
    assert report.draft_tokens == 3 + 3 + 2 and report.accepted_tokens == 8
    assert report.acceptance_rate == 1.0 and report.hit_rate == 1.0
    assert report.acceptance_by_position == pytest.approx((1.0, 1.0, 2 / 3))
    assert proposer.sessions[0].committed == CharTokenizer.encode("abcdefghij").tolist()


def test_a_draft_running_past_the_response_end_stops_there(tmp_path):
    def script(pos, truth):  # always 3 nodes: the truth, padded with wrong tokens at the end
        ids = list(truth[pos:pos + 3]) + [WRONG] * 3
        return DraftTree.chain(ids[:3])

    report, _ = _replay(tmp_path, ["abcdefghij"], script)
    assert report.steps == 3 and report.tokens == 10
    assert report.draft_tokens == 9 and report.accepted_tokens == 8
    assert report.acceptance_rate == pytest.approx(8 / 9)


def test_wrong_drafts_still_commit_the_bonus_token(tmp_path):
    # Odd positions get a wrong draft of 2 tokens; even positions get one right token.
    def script(pos, truth):
        return DraftTree.chain([truth[pos]]) if pos % 2 == 0 else DraftTree.chain([WRONG, WRONG])

    report, _ = _replay(tmp_path, ["abcdef"], script)
    # pos 0: accept 1 + bonus -> 2; pos 2: same -> 4; pos 4: -> 6. Every step advances by 2.
    assert report.steps == 3 and report.tau == 2.0
    report, _ = _replay(tmp_path, ["abcdef"], lambda pos, truth: DraftTree.chain([WRONG, WRONG]))
    assert report.steps == 6 and report.tau == 1.0
    assert report.hit_rate == 1.0 and report.acceptance_rate == 0.0
    assert report.draft_tokens_per_step == 2.0
    assert report.acceptance_by_position == (0.0, 0.0, 0.0)


def test_hit_rate_and_by_position_count_only_steps_with_a_draft(tmp_path):
    # Response of 12 tokens. pos 0: draft 3 right -> 4 tokens; pos 4: empty -> 1; pos 5: draft
    # [right, wrong] -> accept 1 + bonus = 2; pos 7: empty; pos 8: 3 right -> 4 (ends at 12).
    def script(pos, truth):
        if pos in (0, 8):
            return DraftTree.chain(truth[pos:pos + 3])
        if pos == 5:
            return DraftTree.chain([truth[pos], WRONG])
        return DraftTree.empty()

    report, _ = _replay(tmp_path, ["abcdefghijkl"], script)
    assert report.steps == 5 and report.tau == pytest.approx(12 / 5)
    assert report.hit_steps == 3 and report.hit_rate == pytest.approx(3 / 5)
    assert report.draft_tokens == 8 and report.accepted_tokens == 7
    assert report.draft_tokens_per_step == pytest.approx(8 / 5)
    assert report.acceptance_by_position == pytest.approx((3 / 3, 2 / 3, 2 / 3))


def test_trees_accept_their_longest_matching_root_path(tmp_path):
    def script(pos, truth):
        t0, t1, t2 = (int(x) for x in truth[pos:pos + 3])
        # 0: wrong root; 1: right root; 2: t1 under the wrong root (must not count); 3: t1 under the
        # right root; 4: wrong under 3; 5: t2 under 3.
        return DraftTree(np.array([WRONG, t0, t1, t1, WRONG, t2], np.int32), np.array([-1, -1, 0, 1, 3, 3], np.int32),
                         np.ones(6, np.float32), 1.0, "tree")

    report, _ = _replay(tmp_path, ["abcdefgh"], script, budget=6)
    # pos 0: accept 3 + bonus -> 4; pos 4: accept 3 + bonus -> 8.
    assert report.steps == 2 and report.accepted_tokens == 6 and report.draft_tokens == 12


def test_multiple_calls_add_up_and_each_gets_its_own_session(tmp_path):
    report, proposer = _replay(tmp_path, ["abcd", "efghij"], lambda pos, truth: DraftTree.chain(truth[pos:pos + 1]))
    # Each step accepts 1 + bonus: "abcd" -> 2 steps, "efghij" -> 3 steps.
    assert report.calls == 2 and report.tokens == 10 and report.steps == 5
    assert [len(s.committed) for s in proposer.sessions] == [4, 6]
    assert report.prompt_tokens == sum(len(s.prompt) for s in proposer.sessions)


def test_a_drafter_exceeding_the_budget_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="proposed 4 nodes with a budget of 3"):
        _replay(tmp_path, ["abcdefgh"], lambda pos, truth: DraftTree.chain([WRONG] * 4))


def test_a_tree_whose_parent_does_not_precede_its_node_is_an_error(tmp_path):
    bad = DraftTree(np.array([1, 2], np.int32), np.array([1, -1], np.int32), np.ones(2, np.float32), 1.0, "bad")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: .*node 0 has parent 1"):
        _replay(tmp_path, ["abcd"], lambda pos, truth: bad)


@pytest.mark.parametrize(
    ("tokens", "parents", "target", "pos", "expected"),
    [
        ([5, 6, 7], [-1, 0, 1], [5, 6, 7, 8], 0, 3),
        ([5, 6, 9], [-1, 0, 1], [5, 6, 7, 8], 0, 2),
        ([9, 6, 7], [-1, 0, 1], [5, 6, 7, 8], 0, 0),
        ([7, 8, 1], [-1, 0, 1], [5, 6, 7, 8], 2, 2),  # the draft runs past the end of the target
        ([1, 5, 6, 6, 7], [-1, -1, 1, 0, 2], [5, 6, 7], 0, 3),
        ([5, 6, 5, 6, 7], [-1, 0, -1, 2, 3], [5, 6, 7], 0, 3),  # the second branch goes deeper
        ([], [], [5], 0, 0),
    ],
)
def test_accepted_path(tokens, parents, target, pos, expected):
    path = accepted_path(tokens, parents, target, pos)
    assert len(path) == expected
    assert [tokens[i] for i in path] == target[pos:pos + expected]
    assert all(parents[node] == (path[k - 1] if k else -1) for k, node in enumerate(path))


@pytest.mark.parametrize("parents", [[-2], [0], [-1, 1], [-1, 5]])
def test_accepted_path_rejects_bad_parents(parents):
    with pytest.raises(ValueError, match="parent"):
        accepted_path([5] * len(parents), parents, [5, 5, 5], 0)


def _brute_prompt_lookup_tau(prompt: list[int], response: list[int], min_n: int, max_n: int, k: int) -> int:
    """Steps of a replay with vLLM's n-gram rule, written the slow obvious way."""
    ctx, pos, steps = list(prompt), 0, 0
    while pos < len(response):
        draft: list[int] = []
        for n in range(max_n, min_n - 1, -1):
            if n >= len(ctx):
                continue
            suffix = ctx[-n:]
            starts = [s for s in range(len(ctx) - n) if ctx[s:s + n] == suffix]
            if starts:
                draft = ctx[starts[0] + n: starts[0] + n + k]
                break
        a = 0
        while a < len(draft) and pos + a < len(response) and draft[a] == response[pos + a]:
            a += 1
        end = min(pos + a + 1, len(response))
        ctx += response[pos:end]
        pos, steps = end, steps + 1
    return steps


def test_prompt_lookup_replay_matches_a_brute_force_simulation(tmp_path, tokenizer):
    responses = ["def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
                 "The answer is add(1, 2) = 3. def add(a, b): return a + b",
                 "ls -la /tmp && cat /tmp/a.txt && ls -la /tmp"]
    turns = []
    for r in responses:
        turns += [("user", "Write add(a, b) in Python, then print(add(1, 2)). " + r[:20]), ("assistant", r)]
    path = write_trace(tmp_path / "pl.jsonl", [conversation("t", "s", *turns)])
    report = replay_file(path, lambda: PromptLookupProposer(2, 5), tokenizer=tokenizer, budget=8)
    expected_steps = 0
    for call in iter_calls(path):
        expected_steps += _brute_prompt_lookup_tau(tokenizer.prompt_ids(call.messages).tolist(),
                                                   tokenizer.response_ids(call.response).tolist(), 2, 5, 8)
    assert report.steps == expected_steps
    assert report.tau > 1.0  # the responses repeat their prompts: some drafts must land


def test_pool_reports_sums_counters(tmp_path):
    a, _ = _replay(tmp_path, ["abcdefghij"], lambda pos, truth: DraftTree.chain(truth[pos:pos + 3]))
    b, _ = _replay(tmp_path, ["abcdef"], lambda pos, truth: DraftTree.empty())
    pooled = pool_reports([a, b])
    assert pooled.tokens == 16 and pooled.steps == 3 + 6
    assert pooled.tau == pytest.approx(16 / 9)
    assert pooled.hit_rate == pytest.approx(3 / 9)
    assert pooled.acceptance_by_position == pytest.approx(a.acceptance_by_position)
