"""`reprise bench engine`: its arguments and how it turns the methods' outputs into figures.

The engines themselves are exercised by tests/reprise/backends/test_vllm_engine.py (real vLLM); here
the summary is checked on outputs made up for the purpose, so the ratios and the identity verdicts are
known exactly.
"""

from __future__ import annotations

import argparse

import pytest

from reprise.arguments import CliError
from reprise.backends.vllm.attach import MAX_SPECULATIVE_TOKENS
from reprise.benchmarks import engine as bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_follow_the_service() -> None:
    args = _args()
    assert args.speculative_tokens == MAX_SPECULATIVE_TOKENS  # what `reprise serve --engine vllm` runs with
    assert (args.calls, args.trials, args.max_new_tokens, args.concurrency) == (12, 4, 128, 8)


@pytest.mark.parametrize("argv, message", [
    (["--calls", "0"], "--calls must be >= 1"),
    (["--speculative-tokens", "0"], "--speculative-tokens must be >= 1"),
    (["--methods", "vllm_reprise"], "--methods must include vllm_plain"),
    (["--methods", "vllm_plain,bogus"], "--methods must include vllm_plain"),
])
def test_bad_arguments_are_one_clear_error(argv, message) -> None:
    with pytest.raises(CliError, match=message):
        bench.run(_args(*argv))


def _result(seconds: float, outputs: list[list[int]]) -> dict:
    return {"seconds": seconds, "tokens": sum(map(len, outputs)), "outputs": outputs}


def test_summary_ratios_and_identity() -> None:
    plain = [[1, 2, 3, 4], [5, 6, 7, 8]]
    differs = [[1, 2, 3, 4], [5, 6, 9, 9]]  # the second call differs from its third token on
    outputs = {
        "vllm_plain": {"t.jsonl": {"1": _result(4.0, plain), "8": _result(1.0, plain)}},
        "vllm_ngram": {"t.jsonl": {"1": _result(2.0, plain), "8": _result(1.0, differs)}},
        "vllm_reprise": {"t.jsonl": {"1": _result(1.0, plain), "8": _result(0.5, plain)}},
        "vllm_suffix": {"unavailable": "no arctic-inference"},
    }
    traces = bench._summarise(outputs, {"t.jsonl": []}, (1, 8), "bfloat16")
    one, eight = traces["t.jsonl"]["1"], traces["t.jsonl"]["8"]
    assert one["tokens_per_s"] == {"vllm_plain": 2.0, "vllm_ngram": 4.0, "vllm_reprise": 8.0,
                                   "vllm_suffix": "unavailable"}
    assert one["reprise_vs_plain"] == 4.0 and one["reprise_vs_ngram"] == 2.0
    assert all(one["outputs_identical"].values()) and "differing_calls" not in one
    assert eight["reprise_vs_plain"] == 2.0 and eight["reprise_vs_ngram"] == 2.0
    assert eight["outputs_identical"] == {"vllm_plain": True, "vllm_ngram": False, "vllm_reprise": True}
    assert eight["differing_calls"] == {"vllm_ngram": {"calls": "1/2", "first_difference_at_token": [2]}}


def test_summary_says_what_the_proposers_steps_verified() -> None:
    plain = [[1, 2, 3, 4]]
    reprise = _result(1.0, plain)
    # (tenant, draft tokens sent, accepted, drafter): 3 steps, 6 tokens sent, 3 accepted
    reprise["steps"] = [("bench", 4, 3, "reprise"), ("bench", 0, 0, ""), ("bench", 2, 0, "reprise")]
    outputs = {"vllm_plain": {"t": {"1": _result(2.0, plain)}}, "vllm_reprise": {"t": {"1": reprise}}}
    row = bench._summarise(outputs, {"t": []}, (1,), "bfloat16")["t"]["1"]
    assert row["drafting"] == {"vllm_reprise": {"steps": 3, "tokens_per_step": 2.0, "draft_tokens_per_step": 2.0,
                                                "acceptance": 0.5}}
    report = {"eager": False, "model": "m", "dtype": "bfloat16", "vllm": "0.32.0", "max_new_tokens": 4,
              "speculative_tokens": 32, "load_before": 0.0, "load_after": 0.0, "traces": {"t": {"1": row}}}
    assert "vllm_reprise: 2.0 tokens per decoding step, 2.0 draft tokens sent per step, 0.5 accepted" in (
        bench.format_report(report))


def test_own_engine_is_compared_only_in_float32() -> None:
    plain = [[1, 2]]
    outputs = {"vllm_plain": {"t": {"1": _result(1.0, plain)}}, "reprise_engine": {"t": {"1": _result(1.0, plain)}}}
    assert bench._summarise(outputs, {"t": []}, (1,), "bfloat16")["t"]["1"]["outputs_identical"]["reprise_engine"] is None
    assert bench._summarise(outputs, {"t": []}, (1,), "float32")["t"]["1"]["outputs_identical"]["reprise_engine"] is True


def test_report_text_names_every_figure() -> None:
    plain = [[1, 2, 3, 4]]
    outputs = {"vllm_plain": {"t": {"1": _result(2.0, plain)}}, "vllm_reprise": {"t": {"1": _result(1.0, plain)}}}
    report = {"model": "m", "vllm": "0.32.0", "dtype": "bfloat16", "max_new_tokens": 4, "eager": True,
              "speculative_tokens": 32,
              "load_before": 1.0, "load_after": 2.0, "traces": bench._summarise(outputs, {"t": []}, (1,), "bfloat16")}
    text = bench.format_report(report)
    assert "vLLM 0.32.0, eager" in text and "32 speculative tokens" in text and "load average 1.00 -> 2.00" in text
    assert "vllm_reprise 4.0" in text and "reprise_vs_plain" in text


def test_headroom_replays_plain_outputs_through_the_proposer() -> None:
    class Chars:  # the bench passes a transformers tokenizer: decode([id]) and len()
        def decode(self, ids):
            return chr(ids[0])

        def __len__(self):
            return 256

    prompt, output = [ord(c) for c in "book a flight"], [ord(c) for c in "I can help you book a flight today."]
    taus = bench._headroom([prompt, prompt], [output, output], Chars(), budget=8)
    assert list(taus) == ["chain", "best_of_2", "best_of_4", "any_root", "tree"]
    assert 1.5 < taus["chain"] <= taus["any_root"] <= taus["tree"]  # the second call repeats the first
