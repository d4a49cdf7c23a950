"""On real agent traces (``replay_traces.traces.TRACES_DIR``; skipped when absent): the full proposer
beats the SuffixDecoding anchor run on the same index with the same replay, and drafts fast enough to matter."""

from __future__ import annotations

import pytest

from replay_traces.replay import replay_file
from replay_traces.tokenizer import CanonicalTokenizer
from retrieval.registry import make_proposer


@pytest.fixture(scope="module")
def tokenizer() -> CanonicalTokenizer:
    return CanonicalTokenizer()


@pytest.mark.parametrize("trace", ["tau_airline", "react_hotpotqa"])
def test_reprise_beats_the_suffixdecoding_anchor(traces_dir, tokenizer, trace: str) -> None:
    path = traces_dir / f"{trace}.jsonl.gz"
    ours = replay_file(path, lambda: make_proposer("reprise"), tokenizer=tokenizer, budget=32, max_calls=300)
    anchor = replay_file(path, lambda: make_proposer("suffixdecoding"), tokenizer=tokenizer, budget=32,
                         max_calls=300)
    assert ours.tokens == anchor.tokens > 0
    assert ours.tau > 1.1 * anchor.tau  # measured 1.2-1.5x on the first 3000 calls; see README
    assert ours.draft_tokens_per_step <= 32
