"""`reprise bench index` on a small self-made trace: runs, prints every figure, rejects bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest


def _trace(path: Path, calls: int = 40) -> Path:
    lines = []
    for i in range(calls):
        body = f"cat src/module_{i % 5}.py\nsed -n '{i},{i + 20}p' src/module_{i % 5}.py\n" * (1 + i % 3)
        lines.append(
            json.dumps(
                {
                    "tenant": "t",
                    "session": f"s{i // 4}",
                    "messages": [
                        {"role": "user", "content": f"task {i}"},
                        {"role": "assistant", "content": body},
                    ],
                }
            )
        )
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reprise", "bench", "index", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_index_json(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl.gz")
    out = _bench("--trace", str(trace), "--max-calls", "30", "--queries", "200", "--depth", "16", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for key in (
        "insert_tokens_per_s",
        "bytes_per_token",
        "rss_bytes_per_token",
        "speculate_us_p50",
        "speculate_us_p99",
        "tokens_indexed",
        "tree_speculate_us_p50",
        "exact_speculate_us_p50",
    ):
        assert key in result, key
    assert result["calls"] == 30 and result["tokens_indexed"] > 0
    assert result["insert_tokens_per_s"] > 0 and result["bytes_per_token"] > 0
    assert 0 < result["speculate_us_p50"] <= result["speculate_us_p99"]
    assert result["speculate_mean_draft_tokens"] > 0  # repetitive trace: drafts find something


def test_bench_index_text_and_errors(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl.gz", calls=8)
    out = _bench("--trace", str(trace), "--queries", "20", "--key-lengths", "none")
    assert out.returncode == 0, out.stderr
    assert "speculate_us_p50" in out.stdout and "tokens_indexed" in out.stdout
    missing = _bench("--trace", str(tmp_path / "nope.jsonl.gz"))
    assert missing.returncode != 0 and "trace file not found" in missing.stderr
    for bad in (["--max-calls", "0"], ["--depth", "x"], ["--key-lengths", "4,a"]):
        r = _bench("--trace", str(trace), *bad)
        assert r.returncode != 0 and "error" in r.stderr, bad
    deep_keys = _bench("--trace", str(trace), "--depth", "4", "--key-lengths", "8")
    assert deep_keys.returncode != 0 and "key length" in deep_keys.stderr


@pytest.mark.slow
def test_bench_index_on_the_shared_trace(traces_dir: Path) -> None:
    out = _bench("--trace", str(traces_dir / "swe_gemini.jsonl.gz"), "--max-calls", "3000", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tokens_indexed"] == 782_600  # FORMAT.md's canonical tokenisation
