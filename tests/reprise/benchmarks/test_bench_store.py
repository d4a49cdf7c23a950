"""`reprise bench store` runs on both backends and reports consistent figures (not timed: figures only)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from reprise.arguments import CliError
from reprise.benchmarks import store as bench


def _args(backend: str, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--backend", backend, "--records", "40", "--batch", "8", "--synthetic"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parser.parse_args(argv)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def test_bench_figures_are_consistent(backend, request, tmp_path) -> None:
    figures = bench.measure(_args(backend, data_dir=tmp_path))
    assert figures["records"] == 40 and figures["tokens"] > 40 * 50
    for key in ("write_records_per_s", "batch_write_records_per_s", "read_records_per_s", "seal_us_per_record",
                "store_write_us_per_record"):
        assert figures[key] > 0, key
    # Sealing adds a fixed 33 bytes per record; storage adds its own overhead on top.
    assert figures["plaintext_bytes_per_token"] < figures["sealed_bytes_per_token"] < figures["plaintext_bytes_per_token"] + 1
    assert figures["stored_bytes_per_token"] > figures["sealed_bytes_per_token"] * 0.9
    assert 0 < figures["encryption_share"] < figures["encode_and_seal_share"] < 1
    assert list(tmp_path.iterdir()) == []  # the temporary store is gone
    if backend == "redis":
        client = request.getfixturevalue("redis_client")
        assert not list(client.scan_iter(match=f"{figures['redis_key_prefix']}:*"))


def test_bench_rejects_bad_counts() -> None:
    with pytest.raises(CliError, match="--records must be >= 1, got 0"):
        bench.measure(_args("sqlite", records=0))


def test_bench_cli_prints_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "reprise", "bench", "store", "--records", "10", "--synthetic", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(out.stdout)["backend"] == "sqlite"
