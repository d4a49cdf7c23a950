"""Native suffix index: insert speed, bytes per token, speculate latency from Python.

Indexes the responses of the first N calls of a trace (tokenised canonically: response tokens =
cl100k_base encode(content), docs/replay.md), one sequence per response, then times
speculate() calls through the Python facade on contexts drawn from the responses (a prefix of a
random response, cut at a random point). Prints insert_tokens_per_s, bytes_per_token (memory_bytes()
per token) and rss_bytes_per_token (process RSS growth per token), speculate_us_p50/p99 and
tokens_indexed; --json prints one JSON object instead.

Timings are wall clock on whatever else the machine is running; the *_cpu_* figures use this thread's
CPU time and are steadier on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

from replay_traces.tokenizer import CanonicalTokenizer
from replay_traces.traces import TRACES_DIR, iter_calls
from reprise.arguments import CliError, positive_int

DEFAULT_TRACE = TRACES_DIR / "swe_gemini.jsonl.gz"


def _key_lengths(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers or 'none', got {text!r}"
        ) from None


def add_arguments(parser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (default: %(default)s)")
    parser.add_argument(
        "--max-calls", type=positive_int, default=3000, help="index the first N calls (default: %(default)s)"
    )
    parser.add_argument(
        "--depth", type=positive_int, default=64, help="suffix trie max_depth (default: %(default)s)"
    )
    parser.add_argument(
        "--key-lengths",
        type=_key_lengths,
        default=None,
        help="exact-key lengths, comma-separated, or 'none' (default: the index's, 4,8,16 below --depth)",
    )
    parser.add_argument(
        "--queries", type=positive_int, default=20000, help="speculate calls to time (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=32, help="draft budget per call (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for the query contexts (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: peak RSS is the best available
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _load_responses(trace: Path, max_calls: int, progress: bool) -> list:
    tokenizer = CanonicalTokenizer()
    out = []
    for call in iter_calls(trace):
        ids = tokenizer.response_ids(call.response)
        if len(ids):
            out.append(np.ascontiguousarray(ids, dtype=np.int32))
        if progress and len(out) % 500 == 0:
            print(f"\rtokenising responses: {len(out)}/{max_calls}", end="", file=sys.stderr, flush=True)
        if len(out) >= max_calls:
            break
    if progress:
        print(file=sys.stderr)
    return out


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:  # microseconds

    a = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run(args) -> int:
    from suffix_index import SuffixIndex

    if not args.trace.is_file():
        raise CliError(f"trace file not found: {args.trace}")
    try:
        index = SuffixIndex(max_depth=args.depth, key_lengths=args.key_lengths)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    progress = sys.stderr.isatty()  # progress lines only for a person watching
    responses = _load_responses(args.trace, args.max_calls, progress=progress)
    if not responses:
        raise CliError(f"no non-empty responses in {args.trace}")
    tokens = int(sum(len(r) for r in responses))

    rss_before = _rss_bytes()
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for i, ids in enumerate(responses):
        index.add(i, ids)
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    rss_growth = _rss_bytes() - rss_before
    if progress:
        print(f"indexed {tokens} tokens in {wall:.2f} s", file=sys.stderr)

    rng = np.random.default_rng(args.seed)
    picks = rng.integers(0, len(responses), size=args.queries)
    contexts = []
    for r in picks:
        seq = responses[int(r)]
        contexts.append(seq[: int(rng.integers(1, len(seq) + 1))])

    def time_calls(fn) -> tuple[list[int], float, float]:
        samples, drafted, cpu_start = [], 0, time.thread_time()
        clock = time.perf_counter_ns
        for ctx in contexts:
            t0 = clock()
            draft = fn(ctx)
            samples.append(clock() - t0)
            drafted += len(draft.token_ids)
        return samples, drafted / len(contexts), (time.thread_time() - cpu_start) / len(contexts) * 1e6

    for ctx in contexts[:200]:  # warm caches and the allocator
        index.speculate(ctx, args.max_tokens)
    path_ns, path_len, path_cpu = time_calls(lambda c: index.speculate(c, args.max_tokens))
    tree_ns, tree_len, tree_cpu = time_calls(lambda c: index.speculate(c, args.max_tokens, use_tree=True))
    exact = time_calls(lambda c: index.speculate_exact(c, args.max_tokens)) if index.key_lengths else None
    result = {
        "trace": str(args.trace),
        "calls": len(responses),
        "tokens_indexed": tokens,
        "max_depth": args.depth,
        "key_lengths": list(index.key_lengths),
        "insert_tokens_per_s": round(tokens / wall),
        "insert_tokens_per_cpu_s": round(tokens / cpu) if cpu > 0 else None,
        "bytes_per_token": round(index.memory_bytes() / tokens, 2),
        "rss_bytes_per_token": round(rss_growth / tokens, 2),
    }
    p50, p99 = _percentiles(path_ns)
    tp50, tp99 = _percentiles(tree_ns)
    ep50, ep99 = _percentiles(exact[0]) if exact else (None, None)
    result.update(
        {
            "speculate_us_p50": round(p50, 2),
            "speculate_us_p99": round(p99, 2),
            "speculate_cpu_us_mean": round(path_cpu, 2),
            "speculate_mean_draft_tokens": round(path_len, 2),
            "tree_speculate_us_p50": round(tp50, 2),
            "tree_speculate_us_p99": round(tp99, 2),
            "tree_speculate_cpu_us_mean": round(tree_cpu, 2),
            "tree_mean_draft_tokens": round(tree_len, 2),
            "exact_speculate_us_p50": None if ep50 is None else round(ep50, 2),  # null: no exact keys
            "exact_speculate_us_p99": None if ep99 is None else round(ep99, 2),
            "exact_mean_draft_tokens": None if exact is None else round(exact[1], 2),
            "queries": args.queries,
            "max_tokens": args.max_tokens,
        }
    )
    if args.json:
        print(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        for k, v in result.items():
            print(f"{k:<{width}}  {v}")
    return 0
