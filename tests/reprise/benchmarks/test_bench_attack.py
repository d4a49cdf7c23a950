"""`reprise bench attack` end to end on the tiny model, two short attacks: its JSON has the figures the
docs quote, and the server survived them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_attack_json() -> None:
    out = subprocess.run([sys.executable, "-m", "reprise", "bench", "attack", "--tiny", "--only",
                          "idle_streams,huge_chats,half_open_grpc,crafted_export,smuggling", "--probe-seconds", "1",
                          "--json"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert [r["attack"] for r in report["attacks"]] == ["baseline", "idle_streams", "huge_chats", "half_open_grpc",
                                                         "crafted_export", "smuggling"]
    for r in report["attacks"]:
        assert r["server_alive"] and r["after"] == "all served"
        assert r["healthz"]["samples"] >= 1 and r["admin_call"]["samples"] >= 1
        assert r["peak_rss_mb"] >= r["rss_before_mb"]
    streams = report["attacks"][1]["outcome"]
    assert streams["held"] <= 64 and streams["refused"]["RESOURCE_EXHAUSTED"] == 400 - streams["held"]
    assert report["attacks"][2]["outcome"]["answers"] == {"HTTP 400 param=messages": 3, "gRPC INVALID_ARGUMENT": 3}
    assert report["attacks"][3]["outcome"]["ended"] == {"UNAUTHENTICATED": 450}
    assert report["attacks"][4]["outcome"]["answer"].startswith("DATA_LOSS: export file asks for scrypt log2 n 20")
    assert list(report["attacks"][5]["outcome"]["answers"]) == [
        "HTTP/1.1 400 Bad Request, connection closed, smuggled request not read"]
    for figures in report["keep_alive"].values():
        assert figures["fresh_p50_ms"] > 0 and figures["kept_alive_p50_ms"] > 0
    assert report["server_exit_code"] == 0 and len(report["load_average"]) == 3


@pytest.mark.slow
def test_bench_attack_fair_share_figures() -> None:
    out = subprocess.run([sys.executable, "-m", "reprise", "bench", "attack", "--tiny", "--only",
                          "slots_flood,prefix_flood", "--flood-prompts", "3", "--probe-seconds", "1", "--json"],
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    slots, prefix = (r["outcome"] for r in json.loads(out.stdout)["attacks"][1:])
    assert slots["attacker_requests_in_flight"] == 16 and slots["health_during"] == ["200 serving", "SERVING"]
    assert slots["chat_p95_ratio"] == pytest.approx(slots["chat_p95_during_s"] / slots["chat_p95_idle_s"], abs=0.02)
    assert prefix["attacker_prompts"] == 3 and prefix["cached_before"] > 0
    assert prefix["cached_after"] == prefix["cached_before"]


def test_bench_attack_refuses_an_unknown_attack() -> None:
    out = subprocess.run([sys.executable, "-m", "reprise", "bench", "attack", "--only", "nope"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "unknown attack 'nope'" in out.stdout
