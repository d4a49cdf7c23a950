"""Sweeps of drafting settings by canonical replay, ranked under a verification cost model.

A verification step that checks d draft tokens costs ``a + b * d`` (a: one target forward pass for one
token; b: the extra cost of each draft token in that pass). Without speculation a token costs ``a``, so
the estimated speedup of a setting is ``tau * a / (a + b * draft_tokens_per_step)``.

``DraftingConfig`` is treated as an opaque dataclass: settings are made with ``dataclasses.replace``
from the fields named in the grid, so fields added later can be swept without changing this module.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay_traces.replay import DEFAULT_BUDGET, ReplayReport, pool_reports, read_calls, replay_calls
from replay_traces.tokenizer import CanonicalTokenizer
from replay_traces.traces import Call, TraceStats
from retrieval.config import DraftingConfig
from retrieval.policy import DRAFT_TOKEN_COST
from retrieval.session import Proposer

# Default sweep over the full proposer's knobs: draft budget x path-probability pruning x back-off
# levels x skip cursors (24 settings). A config class without one of these fields sweeps the others; the
# SuffixDecoding anchor's own knobs (max_spec_factor, min_token_prob) can be swept with --grid.
DEFAULT_GRID: dict[str, tuple[Any, ...]] = {
    "max_draft_tokens": (8, 16, 32),
    "min_path_prob": (1e-4, 0.02),
    "levels": (1, 2),
    "skip_below": (0, 3),
}
# Cost model defaults: a plain step is 1, a draft token adds DRAFT_TOKEN_COST (retrieval/policy.py, the
# one default; docs/replay.md). On a GPU b/a is far smaller; pass the figures of your own hardware.
DEFAULT_A = 1.0
DEFAULT_B = DRAFT_TOKEN_COST


def estimated_speedup(tau: float, draft_tokens_per_step: float, a: float, b: float) -> float:
    """``tau * a / (a + b * draft_tokens_per_step)``: tokens per unit of verification cost vs. plain decoding."""
    if a <= 0 or b < 0:
        raise ValueError(f"cost model needs a > 0 and b >= 0, got a={a}, b={b}")
    return tau * a / (a + b * draft_tokens_per_step)


def _field_types(config_cls: type = DraftingConfig) -> dict[str, type]:
    base = config_cls()
    return {f.name: type(getattr(base, f.name)) for f in dataclasses.fields(config_cls)}


def default_grid(config_cls: type = DraftingConfig) -> dict[str, tuple[Any, ...]]:
    """``DEFAULT_GRID`` restricted to the fields ``config_cls`` has."""
    names = _field_types(config_cls)
    return {k: v for k, v in DEFAULT_GRID.items() if k in names}


def _parse_value(field: str, kind: type, text: str) -> Any:
    text = text.strip()
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"grid value {text!r} for {field} is not a boolean (true/false)")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"grid value {text!r} for {field} is not a valid {kind.__name__}") from None


def parse_grid(specs: Iterable[str], config_cls: type = DraftingConfig) -> dict[str, tuple[Any, ...]]:
    """Parse ``FIELD=V1,V2,...`` items (values typed like the field's default) into a grid."""
    types = _field_types(config_cls)
    grid: dict[str, tuple[Any, ...]] = {}
    for spec in specs:
        field, sep, values = spec.partition("=")
        field = field.strip()
        if not sep or not values.strip():
            raise ValueError(f"grid item {spec!r} must read FIELD=V1,V2,...")
        if field not in types:
            raise ValueError(f"unknown drafting setting {field!r} in --grid; known: {', '.join(sorted(types))}")
        if field in grid:
            raise ValueError(f"--grid names {field} twice")
        parsed = tuple(_parse_value(field, types[field], v) for v in values.split(",") if v.strip())
        grid[field] = tuple(dict.fromkeys(parsed))  # drop repeats, keep order
    return grid


def grid_settings(grid: Mapping[str, Sequence[Any]], base: DraftingConfig | None = None) -> list[DraftingConfig]:
    """Every combination of the grid's values applied to ``base``; an invalid one raises ValueError
    naming the combination."""
    base = base if base is not None else DraftingConfig()
    fields = list(grid)
    out = []
    for values in itertools.product(*(grid[f] for f in fields)):
        changes = dict(zip(fields, values))
        try:
            out.append(dataclasses.replace(base, **changes))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid setting {changes}: {exc}") from None
    return out


@dataclass(frozen=True, slots=True)
class TuneResult:
    """One setting's replay: per-file reports, the pooled report and its estimated speedup."""

    config: DraftingConfig
    varied: dict[str, Any]
    files: tuple[ReplayReport, ...]
    pooled: ReplayReport
    estimated_speedup: float

    def to_dict(self) -> dict[str, Any]:
        p = self.pooled
        return {
            "config": self.config.to_dict(),
            "varied": dict(self.varied),
            "tau": p.tau,
            "draft_tokens_per_step": p.draft_tokens_per_step,
            "acceptance_rate": p.acceptance_rate,
            "hit_rate": p.hit_rate,
            "speculate_us_p50": p.speculate_us_p50,
            "speculate_us_p99": p.speculate_us_p99,
            "estimated_speedup": self.estimated_speedup,
            "acceptance_by_position": list(p.acceptance_by_position),
            "tokens": p.tokens,
            "steps": p.steps,
            "files": [r.to_dict() for r in self.files],
        }


def best_result(results: Sequence[TuneResult]) -> TuneResult:
    """The highest estimated speedup; ties go to the earlier setting in grid order."""
    if not results:
        raise ValueError("no results")
    return max(enumerate(results), key=lambda ir: (ir[1].estimated_speedup, -ir[0]))[1]


@dataclass(frozen=True, slots=True)
class _ReplayOptions:
    """What every setting of a sweep replays alike (picklable, for worker processes)."""

    max_calls: int | None
    skip_bad_lines: bool
    trace_tenant: str | None
    drafter: str


def _replay_setting(
    traces: Sequence[str | Path],
    config: DraftingConfig,
    make_proposer: Callable[[DraftingConfig], Proposer],
    tokenizer: CanonicalTokenizer,
    options: _ReplayOptions,
    on_file: Callable[[Path], None] | None = None,
    on_call: Callable[[Call, int], None] | None = None,
) -> list[ReplayReport]:
    """One setting: every trace replayed through a fresh proposer."""
    reports = []
    for path in traces:
        if on_file is not None:
            on_file(Path(path))
        stats = TraceStats()
        calls: Iterable[Call] = read_calls(path, skip_bad_lines=options.skip_bad_lines, stats=stats)
        if options.trace_tenant is not None:
            calls = (c for c in calls if c.tenant == options.trace_tenant)
        if options.max_calls is not None:
            calls = itertools.islice(calls, options.max_calls)
        budget = getattr(config, "max_draft_tokens", DEFAULT_BUDGET)
        reports.append(replay_calls(calls, make_proposer(config), tokenizer, budget=budget,
                                    drafter=options.drafter, path=str(path), stats=stats, on_call=on_call))
    return reports


_worker_tokenizers: dict[str, CanonicalTokenizer] = {}


def _replay_setting_in_worker(traces: list[str | Path], config: DraftingConfig,
                              make_proposer: Callable[[DraftingConfig], Proposer], tokenizer_name: str,
                              options: _ReplayOptions) -> list[ReplayReport]:
    """``_replay_setting`` in a worker process; its tokenizer (and cache) is kept for the next setting."""
    tokenizer = _worker_tokenizers.get(tokenizer_name)
    if tokenizer is None:
        tokenizer = _worker_tokenizers[tokenizer_name] = CanonicalTokenizer(tokenizer_name)
    return _replay_setting(traces, config, make_proposer, tokenizer, options)


def sweep(
    traces: Sequence[str | Path],
    settings: Sequence[DraftingConfig],
    make_proposer: Callable[[DraftingConfig], Proposer],
    tokenizer: CanonicalTokenizer,
    *,
    a: float = DEFAULT_A,
    b: float = DEFAULT_B,
    max_calls: int | None = None,
    skip_bad_lines: bool = False,
    trace_tenant: str | None = None,
    drafter: str = "",
    jobs: int = 1,
    on_setting: Callable[[int, DraftingConfig, Path], None] | None = None,
    on_call: Callable[[Call, int], None] | None = None,
    on_result: Callable[[int, TuneResult], None] | None = None,
) -> list[TuneResult]:
    """Replay every trace under every setting (a fresh proposer per file and setting).

    ``trace_tenant`` keeps only that trace tenant's calls (``max_calls`` then counts those).
    ``on_result(i, result)`` is called after each setting (i: its index in ``settings``), so a caller
    can save partial results.

    ``jobs`` > 1 replays that many settings at once in worker processes (each holds its own indexes:
    memory grows with ``jobs``); ``make_proposer`` must then be picklable (a module-level function or a
    ``functools.partial`` of one), results still come back in ``settings`` order, ``on_result`` is
    called as settings finish, and ``on_setting``/``on_call`` are not called.
    """
    estimated_speedup(1.0, 0.0, a, b)  # validate the cost model before the long part
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    grid_fields = _varied_fields(settings)
    options = _ReplayOptions(max_calls, skip_bad_lines, trace_tenant, drafter)

    def result_of(config: DraftingConfig, reports: Sequence[ReplayReport]) -> TuneResult:
        pooled = pool_reports(reports)
        return TuneResult(
            config=config,
            varied={f: getattr(config, f) for f in grid_fields},
            files=tuple(reports),
            pooled=pooled,
            estimated_speedup=estimated_speedup(pooled.tau, pooled.draft_tokens_per_step, a, b),
        )

    if jobs == 1 or len(settings) <= 1:
        results: list[TuneResult] = []
        for i, config in enumerate(settings):
            on_file = None if on_setting is None else (lambda path, i=i, config=config: on_setting(i, config, path))
            reports = _replay_setting(traces, config, make_proposer, tokenizer, options, on_file, on_call)
            results.append(result_of(config, reports))
            if on_result is not None:
                on_result(i, results[-1])
        return results
    return _sweep_in_workers(traces, settings, make_proposer, tokenizer.name, options, min(jobs, len(settings)),
                             result_of, on_result)


def _sweep_in_workers(
    traces: Sequence[str | Path],
    settings: Sequence[DraftingConfig],
    make_proposer: Callable[[DraftingConfig], Proposer],
    tokenizer_name: str,
    options: _ReplayOptions,
    jobs: int,
    result_of: Callable[[DraftingConfig, Sequence[ReplayReport]], TuneResult],
    on_result: Callable[[int, TuneResult], None] | None,
) -> list[TuneResult]:
    # spawn, not fork: the parent may hold threads (a progress bar's monitor, BLAS pools) whose locks a
    # forked child would inherit held.
    context = multiprocessing.get_context("spawn")
    done: dict[int, TuneResult] = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {
            pool.submit(_replay_setting_in_worker, list(traces), config, make_proposer, tokenizer_name, options): i
            for i, config in enumerate(settings)
        }
        try:
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                done[i] = result_of(settings[i], future.result())
                if on_result is not None:
                    on_result(i, done[i])
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [done[i] for i in range(len(settings))]


def _varied_fields(settings: Sequence[DraftingConfig]) -> list[str]:
    """Fields whose value differs between settings (all fields when there is one setting)."""
    if not settings:
        return []
    names = [f.name for f in dataclasses.fields(settings[0])]
    varied = [n for n in names if len({repr(getattr(s, n)) for s in settings}) > 1]
    return varied or names


def setting_label(varied: Mapping[str, Any]) -> str:
    """A short label such as ``max_draft_tokens=16 min_token_prob=0.01``."""
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in varied.items())
