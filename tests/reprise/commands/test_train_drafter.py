"""`reprise train-drafter` and `reprise bench neural` end to end on a tiny model and a tiny trace."""

from __future__ import annotations

import gzip
import json

import pytest

from neural_drafters.checkpoint import load_head, read_checkpoint_info
from reprise.cli import main
from reprise.offline.tiny import byte_level_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(seed=11).save_pretrained(str(folder))
    byte_level_tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "agent.jsonl.gz"
    lines = []
    for task in range(3):
        for trial in range(3):
            lines.append({"tenant": "acme", "session": f"task{task}-trial{trial}", "messages": [
                {"role": "system", "content": "You book flights."},
                {"role": "user", "content": f"Book flight {task} for user u{trial}"},
                {"role": "assistant", "content": f"Looking up user u{trial} for flight {task}."},
                {"role": "tool", "content": "{'user': 'found'}"},
                {"role": "assistant", "content": f"Booked flight {task}: confirmation ABC{trial}{task}."},
            ]})
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_train_resume_and_bench(tiny_folder, trace, tmp_path, capsys) -> None:
    out = tmp_path / "head"
    base = ["train-drafter", "--model", str(tiny_folder), "--traces", str(trace), "--out", str(out),
            "--seq-len", "32", "--max-tokens", "4000", "--save-every", "2", "--json"]
    assert main([*base, "--steps", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "eagle" and summary["train_assistant_tokens"] > 0
    assert 0.0 <= summary["held_out"]["agreement"][0] <= 1.0
    assert read_checkpoint_info(out)["step"] == 3
    assert (out / "features.pt").is_file()
    assert main([*base, "--steps", "5", "--resume"]) == 0
    capsys.readouterr()
    head, info = load_head(out)
    assert info["step"] == 5 and head.config.target == str(tiny_folder)
    sessions = tmp_path / "sessions.txt"
    assert main(["bench", "neural", "--model", str(tiny_folder), "--trace", str(trace), "--print-sessions",
                 "--calls", "3"]) == 0
    sessions.write_text(capsys.readouterr().out)
    assert sessions.read_text().split() == ["task0-trial0", "task0-trial1", "task0-trial2"]
    assert main(["bench", "neural", "--model", str(tiny_folder), "--trace", str(trace), "--checkpoint", str(out),
                 "--calls", "3", "--max-new-tokens", "12", "--prompt-tokens", "64", "--thresholds", "1,4",
                 "--no-cache", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    row = report["traces"]["agent.jsonl.gz"]
    assert set(row["replay"]) == {"retrieval", "neural", "reuse", "hybrid"}
    assert row["hybrid_threshold"] in (1.0, 4.0)
    for method, figures in row["end_to_end"].items():
        assert figures["identical"] == "3/3", method  # every drafter reproduces plain greedy decoding
    assert all(r["tau"] >= 1.0 for r in row["replay"].values())


def test_mtp_kind_and_bad_input(tiny_folder, trace, tmp_path, capsys) -> None:
    out = tmp_path / "mtp"
    assert main(["train-drafter", "--kind", "mtp", "--mtp-style", "sequential", "--num-heads", "2", "--model",
                 str(tiny_folder), "--traces", str(trace), "--out", str(out), "--steps", "2", "--seq-len", "16",
                 "--max-tokens", "2000"]) == 0
    assert "held-out agreement" in capsys.readouterr().out
    head, _ = load_head(out)
    assert head.config.kind == "mtp" and head.config.num_heads == 2
    assert main(["train-drafter", "--traces", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "trace file not found" in capsys.readouterr().err
    assert main(["train-drafter", "--traces", str(trace), "--held-out", "1.5"]) == 2
    assert "--held-out must be in [0, 1)" in capsys.readouterr().err
    assert main(["train-drafter", "--model", str(tiny_folder), "--traces", str(trace), "--out",
                 str(tmp_path / "fresh"), "--resume"]) == 2
    assert "no cached features" in capsys.readouterr().err
    assert main(["bench", "neural", "--model", str(tiny_folder), "--trace", str(trace), "--checkpoint",
                 str(tmp_path / "nothing"), "--calls", "1"]) == 2
    assert "train one with `reprise train-drafter`" in capsys.readouterr().err


def test_tune_hybrid_saves_the_tenants_threshold(tiny_folder, trace, tmp_path, capsys) -> None:
    head = tmp_path / "head"
    assert main(["train-drafter", "--model", str(tiny_folder), "--traces", str(trace), "--out", str(head),
                 "--seq-len", "32", "--max-tokens", "2000", "--steps", "2", "--json"]) == 0
    capsys.readouterr()
    data = tmp_path / "data"
    base = ["tune", str(trace), "--tenant", "acme", "--data-dir", str(data), "--grid", "levels=1,2", "--hybrid",
            "--model", str(tiny_folder), "--hybrid-calls", "3", "--hybrid-prompt-tokens", "64",
            "--hybrid-max-new-tokens", "12"]
    assert main([*base, "--checkpoint", str(head), "--thresholds", "1,inf", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    sweep = payload["hybrid"]["sweep"]
    assert set(sweep) == {"1", "inf"} and payload["hybrid"]["calls"] == 3
    best = max(sweep.values(), key=lambda r: r["estimated_speedup"])
    saved = json.loads((data / "tenants" / "acme" / "drafting.json").read_text())["drafting"]
    assert sweep["1" if saved["hybrid_threshold"] == 1.0 else "inf"]["estimated_speedup"] == best["estimated_speedup"]
    assert saved["levels"] == payload["best"]["config"]["levels"]  # the retrieval sweep's best, with the threshold
    # Bad input fails before the sweep, naming what is wrong.
    assert main([*base, "--checkpoint", str(tmp_path / "none")]) == 2
    assert "train one with `reprise train-drafter`" in capsys.readouterr().err
    assert main([*base, "--checkpoint", str(head), "--thresholds", "-1"]) == 2
    assert "thresholds must be numbers >= 0" in capsys.readouterr().err
