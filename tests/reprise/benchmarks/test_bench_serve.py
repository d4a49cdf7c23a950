"""`reprise bench serve`: its figures are computed and consistent (a tiny model, a few requests)."""

from __future__ import annotations

import json

from reprise.cli import main


def test_bench_serve_reports_consistent_figures(capsys, monkeypatch) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    code = main(["bench", "serve", "--tiny", "--requests", "6", "--concurrency", "3", "--tenants", "2",
                 "--max-new-tokens", "8", "--max-prompt-tokens", "96", "--num-slots", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["errors"] == {"count": 0, "by_code": {}}
    assert 6 <= out["tokens"] <= 6 * 8 and out["throughput_tokens_per_s"] > 0
    assert out["ttft_s"]["p50"] <= out["ttft_s"]["p99"] <= out["e2e_s"]["p99"]
    e = out["engine"]
    assert e["verify_steps"] > 0 and 0 < e["model_s"] <= out["wall_s"] * 1.05
    assert e["overhead_share"] == out["wall_s"] / e["model_s"] - 1
    assert 0 < e["model_cpu_s"] <= e["service_cpu_s"] and e["overhead_cpu_share"] >= 0
    assert out["drafting"]["draft_tokens"] >= out["drafting"]["accepted_tokens"] >= 0


def test_bench_serve_measures_what_durable_replies_cost(capsys, monkeypatch) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    code = main(["bench", "serve", "--tiny", "--requests", "6", "--concurrency", "3", "--tenants", "2",
                 "--max-new-tokens", "8", "--max-prompt-tokens", "96", "--num-slots", "2", "--durability-cost",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["errors"] == 0
    assert [r["store_before_reply"] for r in out["runs"]] == [False, True, True, False]
    assert [r["store_wait"]["replies"] for r in out["runs"]] == [0, 6, 6, 0]  # only waiting replies are timed
    assert 0 < out["store_wait_mean_ms"] < 30_000 and 0 < out["durability_cost"] < 1
    assert out["throughput_tokens_per_s"]["store_before_reply"] > 0 and out["throughput_cost"] is not None
