"""`reprise bench cluster`: the cold-start measurement on its own (fast), and the whole benchmark on two
tiny replicas with small sizes (slow: it starts replica processes)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from testkit.cluster import RedisServer, master_env, require_redis_server

from reprise.benchmarks import cluster as bench


def test_cold_start_loads_snapshot_plus_tail_into_the_same_index_as_a_rebuild(tmp_path) -> None:
    require_redis_server()
    redis = RedisServer(tmp_path / "redis", appendfsync=None).start()
    try:
        args = argparse.Namespace(cold_start_tokens=20_000, cold_start_tail=7)
        c = bench._cold_start(args, redis.url, master_env(), tmp_path)
    finally:
        redis.stop()
    assert c["same_index"] and c["indexed_tokens"] >= 20_000 and c["tail_trajectories"] == 7
    assert c["stored_tokens"] > 5 * c["indexed_tokens"]  # long prompts are stored, their lead-in indexed
    assert 0 < c["snapshot_bytes"] < 8 * c["indexed_tokens"]
    assert c["snapshot_plus_tail_s"] > 0 and c["full_rebuild_s"] > 0


def test_bad_arguments_are_refused_naming_the_value() -> None:
    out = subprocess.run([sys.executable, "-m", "reprise", "bench", "cluster", "--replicas", "0"],
                         capture_output=True, text=True, check=False)
    assert out.returncode != 0 and "--replicas must be >= 1, got 0" in out.stderr


@pytest.mark.slow
def test_the_whole_benchmark_on_two_tiny_replicas() -> None:
    require_redis_server()
    out = subprocess.run([sys.executable, "-m", "reprise", "bench", "cluster", "--replicas", "2", "--requests", "8",
                          "--tenants", "4", "--concurrency", "4", "--max-new-tokens", "8",
                          "--propagation-samples", "10", "--cold-start-tokens", "5000", "--cold-start-tail", "5",
                          "--json"], capture_output=True, text=True, check=False, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert [x["replicas"] for x in r["rounds"]] == [1, 2]
    assert all(x["errors"]["count"] == 0 and x["tokens"] == 8 * 8 for x in r["rounds"])
    assert r["propagation"]["idle"]["from_ack_s"]["samples"] == 10
    assert r["target"]["met"] and r["cold_start"]["same_index"]
