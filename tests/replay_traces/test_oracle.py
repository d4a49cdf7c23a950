"""The copy-limit oracle against a brute-force statement of FORMAT.md's definition."""

from __future__ import annotations

import random

import pytest
from testkit.replay import CharTokenizer, conversation, write_trace

from replay_traces.oracle import CopyLimitOracle, copy_limits
from replay_traces.replay import replay_calls
from replay_traces.traces import iter_calls


def _occurs(needle: list[int], haystack: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def brute_force_limits(calls, tok, max_len):
    """limits[k][p]: longest m <= max_len with response[p:p+m] inside an earlier request (prompt +
    response) of the same tenant or inside this prompt + response[:p]."""
    out = []
    for k, call in enumerate(calls):
        history = [tok.prompt_ids(c.messages).tolist() + tok.response_ids(c.response).tolist()
                   for c in calls[:k] if c.tenant == call.tenant]
        prompt = tok.prompt_ids(call.messages).tolist()
        response = tok.response_ids(call.response).tolist()
        row = []
        for p in range(len(response)):
            visible = [*history, prompt + response[:p]]
            m = 0
            while m < max_len and p + m < len(response) and any(_occurs(response[p:p + m + 1], s) for s in visible):
                m += 1
            row.append(m)
        out.append(row)
    return out


def _random_trace(rng: random.Random, path, repeats: bool = False):
    words = ["ab", "ba", "abc", "cab", "x", "yy", "ls", "cd"]
    pool = ["".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(4)]

    def text():
        if repeats and rng.random() < 0.6:  # agents resend the same messages: exercise the dedup
            return rng.choice(pool)
        return "".join(rng.choice(words) for _ in range(rng.randint(1, 6)))

    lines = []
    for i in range(rng.randint(1, 4)):
        turns = [("system", "sys " + text())] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            turns += [(rng.choice(["user", "tool"]), text()), ("assistant", text() if rng.random() < 0.9 else "")]
        obj = conversation(rng.choice(["t1", "t2"]), f"s{i}", *turns)
        assistant = [j for j, (r, _) in enumerate(turns) if r == "assistant"]
        if rng.random() < 0.3:
            obj["calls"] = sorted(rng.sample(assistant, rng.randint(1, len(assistant))))
        lines.append(obj)
    return write_trace(path, lines)


@pytest.mark.parametrize("repeats", [False, True])
@pytest.mark.parametrize("seed", range(25))
def test_matches_brute_force(tmp_path, seed, repeats):
    rng = random.Random(seed)
    calls = list(iter_calls(_random_trace(rng, tmp_path / "t.jsonl", repeats)))
    tok = CharTokenizer()
    max_len = rng.choice([1, 3, 6])
    got = [row.tolist() for row in copy_limits(calls, tok, max_len=max_len)]
    assert got == brute_force_limits(calls, tok, max_len)


def test_history_of_another_tenant_is_invisible(tmp_path):
    same = "the same long answer text"
    path = write_trace(tmp_path / "t.jsonl", [
        conversation("a", "s1", ("user", "q"), ("assistant", same)),
        conversation("b", "s2", ("user", "q"), ("assistant", same)),
        conversation("a", "s3", ("user", "q"), ("assistant", same)),
    ])
    calls = list(iter_calls(path))
    limits = copy_limits(calls, CharTokenizer(), max_len=32)
    assert limits[2][0] == len(same)  # tenant a saw it before
    assert limits[1][0] < 3  # tenant b never did: only short pieces of its own prompt match


def test_oracle_replay_drafts_are_always_accepted(tmp_path):
    rng = random.Random(7)
    path = _random_trace(rng, tmp_path / "t.jsonl")
    calls = list(iter_calls(path))
    tok = CharTokenizer()
    report = replay_calls(calls, CopyLimitOracle(calls, tok, max_len=4), tok, budget=4)
    if report.draft_tokens:
        assert report.acceptance_rate == 1.0
    with pytest.raises(ValueError, match="out of order"):
        oracle = CopyLimitOracle(calls, tok, max_len=4)
        oracle.begin("someone-else", "s", [1, 2, 3])


def test_repeated_messages_keep_the_windows_at_their_seams(tmp_path):
    system = "You are an agent. " * 6 + "Answer with one tool call."  # > 2 * 31 tokens: deduplicated
    copy = "tool call.\n<|user|>\nfind omega"  # spans the end of the repeated system prompt
    path = write_trace(tmp_path / "t.jsonl", [
        conversation("a", "s1", ("system", system), ("user", "find alpha"), ("assistant", "ok alpha")),
        # the seam is more than max_len tokens before the end of the prompt: only the stream holds it
        conversation("a", "s2", ("system", system), ("user", "find omega " + "z" * 40), ("assistant", copy)),
    ])
    calls = list(iter_calls(path))
    tok = CharTokenizer()
    got = [row.tolist() for row in copy_limits(calls, tok, max_len=32)]
    assert got == brute_force_limits(calls, tok, 32)
    assert got[1][0] == len(copy)  # the whole response is one copy across the seam
