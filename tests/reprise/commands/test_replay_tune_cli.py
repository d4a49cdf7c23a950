"""`reprise replay` and `reprise tune` on tiny self-made traces."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures.process import BrokenProcessPool

import pytest
from testkit.replay import conversation, write_trace

from reprise.cli import main
from reprise.commands import tune as tune_command
from reprise.server.tenant_config import load_drafting_config
from retrieval.config import DraftingConfig
from retrieval.registry import proposer_names

CODE = "def area(r):\n    return 3.14159 * r * r\n\nprint(area(2))\n"


@pytest.fixture
def trace(tmp_path):
    lines = []
    for i in range(3):
        lines.append(conversation(
            "acme", f"s{i}", ("system", "You write Python."), ("user", f"Write area(r), then call it. {CODE}"),
            ("assistant", CODE), ("user", "Again, with a docstring."),
            ("assistant", 'def area(r):\n    """Area."""\n    return 3.14159 * r * r\n'),
        ))
    lines.append(conversation("other", "o1", ("user", "hi"), ("assistant", "hello there")))
    return write_trace(tmp_path / "tiny.jsonl.gz", lines)


def test_replay_prints_a_table(trace, capsys):
    assert main(["replay", str(trace), "--drafter", "prompt_lookup"]) == 0
    out, err = capsys.readouterr()
    assert "drafter prompt_lookup, budget 32" in out
    for column in ("tau", "draft/step", "accept", "hit", "spec p50 us", "spec p99 us", "tokens", "steps"):
        assert column in out
    assert "tiny.jsonl.gz" in out and "k=1" in out and "k=32" in out
    assert err == ""


def test_replay_json(trace, capsys):
    assert main(["replay", str(trace), "--json", "--budget", "4", "--max-calls", "5", "--drafter", "prompt_lookup"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert err == ""
    (report,) = data["files"]
    assert data["budget"] == 4 and report["calls"] == 5
    assert len(report["acceptance_by_position"]) == 4
    assert report["tau"] == pytest.approx(report["tokens"] / report["steps"])
    for key in ("draft_tokens_per_step", "acceptance_rate", "hit_rate", "speculate_us_p50", "speculate_us_p99"):
        assert key in report


def test_replay_oracle_is_at_least_prompt_lookup(trace, capsys):
    main(["replay", str(trace), "--json", "--drafter", "prompt_lookup"])
    lookup = json.loads(capsys.readouterr().out)["files"][0]
    main(["replay", str(trace), "--json", "--drafter", "oracle"])
    oracle = json.loads(capsys.readouterr().out)["files"][0]
    assert oracle["tau"] >= lookup["tau"] and oracle["acceptance_rate"] == 1.0


def test_default_drafter_comes_from_the_registry(trace, capsys):
    main(["replay", str(trace), "--json"])
    expected = "reprise" if "reprise" in proposer_names() else "prompt_lookup"
    assert json.loads(capsys.readouterr().out)["drafter"] == expected


@pytest.fixture
def chain_shapes(monkeypatch) -> list[bool]:
    """Whether each verified draft was a chain, for every step replayed while the test runs."""
    import replay_traces.replay as replay_module

    shapes: list[bool] = []
    real = replay_module.accepted_path

    def spy(token_ids, parents, target, pos):
        shapes.append(list(parents) == list(range(-1, len(parents) - 1)))
        return real(token_ids, parents, target, pos)

    monkeypatch.setattr(replay_module, "accepted_path", spy)
    return shapes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "{missing}"], "no such trace file"),
        (["replay", "{trace}", "--drafter", "nope"], r"unknown drafter 'nope'; known: .*prompt_lookup"),
        (["replay", "{trace}", "--tokenizer", "nope"], "unknown tokenizer 'nope'"),
        (["replay", "{bad}"], r"bad\.jsonl:2: invalid JSON"),
        (["replay", "{trace}", "--headroom"], "--headroom measures chains: add --chain"),
        (["replay", "{trace}", "--chain", "--headroom", "--drafter", "oracle"], "--headroom needs a drafter's trees"),
        (["tune", "{trace}", "--tenant", "../x"], "tenant name"),
        (["tune", "{trace}", "--tenant", "acme", "--grid", "bogus=1"], "unknown drafting setting 'bogus'"),
        (["tune", "{trace}", "--tenant", "acme", "--grid", "max_draft_tokens=0"], "max_draft_tokens"),
        (["tune", "{trace}", "--tenant", "acme", "--grid", "max_draft_tokens=x"], "not a valid int"),
        (["tune", "{trace}", "--tenant", "acme", "--a", "0"], "--a must be > 0"),
        (["tune", "{trace}", "--tenant", "acme", "--trace-tenant", "nobody"], "no calls to replay"),
        (["tune", "{bad}", "--tenant", "acme", "--jobs", "2", "--grid", "levels=1,2"], r"bad\.jsonl:2: invalid JSON"),
    ],
)
def test_clean_errors(tmp_path, trace, capsys, argv, message):
    bad = write_trace(tmp_path / "bad.jsonl", [conversation("a", "s", ("user", "q"), ("assistant", "r")), "{oops"])
    argv = [a.format(missing=tmp_path / "missing.jsonl", trace=trace, bad=bad) for a in argv]
    if argv[0] == "tune":
        argv += ["--data-dir", str(tmp_path / "data"), "--max-calls", "2"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_skip_bad_lines_reports_them(tmp_path, capsys):
    good = conversation("a", "s", ("user", "say hello"), ("assistant", "hello"))
    bad = write_trace(tmp_path / "bad.jsonl", [good, "{oops", good])
    assert main(["replay", str(bad), "--skip-bad-lines", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)["files"][0]
    assert report["skipped_lines"] == 1 and report["calls"] == 2
    assert "skipped 1 bad lines" in captured.err and "bad.jsonl:2:" in captured.err


def test_tune_writes_config_and_report(tmp_path, trace, capsys):
    data_dir, out = tmp_path / "data", tmp_path / "report"
    argv = ["tune", str(trace), "--tenant", "acme", "--drafter", "prompt_lookup", "--data-dir", str(data_dir),
            "--out", str(out), "--grid", "max_draft_tokens=4,16", "--grid", "min_token_prob=0.05", "--b", "0.02"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "<- best" in text and "estimated speedup" in text
    saved = load_drafting_config("acme", data_dir)
    assert saved is not None and saved.max_draft_tokens in (4, 16) and saved.min_token_prob == 0.05
    png = (out / "tune.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    html = (out / "tune.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "data:image/png;base64," in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "<script" not in html and "<link" not in html
    result = json.loads((out / "tune.json").read_text())
    assert result["complete"] is True and len(result["settings"]) == 2
    best = max(result["settings"], key=lambda s: s["estimated_speedup"])
    assert DraftingConfig.from_dict(best["config"]) == saved
    for s in result["settings"]:
        expected = s["tau"] * 1.0 / (1.0 + 0.02 * s["draft_tokens_per_step"])
        assert s["estimated_speedup"] == pytest.approx(expected)


def test_tune_chain_ranks_settings_by_one_path_per_step(tmp_path, trace, capsys, chain_shapes):
    data_dir, out = tmp_path / "data", tmp_path / "report"
    argv = ["tune", str(trace), "--tenant", "acme", "--data-dir", str(data_dir), "--out", str(out), "--chain",
            "--grid", "max_draft_tokens=4,8", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chain"] is True
    assert chain_shapes and all(chain_shapes), "a step was sent a tree"
    for s in result["settings"]:
        assert s["tau"] > 1.0 and s["draft_tokens_per_step"] <= s["config"]["max_draft_tokens"]
    saved = json.loads((data_dir / "tenants" / "acme" / "drafting.json").read_text())
    assert saved["meta"]["chain"] is True
    assert main(["tune", str(trace), "--tenant", "acme", "--chain", "--hybrid", "--no-save"]) != 0
    assert "--hybrid tunes the own engine's neural fallback" in capsys.readouterr().err


def test_tune_json_and_no_save(tmp_path, trace, capsys):
    data_dir = tmp_path / "data"
    argv = ["tune", str(trace), "--tenant", "acme", "--drafter", "prompt_lookup", "--data-dir", str(data_dir),
            "--grid", "max_draft_tokens=8", "--no-save", "--json", "--trace-tenant", "other"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert captured.err == ""
    assert data["saved_to"] is None and load_drafting_config("acme", data_dir) is None
    assert data["settings"][0]["files"][0]["calls"] == 1  # only the "other" tenant's call
    assert (data_dir / "tenants" / "acme" / "tune" / "tune.html").is_file()


def test_tune_jobs_must_be_positive(trace, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(trace), "--tenant", "acme", "--jobs", "0"])
    assert exc.value.code == 2
    assert "--jobs: expected a positive integer, got 0" in capsys.readouterr().err


def test_tune_jobs_gives_the_same_results_as_one_process(tmp_path, trace, capsys):
    def tune(jobs: int) -> dict:
        out = tmp_path / f"jobs{jobs}"
        argv = ["tune", str(trace), "--tenant", "acme", "--data-dir", str(tmp_path / "data"), "--out", str(out),
                "--grid", "levels=1,2", "--grid", "max_draft_tokens=4,16", "--no-save", "--json",
                "--jobs", str(jobs)]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    timing = {"speculate_us_p50", "speculate_us_p99", "wall_s"}

    def figures(result: dict) -> list:
        return [({k: v for k, v in s.items() if k not in timing and k != "files"},
                 [{k: v for k, v in f.items() if k not in timing} for f in s["files"]]) for s in result["settings"]]

    one, two = tune(1), tune(2)
    assert len(two["settings"]) == 4
    assert [s["varied"] for s in two["settings"]] == [s["varied"] for s in one["settings"]]  # grid order kept
    assert figures(two) == figures(one)
    assert two["best"]["varied"] == one["best"]["varied"]
    assert json.loads((tmp_path / "jobs2" / "tune.json").read_text())["complete"] is True


def test_tune_says_when_a_worker_died(tmp_path, trace, capsys, monkeypatch):
    def dies(*args, **kwargs):
        raise BrokenProcessPool("A process in the process pool was terminated abruptly")

    monkeypatch.setattr(tune_command, "sweep", dies)
    argv = ["tune", str(trace), "--tenant", "acme", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "o"),
            "--grid", "levels=1,2", "--jobs", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "a tune worker process died" in err and "fewer than --jobs 2" in err and "Traceback" not in err


def test_progress_bar_only_on_a_terminal(trace, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["replay", str(trace), "--drafter", "prompt_lookup"]) == 0
    assert "call" in capsys.readouterr().err  # tqdm's bar: "tiny.jsonl.gz: ... call/s"
    assert main(["replay", str(trace), "--drafter", "prompt_lookup", "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_replay_chain_sends_one_path_per_step(trace, capsys, chain_shapes):
    assert main(["replay", str(trace), "--json", "--chain", "--budget", "8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chain"] is True
    (report,) = data["files"]
    assert chain_shapes and all(chain_shapes), "a step was sent a tree"
    assert report["tau"] > 1.5 and report["draft_tokens_per_step"] <= 8
    main(["replay", str(trace), "--json", "--budget", "8"])
    assert json.loads(capsys.readouterr().out)["chain"] is False


def test_replay_headroom_orders_the_first_token_oracles(trace, capsys):
    assert main(["replay", str(trace), "--json", "--chain", "--headroom", "--budget", "8"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["files"]
    h = report["headroom"]
    assert list(h) == ["chain", "best_of_2", "best_of_4", "any_root", "tree"]
    assert h["chain"] == pytest.approx(report["tau"])  # the chain sent, step by step
    assert 1.0 <= h["chain"] <= h["best_of_2"] <= h["best_of_4"] <= h["any_root"] <= h["tree"]
    main(["replay", str(trace), "--chain", "--headroom", "--budget", "8"])
    out = capsys.readouterr().out
    assert "headroom:" in out and "best_of_2" in out


def test_output_into_a_closed_pipe_ends_quietly(trace) -> None:
    import subprocess
    import sys

    reader = subprocess.Popen([sys.executable, "-m", "reprise", "replay", str(trace), "--drafter", "prompt_lookup"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout is not None
    reader.stdout.close()  # like `| head -0`: nobody reads what follows
    _, err = reader.communicate(timeout=120)
    assert b"Traceback" not in err and reader.returncode in (0, 141)
