"""`reprise bench verify` on a tiny model: the CLI path, the call selection, the end-to-end loop."""

from __future__ import annotations

import argparse
import json

import pytest

from reprise.benchmarks import verify as bench
from reprise.cli import main
from verifier.models import LoadedModel
from verifier.testing import tiny_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_cost_cli_on_a_tiny_model(tmp_path, capsys, dtype) -> None:
    tiny_model("llama", vocab_size=128, seed=9).save_pretrained(tmp_path / "m")
    out = tmp_path / "figures.json"
    code = main(["bench", "verify", "--model", str(tmp_path / "m"), "--skip-e2e", "--reps", "1", "--json", "--out",
                 str(out), "--dtype", dtype])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["dtype"] == dtype
    row = printed["step_cost"]["1500"]
    assert set(row["ms"]) == {"0", "1", "2", "4", "8", "16", "32", "64"}
    assert row["ratio_to_plain_step"]["0"] == 1.0 and row["a_ms"] > 0


def test_bad_arguments_are_cli_errors(capsys) -> None:
    assert main(["bench", "verify", "--calls", "0"]) == 2
    assert "--calls must be >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "verify", "--trace", "/nonexistent.jsonl"]) == 2
    assert "trace file not found: /nonexistent.jsonl" in capsys.readouterr().err


class StubTokenizer:
    """Characters to small token ids (a unit-test stand-in for a chat tokenizer)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return {"input_ids": [3 + ord(c) % 120 for c in text]}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + int(t) % 26) for t in ids)


def test_end_to_end_loop_on_a_tiny_trace(tmp_path) -> None:
    lines = []
    for trial in range(2):  # file order as in the real traces: every task's trial 0, then trial 1
        for task in range(2):
            msgs = [{"role": "user", "content": f"task {task} please"}, {"role": "assistant", "content": "ok " * 5}]
            msgs += [{"role": "user", "content": "again"}, {"role": "assistant", "content": "done"}]
            lines.append({"tenant": "t", "session": f"task{task}-trial{trial}", "messages": msgs})
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    args = argparse.Namespace(calls=4, trials=2, call_index=1, prompt_tokens=40, max_new_tokens=6, proposer="prompt_lookup")
    lm = LoadedModel(tiny_model("llama", vocab_size=128, seed=10), StubTokenizer(), "tiny")
    calls = bench.select_calls(trace, lm.tokenizer, args)
    assert [c.session for c, _ in calls] == ["task0-trial0", "task1-trial0", "task0-trial1", "task1-trial1"]
    assert [c.message_index for c, _ in calls] == [3, 3, 3, 3]  # call 1 of each trial
    assert all(len(ids) == 40 for _, ids in calls)
    report: dict = {"end_to_end": {}}
    saves = []
    bench.run_end_to_end(lm, [trace], args, report, lambda: saves.append(1))
    row = report["end_to_end"]["traces"]["tiny.jsonl"]
    assert len(saves) == 4 and row["calls"] == 4
    assert row["identical"]["reprise_prompt_lookup"] == "4/4" and row["identical"]["reprise_no_drafts"] == "4/4"
    assert row["methods"]["transformers_plain"]["speedup"] == 1.0
    assert "tokens_per_step" in row["methods"]["reprise_prompt_lookup"]
    text = bench.format_report({"model": "tiny", "threads": 1, "device": "cpu", **report})
    assert all(f"  {method} " in text for method in row["methods"]) and "proposer: prompt_lookup" in text


@pytest.mark.slow
def test_quick_bench_on_smollm2(capsys) -> None:
    assert main(["bench", "verify", "--quick", "--skip-e2e", "--json"]) == 0
    assert "step_cost" in json.loads(capsys.readouterr().out)
