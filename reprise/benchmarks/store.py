"""Encrypted history store: records/s written and read, bytes stored per token, and the share of a
durable trajectory write that encryption costs (sealing vs the store write of the same bytes, measured
in the same run; target <= 5%).

Trajectories come from a trace (default tau_airline.jsonl.gz in ``replay_traces.traces.TRACES_DIR``, tokenised with
cl100k_base): one record per LLM call holding the prompt's last message and the response, the response
as text. ``--synthetic`` uses random tokens of the same lengths instead. The store lives in a temporary
directory (SQLite) or under a fresh key prefix (Redis), removed afterwards.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from privacy import StoreConfig, Trajectory, open_store
from privacy.records import KIND_TRAJECTORY, encode_trajectory
from replay_traces.tokenizer import CanonicalTokenizer
from replay_traces.traces import TRACES_DIR, iter_calls
from reprise.arguments import require_at_least

DEFAULT_TRACE = TRACES_DIR / "tau_airline.jsonl.gz"
TARGET_SHARE = 0.05


def add_arguments(parser) -> None:
    """Flags of ``reprise bench store``."""
    parser.add_argument("--backend", choices=("sqlite", "redis"), default="sqlite", help="store backend (default sqlite)")
    parser.add_argument("--records", type=int, default=2000, help="trajectories to write and read (default 2000)")
    parser.add_argument("--batch", type=int, default=64, help="records per transaction in the batched write (default 64)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file for realistic trajectories")
    parser.add_argument("--synthetic", action="store_true", help="random tokens instead of a trace")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis for --backend redis")
    parser.add_argument("--sqlite-synchronous", choices=("FULL", "NORMAL"), default="FULL",
                        help="SQLite durability: FULL survives power loss, NORMAL only kill -9 (default FULL)")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the SQLite store goes (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _trajectories(args) -> list:
    n = args.records
    if args.synthetic or not args.trace.exists():
        if not args.synthetic:
            print(f"bench store: {args.trace} not found, using synthetic tokens", file=sys.stderr)
        rng = np.random.default_rng(0)
        return [Trajectory(f"session-{i % 50}", rng.integers(0, 100_000, size=int(rng.integers(50, 800))),
                           "x" * int(rng.integers(100, 2000)), 0, float(i), float(i) + 1) for i in range(n)]

    tok = CanonicalTokenizer()
    out = []
    for call in iter_calls(args.trace, skip_bad_lines=True):
        last = call.messages[-1] if call.messages else None
        prompt = tok.message_ids(last.role, last.content) if last else np.zeros(0, np.int32)
        ids = np.concatenate([prompt, tok.encode("<|assistant|>\n"), tok.encode(call.response)])
        out.append(Trajectory(call.session, ids, call.response, len(prompt), float(call.index), float(call.index) + 1))
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"{args.trace} has only {len(out)} calls, asked for --records {n}")
    return out


def _progress(phase: str) -> None:
    if sys.stderr.isatty():
        print(f"bench store: {phase}...", file=sys.stderr)


def _stored_bytes(store, config, tenant) -> int:
    if config.backend == "sqlite":
        store.storage.shred_sync()  # fold the WAL in, so the file size is the data
        return sum(f.stat().st_size for f in store.storage.files())
    storage: Any = store.storage  # RedisStorage
    keys = list(storage.r.scan_iter(match=storage._k(tenant.value, "*")))
    return sum(int(storage.r.memory_usage(k, samples=0) or 0) for k in keys)


def measure(args) -> dict[str, Any]:
    """Run the benchmark and return its figures."""
    require_at_least(args, ("records", "batch"))
    trajs = _trajectories(args)
    tokens = int(sum(len(t.token_ids) for t in trajs))
    tmp = Path(tempfile.mkdtemp(prefix="reprise-bench-store-", dir=args.data_dir))
    prefix = f"reprise-bench-{secrets.token_hex(4)}"
    if args.backend == "sqlite":
        config = StoreConfig(data_dir=tmp, sqlite_synchronous=args.sqlite_synchronous)
    else:
        config = StoreConfig(data_dir=tmp, backend="redis", redis_url=args.redis_url, redis_key_prefix=prefix)

    store = open_store(config, env={"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()})
    try:
        t_api, t_batch, t_copy = (store.create_tenant(n).id for n in ("bench-api", "bench-batch", "bench-split"))
        empty = _stored_bytes(store, config, t_api)

        _progress("durable appends, one record per commit")
        lat = np.zeros(len(trajs))
        start = time.perf_counter()
        for i, t in enumerate(trajs):
            t0 = time.perf_counter()
            store.append_trajectories(t_api, [t])
            lat[i] = time.perf_counter() - t0
        write_s = time.perf_counter() - start

        _progress(f"batched appends, {args.batch} records per commit")
        start = time.perf_counter()
        for i in range(0, len(trajs), args.batch):
            store.append_trajectories(t_batch, trajs[i:i + args.batch])
        batch_s = time.perf_counter() - start

        _progress("reading back")
        start = time.perf_counter()
        read = sum(1 for _ in store.iter_trajectories(t_api))
        read_s = time.perf_counter() - start
        assert read == len(trajs)
        stored = _stored_bytes(store, config, t_api) - (empty if config.backend == "sqlite" else 0)
        if config.backend == "sqlite":  # the file also holds the batch tenant's copy
            stored = int(stored / 2)
        sealed = sum(len(r.sealed) for r in store.storage.traj_scan(t_api.value, None, len(trajs) + 1))

        _progress("encryption share: encode, seal, then the store write of the same bytes")
        # Interleaved in blocks of 50 records, so load from elsewhere on the machine hits both alike.
        tk = store.keychain.tenant_keys(t_copy)
        encode_s = seal_s = store_s = 0.0
        shares = []
        bodies: list[bytes] = []
        for i in range(0, len(trajs), 50):
            block = trajs[i:i + 50]
            t0 = time.perf_counter()
            encoded = [encode_trajectory(t) for t in block]
            t1 = time.perf_counter()
            items = []
            for t, body in zip(block, encoded):
                rid = os.urandom(16)
                items.append((rid, tk.tag("session", t.session_id), store.keychain.seal(tk, KIND_TRAJECTORY, rid, body)))
            t2 = time.perf_counter()
            for item in items:
                store.storage.traj_append(t_copy.value, [item])
            t3 = time.perf_counter()
            encode_s, seal_s, store_s = encode_s + t1 - t0, seal_s + t2 - t1, store_s + t3 - t2
            shares.append((t2 - t1) / (t3 - t1))
            bodies += encoded
    finally:
        if config.backend == "redis":
            r = getattr(store.storage, "r")  # noqa: B009 - RedisStorage's client
            for key in list(r.scan_iter(match=f"{prefix}:*", count=1000)):
                r.unlink(key)
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)

    n = len(trajs)
    plain = sum(len(b) for b in bodies)
    return {
        "backend": args.backend,
        "sqlite_synchronous": args.sqlite_synchronous if args.backend == "sqlite" else None,
        "redis_key_prefix": prefix if args.backend == "redis" else None,  # removed after the run
        "source": "synthetic" if args.synthetic or not args.trace.exists() else str(args.trace),
        "records": n,
        "tokens": tokens,
        "write_records_per_s": n / write_s,
        "write_tokens_per_s": tokens / write_s,
        "write_ms_p50": float(np.percentile(lat, 50) * 1e3),
        "write_ms_p99": float(np.percentile(lat, 99) * 1e3),
        "batch_size": args.batch,
        "batch_write_records_per_s": n / batch_s,
        "read_records_per_s": n / read_s,
        "read_tokens_per_s": tokens / read_s,
        "plaintext_bytes_per_token": plain / tokens,
        "sealed_bytes_per_token": sealed / tokens,
        "stored_bytes_per_token": stored / tokens,
        "encode_us_per_record": encode_s / n * 1e6,
        "seal_us_per_record": seal_s / n * 1e6,
        "store_write_us_per_record": store_s / n * 1e6,
        "encryption_share": seal_s / (seal_s + store_s),
        "encryption_share_median_block": float(np.median(shares)),
        "encode_and_seal_share": (encode_s + seal_s) / (encode_s + seal_s + store_s),
        "target_encryption_share": TARGET_SHARE,
    }


def run(args) -> int:
    """Print the figures (a table, or JSON with --json)."""
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    for key, value in figures.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    share = figures["encryption_share"]
    verdict = "meets" if share <= TARGET_SHARE else "misses"
    print(f"encryption is {share:.2%} of a durable trajectory write: {verdict} the {TARGET_SHARE:.0%} target")
    return 0
