"""The canonical replay against FORMAT.md's reference figures (first 3000 calls, 32 draft tokens).

Prompt lookup (n 2-5) checks the replay arithmetic end to end; the copy-limit oracle checks the
visibility rules. The quick files run by default, the rest with `-m slow`.
"""

from __future__ import annotations

import pytest

from replay_traces.oracle import CopyLimitOracle
from replay_traces.replay import read_calls, replay_calls, replay_file
from retrieval.registry import make_proposer

PROMPT_LOOKUP = {"tau_airline": 1.61, "react_hotpotqa": 1.74, "swe_gemini": 1.84, "arena_chat": 1.23}
COPY_LIMIT = {"tau_airline": 7.72, "react_hotpotqa": 12.31, "swe_gemini": 5.65, "arena_chat": 3.25}
QUICK = ("tau_airline", "react_hotpotqa")


def _params(names):
    return [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _params(PROMPT_LOOKUP))
def test_prompt_lookup_reproduces_the_reference(traces_dir, tokenizer, name):
    report = replay_file(traces_dir / f"{name}.jsonl.gz", lambda: make_proposer("prompt_lookup"),
                         tokenizer=tokenizer, budget=32, max_calls=3000)
    assert report.tau == pytest.approx(PROMPT_LOOKUP[name], abs=0.01)
    assert 0 < report.hit_rate < 1 and 0 < report.acceptance_rate < 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COPY_LIMIT))
def test_copy_limit_reproduces_the_reference(traces_dir, tokenizer, name):
    calls = list(read_calls(traces_dir / f"{name}.jsonl.gz", max_calls=3000))
    report = replay_calls(calls, CopyLimitOracle(calls, tokenizer, max_len=32), tokenizer, budget=32)
    assert report.tau == pytest.approx(COPY_LIMIT[name], abs=0.01)
