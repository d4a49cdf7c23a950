"""Replicas of `reprise serve` on one Redis: throughput and latency with 1..N replicas, how fast a turn
committed on one replica reaches another's index, and how fast a cold replica loads a big tenant.

The benchmark starts a private redis-server (AOF, ``appendfsync everysec``; or uses --redis-url with a
key prefix of its own, removed afterwards), creates --tenants tenants, starts --replicas replica
processes (the tiny random model unless --model-path or --smollm2), and then:

1. throughput: for k = 1..N, --requests unary Generate calls, --concurrency at a time, from a separate
   client process that routes each tenant to replica (tenant mod k), as a ring-hash proxy would (tenant
   affinity). Figures: tokens/s, request latency p50/p99, errors, CPU seconds of every replica and of
   the client (/proc), tokens per CPU second.
2. propagation: AppendTrajectory on one replica, then GetIndexStats polled on another until the turn is
   in its index; the delay from the append's acknowledgement (and from its call), idle and while the
   N-replica round runs.
3. cold start (in this process, no model): a tenant with --cold-start-tokens indexed tokens (agent-like
   turns: a long prompt of which the index keeps the lead-in, and the response), a sealed snapshot and
   a tail of --cold-start-tail trajectories after it; a cold replica loading snapshot + tail versus
   rebuilding from the whole stream.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from privacy import StoreConfig, TenantId, Trajectory, open_store
from reprise.arguments import CliError, require_at_least
from reprise.benchmarks.serve import SYSTEM, synthetic_conversations, tally_records
from reprise.config import ClusterConfig
from retrieval.config import DraftingConfig

TARGET_PROPAGATION_P99_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=3, help="measure with 1..N replicas (default 3)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    parser.add_argument("--requests", type=int, default=64, help="requests per round (default 64)")
    parser.add_argument("--tenants", type=int, default=12, help="tenants the requests are spread over (default 12)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--num-slots", type=int, default=8, help="requests per packed verification (default 8)")
    parser.add_argument("--model-path", default="", metavar="DIR", help="a local model folder for the replicas")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct (slow on CPU: minutes)")
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: a private redis-server)")
    parser.add_argument("--propagation-samples", type=int, default=100, help="appends timed (default 100)")
    parser.add_argument("--cold-start-tokens", type=int, default=1_000_000,
                        help="indexed tokens of the cold-start tenant (default 1000000; 0 skips it)")
    parser.add_argument("--cold-start-tail", type=int, default=255,
                        help="trajectories after its snapshot (default 255: just before the next is sealed)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _summary(values: list[float]) -> dict[str, Any]:
    return {"p50": _pct(values, 50), "p99": _pct(values, 99), "max": max(values) if values else None,
            "samples": len(values)}


# ---- the client process ------------------------------------------------------------------------------

def client_main() -> None:
    """Runs in its own process: reads the job on stdin, prints figures as JSON on stdout."""
    job = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_drive(job))))


async def _drive(job: dict[str, Any]) -> dict[str, Any]:
    from grpc_api.client import AsyncRepriseClient, RepriseError

    targets, keys = job["targets"], job["keys"]
    clients = {(r, t): AsyncRepriseClient(targets[r], keys[t], timeout=3600)
               for t in range(len(keys)) for r in range(len(targets))}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(job["requests"]):
        queue.put_nowait(i)
    records: list[dict[str, Any]] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            tenant = i % len(keys)
            client = clients[(tenant % len(targets), tenant)]  # tenant affinity
            t0 = time.perf_counter()
            try:
                done = await client.generate(text=job["prompts"][i % len(job["prompts"])],
                                             max_new_tokens=job["max_new_tokens"], session_id=f"s{i % 5}")
                records.append({"latency": time.perf_counter() - t0, "tokens": len(done.token_ids), "error": None})
            except RepriseError as exc:
                records.append({"latency": time.perf_counter() - t0, "tokens": 0, "error": exc.code.name})

    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(job["concurrency"])))
    wall = time.perf_counter() - start
    for c in clients.values():
        await c.close()
    return {"wall_s": wall, "client_cpu_s": time.process_time() - cpu0, "records": records}


def _run_client(job: dict[str, Any]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "reprise.benchmarks.cluster"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    return proc


def _client_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    if proc.wait() != 0:
        raise RuntimeError(f"the load generator failed:\n{err[-3000:]}")
    return json.loads(out)


# ---- rounds ------------------------------------------------------------------------------------------

def _prompts(n: int, seed: int = 0) -> list[str]:
    """Agent-like prompts (sent as text: the replicas' tokenizer applies): tool schema, task, past calls."""
    return [(SYSTEM[:160] + "\n" + "\n".join(m["content"] for m in chat[1:]))[:320]
            for chat in synthetic_conversations(n, seed)]


def _round(replicas: list[Any], keys: list[str], prompts: list[str], args: argparse.Namespace,
           during: Any = None) -> tuple[dict[str, Any], Any]:
    job = {"targets": [r.target for r in replicas], "keys": keys, "prompts": prompts, "requests": args.requests,
           "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens}
    cpu0 = [r.cpu_seconds() for r in replicas]
    proc = _run_client(job)
    extra = during(proc) if during is not None else None
    out = _client_result(proc)
    cpu = [r.cpu_seconds() - c for r, c in zip(replicas, cpu0)]
    ok, errors, tokens = tally_records(out["records"])
    latency = [r["latency"] for r in ok]
    service_cpu = sum(cpu)
    return {"replicas": len(replicas), "requests": len(out["records"]), "tokens": tokens, "wall_s": out["wall_s"],
            "throughput_tokens_per_s": tokens / out["wall_s"], "latency_s": _summary(latency),
            "errors": {"count": sum(errors.values()), "by_code": errors},
            "cpu_s": {"replicas": cpu, "client": out["client_cpu_s"]},
            "tokens_per_replica_cpu_s": tokens / service_cpu if service_cpu else None,
            "replica_cores_busy": service_cpu / out["wall_s"]}, extra


def _propagation(replicas: list[Any], key: str, tenant: str, admin_key: str, samples: int,
                 stop: Any = None) -> dict[str, Any]:
    """Append on replica i, poll replica i+1's index figures until the turn is there."""
    from grpc_api.client import AdminClient, RepriseClient

    data = [RepriseClient(r.target, key) for r in replicas]
    admin = [AdminClient(r.target, admin_key) for r in replicas]
    from_ack, from_call = [], []
    try:
        for c in data:  # every replica holds the probe tenant (a request loads it)
            c.generate(tokens=list(b"probe"), max_new_tokens=1, do_not_record=True)
        for i in range(samples):
            if stop is not None and stop():
                break
            src, dst = i % len(replicas), (i + 1) % len(replicas)
            before = admin[dst].index_stats(tenant)[0].index_sequences
            t0 = time.perf_counter()
            data[src].append_trajectory(f"p{i}", tokens=list(f"OBSERVATION {i}: ok".encode()))
            t1 = time.perf_counter()
            while admin[dst].index_stats(tenant)[0].index_sequences <= before:
                if time.perf_counter() - t1 > 30:
                    raise RuntimeError("a turn did not reach the other replica within 30 s")
            t2 = time.perf_counter()
            from_ack.append(t2 - t1)
            from_call.append(t2 - t0)
    finally:
        for client in data:
            client.close()
        for admin_client in admin:
            admin_client.close()
    return {"from_ack_s": _summary(from_ack), "from_call_s": _summary(from_call)}


# ---- cold start --------------------------------------------------------------------------------------

def _agent_turns(num_indexed: int, lead_in: int, seed: int = 0) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Turns whose indexed part (prompt lead-in + response) totals ``num_indexed`` tokens: 2,000-token
    prompts and 200-token responses drawn from 40 templates with 5% of tokens changed (agents repeat
    their tool calls with new arguments). Returns the turns and the stored token count."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32000, 2000).astype(np.int32) for _ in range(8)]
    answers = [rng.integers(0, 32000, 200).astype(np.int32) for _ in range(40)]
    turns: list[tuple[list[int], list[int]]] = []
    indexed = stored = 0
    while indexed < num_indexed:
        p, a = prompts[len(turns) % 8].copy(), answers[len(turns) % 40].copy()
        p[-100:] = rng.integers(0, 32000, 100)
        a[rng.integers(0, 200, 10)] = rng.integers(0, 32000, 10)
        turns.append((p.tolist(), a.tolist()))
        indexed += min(lead_in, len(p)) + len(a)
        stored += len(p) + len(a)
    return turns, stored


def _cold_start(args: argparse.Namespace, redis_url: str, env: dict[str, str], home: Path) -> dict[str, Any]:
    from privacy.changefeed import delete_keyspace
    from reprise.cluster.node import ClusterNode
    from retrieval.proposer import RepriseProposer

    prefix = f"reprise-bench-cold-{secrets.token_hex(4)}"
    config = StoreConfig(backend="redis", redis_url=redis_url, data_dir=home / "cold", redis_key_prefix=prefix)
    store = open_store(config, env=env)
    nodes: list[Any] = []

    def node(name: str) -> Any:
        n = ClusterNode(ClusterConfig(enabled=True, replica_id=name), open_store(config, env=env), RepriseProposer())
        nodes.append(n)
        return n

    try:
        tenant = store.create_tenant("big").id
        turns, stored = _agent_turns(args.cold_start_tokens, DraftingConfig().lead_in)
        tail = min(args.cold_start_tail, len(turns) - 1)
        t0 = time.perf_counter()

        def append(part: list[tuple[list[int], list[int]]]) -> None:
            for start in range(0, len(part), 64):
                store.append_trajectories(tenant, [
                    Trajectory(f"s{i % 50}", np.asarray(p + a, dtype=np.int32), "", len(p), 0.0, time.time())
                    for i, (p, a) in enumerate(part[start:start + 64], start)])

        append(turns[:len(turns) - tail])
        writer = node("writer")  # the replica that sealed the snapshot, before the tail arrived
        writer.replica.ensure(tenant.value, None, rebuild=True)
        writer.replica.seal_snapshot(tenant.value)
        writer.replica.evict(tenant.value)
        append(turns[len(turns) - tail:])
        write_s = time.perf_counter() - t0
        timings: dict[str, list[float]] = {"snapshot": [], "rebuild": []}
        stats: dict[str, Any] = {}
        for trial in range(2):
            for how in ("snapshot", "rebuild"):
                cold = node(f"cold-{how}-{trial}")
                t1 = time.perf_counter()
                assert cold.replica.ensure(tenant.value, None, rebuild=how == "rebuild")
                timings[how].append(time.perf_counter() - t1)
                stats[how] = cold.replica.proposer.index_stats(tenant.value)
                cold.replica.evict(tenant.value)
        snap = store.get_snapshot(TenantId(tenant.value), "cluster")
        s_time, r_time = min(timings["snapshot"]), min(timings["rebuild"])
        return {"indexed_tokens": stats["rebuild"].num_history_tokens, "trajectories": len(turns),
                "stored_tokens": stored, "tail_trajectories": tail, "snapshot_bytes": len(snap.data) if snap else 0,
                "index_memory_bytes": stats["rebuild"].memory_bytes,
                "same_index": stats["snapshot"].num_history_tokens == stats["rebuild"].num_history_tokens,
                "snapshot_plus_tail_s": s_time, "full_rebuild_s": r_time,
                "speedup": r_time / s_time if s_time else None, "setup_write_s": write_s}
    finally:
        for n in nodes:
            n.writer.close(5)
            n.stop()
            n.store.close()
        delete_keyspace(store)
        store.close()


# ---- the whole benchmark -----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    require_at_least(args, ("replicas", "concurrency", "requests", "tenants", "max_new_tokens", "num_slots"))
    require_at_least(args, ("propagation_samples", "cold_start_tokens", "cold_start_tail"), minimum=0)
    if args.model_path and not Path(args.model_path).is_dir():
        raise CliError(f"no such model folder: {args.model_path}")
    if not args.redis_url and not shutil.which("redis-server"):
        raise CliError("redis-server is not installed: install it, or give --redis-url")
    if args.cold_start_tokens:
        import retrieval.proposer  # noqa: F401 - fail now, not after the rounds, if the index cannot load
    with tempfile.TemporaryDirectory(prefix="reprise-bench-cluster-") as home:
        result = _bench(args, Path(home))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0 if all(r["errors"]["count"] == 0 for r in result["rounds"]) else 1


def _bench(args: argparse.Namespace, home: Path) -> dict[str, Any]:
    from privacy.changefeed import delete_keyspace
    from reprise.cluster.launch import RedisProcess, start_replicas

    env = {"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}
    redis = None if args.redis_url else RedisProcess(home / "redis", appendfsync="everysec").start()
    url = args.redis_url or redis.url  # type: ignore[union-attr]
    prefix = f"reprise-bench-{secrets.token_hex(4)}"
    config = StoreConfig(backend="redis", redis_url=url, data_dir=home / "setup", redis_key_prefix=prefix)
    store = open_store(config, env=env)
    replicas: list[Any] = []
    try:
        admin_key = store.create_admin_key().secret
        tenants = [store.create_tenant(f"bench-{i}").id for i in range(args.tenants)]
        keys = [store.create_api_key(t).secret for t in tenants]
        probe = store.create_tenant("probe").id
        probe_key = store.create_api_key(probe).secret
        # Several replicas share this host's cores: one torch thread each (model.num_threads' default,
        # every core, would make them fight over the same cores).
        settings = {"model-num-slots": str(args.num_slots), "store-redis-key-prefix": prefix,
                    "max-concurrent-requests": str(max(64, args.concurrency)), "model-num-threads": "1"}
        if args.model_path:
            settings["model-path"] = args.model_path
        t0 = time.perf_counter()
        replicas = start_replicas(args.replicas, home, url, env, tiny=not (args.model_path or args.smollm2), **settings)
        startup_s = time.perf_counter() - t0
        prompts = _prompts(args.requests)
        warm = argparse.Namespace(**{**vars(args), "requests": 2 * args.tenants, "concurrency": 4})
        for k in range(1, args.replicas + 1):  # under every routing the rounds use: tenants held, shapes seen
            _round(replicas[:k], keys, prompts, warm)
        # Every prompt once before the timed rounds, so that each round finds the same history (the
        # rounds repeat these prompts: without this the first round would draft from less than the next).
        _round(replicas, keys, prompts, argparse.Namespace(**{**vars(args), "concurrency": args.concurrency}))
        rounds = []
        under_load = None
        for k in range(1, args.replicas + 1):
            during = None
            if k == args.replicas and args.replicas > 1 and args.propagation_samples:
                def during(proc: Any, k: int = k) -> Any:  # sample propagation while the round runs
                    return _propagation(replicas[:k], probe_key, probe.value, admin_key,
                                        args.propagation_samples, stop=lambda: proc.poll() is not None)
            figures, extra = _round(replicas[:k], keys, prompts, args, during)
            rounds.append(figures)
            under_load = extra if extra is not None else under_load
        idle = (_propagation(replicas, probe_key, probe.value, admin_key, args.propagation_samples)
                if args.replicas > 1 and args.propagation_samples else None)
        for r in replicas:
            r.stop()
        cold = _cold_start(args, url, env, home) if args.cold_start_tokens else None
    finally:
        for r in replicas:
            r.stop()
        delete_keyspace(store)
        store.close()
        if redis is not None:
            redis.stop()
    base = rounds[0]["throughput_tokens_per_s"]
    p99 = idle["from_ack_s"]["p99"] if idle else None
    return {
        "model": args.model_path or ("SmolLM2-135M-Instruct" if args.smollm2 else "tiny-llama"),
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "redis": "given" if args.redis_url else "private redis-server, appendonly yes, appendfsync everysec",
        "requests": args.requests, "concurrency": args.concurrency, "tenants": args.tenants,
        "max_new_tokens": args.max_new_tokens, "replica_startup_s": startup_s,
        "rounds": rounds,
        "scaling": {f"{r['replicas']}_vs_1": r["throughput_tokens_per_s"] / base for r in rounds},
        "propagation": {"idle": idle, "under_load": under_load},
        "cold_start": cold,
        "target": {"propagation_p99_s": TARGET_PROPAGATION_P99_S,
                   "met": p99 is not None and p99 < TARGET_PROPAGATION_P99_S},
    }


def _print(r: dict[str, Any]) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f} ms"
    print(f"model {r['model']}, {r['requests']} requests x {r['max_new_tokens']} tokens per round, concurrency "
          f"{r['concurrency']}, {r['tenants']} tenants, {r['machine']['cpus']} CPUs (load average "
          f"{r['machine']['load_average'][0]:.1f}); {r['redis']}")
    for x in r["rounds"]:
        print(f"{x['replicas']} replica(s)   {x['throughput_tokens_per_s']:8.1f} tokens/s "
              f"(x{r['scaling'][str(x['replicas']) + '_vs_1']:.2f}), latency p50 {ms(x['latency_s']['p50'])}, "
              f"p99 {ms(x['latency_s']['p99'])}, errors {x['errors']['count']}, replica cores busy "
              f"{x['replica_cores_busy']:.2f}, {x['tokens_per_replica_cpu_s'] or 0:.1f} tokens per replica CPU s")
    for name, p in r["propagation"].items():
        if p:
            a = p["from_ack_s"]
            print(f"propagation ({name})  p50 {ms(a['p50'])}, p99 {ms(a['p99'])}, max {ms(a['max'])} after the "
                  f"append's acknowledgement ({a['samples']} samples)")
    c = r["cold_start"]
    if c:
        print(f"cold start  {c['indexed_tokens']:,} indexed tokens ({c['trajectories']:,} turns, {c['stored_tokens']:,} "
              f"stored tokens): snapshot + {c['tail_trajectories']} tail turns {c['snapshot_plus_tail_s']:.2f} s, full "
              f"rebuild {c['full_rebuild_s']:.2f} s (x{c['speedup']:.1f}); snapshot {c['snapshot_bytes'] / 2**20:.1f} MiB")
    print(f"target      propagation p99 < {r['target']['propagation_p99_s']} s: "
          f"{'met' if r['target']['met'] else 'NOT met'}")


if __name__ == "__main__":
    client_main()
