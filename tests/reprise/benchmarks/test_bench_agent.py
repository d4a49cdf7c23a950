"""`reprise bench agent` on a tiny model: session selection, the cut system prompt, the loop, the report."""

from __future__ import annotations

import argparse
import json

import pytest

from reprise.benchmarks import agent as bench
from reprise.cli import main
from verifier.models import LoadedModel
from verifier.testing import tiny_model

VOCAB = 128


class StubTokenizer:
    """Characters to small token ids, with a chat template that concatenates messages (as real ones do)."""

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 120 for c in text]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + (int(t) - 3) % 26) for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [1 + len(m["role"]) % 2] + self.encode(m["content"])
        return {"input_ids": ids + [2]}


def write_trace(tmp_path):
    lines = []
    for trial in range(3):  # file order as in the real traces: every task's trial 0, then trial 1, ...
        for task in range(3):
            msgs = [{"role": "system", "content": "policy " * 40}, {"role": "user", "content": f"task {task} please"}]
            for turn in range(4):
                msgs += [{"role": "assistant", "content": f"step {turn} of task {task}"},
                         {"role": "user", "content": f"observation {turn} " * 3}]  # fmt: skip
            lines.append({"tenant": "t", "session": f"task{task}-trial{trial}", "messages": msgs})
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    return trace


def args_for(**kw) -> argparse.Namespace:
    settings = {"tasks": 2, "trials": 2, "max_calls": 0, "max_new_tokens": 6, "system_tokens": 16, "max_len": 200,
                "proposer": "prompt_lookup", "cache_bytes": 1 << 24, "warm_sessions": False}  # fmt: skip
    return argparse.Namespace(**(settings | kw))


def test_sessions_are_whole_trials_with_a_fixed_system_head(tmp_path) -> None:
    trace = write_trace(tmp_path)
    sessions = bench.load_sessions(trace, StubTokenizer(), args_for())
    assert [s.name for s in sessions] == ["task0-trial0", "task1-trial0", "task0-trial1", "task1-trial1"]
    for s in sessions:
        assert all(later[: len(earlier)] == earlier for earlier, later in zip(s.prompts, s.prompts[1:]))
        assert s.prompts[0][:17] == s.prompts[-1][:17]  # role marker + the 16-token system head
        assert all(len(p) + 6 <= 200 for p in s.prompts)
    capped = bench.load_sessions(trace, StubTokenizer(), args_for(max_calls=2, max_len=110))
    assert all(len(s.prompts) <= 2 for s in capped) and all(len(p) + 6 <= 110 for s in capped for p in s.prompts)


def test_the_loop_reports_every_method(tmp_path) -> None:
    trace = write_trace(tmp_path)
    lm = LoadedModel(tiny_model("llama", vocab_size=VOCAB, seed=10), StubTokenizer(), "tiny")
    report: dict = {"model": "tiny", "threads": 1, "device": "cpu", "max_new_tokens": 6, "traces": {}}
    saves = []
    bench.run_sessions(lm, [trace], args_for(), report, lambda: saves.append(1))
    row = report["traces"]["tiny.jsonl"]
    num_calls = sum(len(s.prompts) for s in bench.load_sessions(trace, StubTokenizer(), args_for()))
    assert row["sessions"] == 4 and row["calls"] == len(saves) == num_calls >= 8
    assert row["outputs_identical"] is True
    assert set(row["methods"]) == set(bench.METHODS)
    assert row["methods"]["engine"]["cache_hit_rate"] == 0.0
    assert row["methods"]["engine_cache"]["cache_hit_rate"] > 0.3 and row["cache_hit_rate"] > 0.3
    assert row["methods"]["generate"]["speedup_cpu"] == 1.0
    assert row["ttft_ratio_later_calls"] is not None and "step_cost_model" in report
    assert report["forward"] == "lean" and report["plain_step_cost"]["points"][0]["extra_rows"] == 0
    drafts = row["methods"]["engine_cache_drafts"]
    assert drafts["outputs_identical_to_engine_plain"] == f"{num_calls}/{num_calls}"
    check = row["savings_check"]  # the service's estimate, fed by the drafted run, against the measured speedup
    assert check["speedup_estimated"] > 0 and check["speedup_measured"] > 0 and check["clock"] == "thread_cpu"
    assert check["error"] == pytest.approx(check["speedup_estimated"] / check["speedup_measured"] - 1, abs=2e-3)
    assert check["seconds_saved_cache"] > 0  # later calls of a session found their prefix cached
    text = bench.format_report(report | {"proposer": "prompt_lookup"})
    assert all(f"  {m} " in text for m in bench.METHODS) and "fitted step cost" in text
    assert "savings estimate: speedup" in text
    assert "plain step:" in text and "tree step cost, ms by draft rows" in text


def test_top2_margin_is_the_gap_of_the_next_token_logits() -> None:
    from verifier.runner import ModelRunner
    from verifier.testing import full_logits

    model = tiny_model("llama", vocab_size=VOCAB, seed=11)
    runner = ModelRunner(model, max_len=64)
    ids = [5, 9, 13, 2, 7]
    top = full_logits(model, ids)[-1].topk(2).values
    assert abs(bench._top2_margin(runner, ids) - float(top[0] - top[1])) < 1e-3
    assert runner.num_free_slots == 1  # the slot it took is back
    assert bench._top2_margin(runner, list(range(64))) is None


def test_bad_arguments_are_cli_errors(capsys) -> None:
    assert main(["bench", "agent", "--tasks", "0"]) == 2
    assert "--tasks must be >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "agent", "--trace", "/nonexistent.jsonl"]) == 2
    assert "trace file not found: /nonexistent.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_bench_on_smollm2(capsys) -> None:
    assert main(["bench", "agent", "--quick", "--tasks", "1", "--trials", "1", "--max-calls", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert all(row["outputs_identical"] for row in report["traces"].values())
