"""The hybrid's threshold for a tenant, chosen with the target model (``reprise tune --hybrid``).

The canonical replay has no target model, so it cannot score neural drafts. Here the target decodes a
few calls of each trace greedily (plain decoding, hidden states kept; cached like ``reprise bench
neural``'s references), then the hybrid built on the tuned retrieval settings replays those outputs
exactly as the engine would accept them (reprise/offline/model_replay.py) once per threshold. The threshold with
the highest estimated speedup under the measured CPU cost model (a verify step costs ``a`` ms plus ``b``
per draft token, plus the drafter's own CPU time) wins; ties go to the higher threshold (fewer head calls).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neural_drafters.hybrid import HybridProposer, HybridSettings, NeuralProposer, ReuseProposer
from neural_drafters.reuse import HiddenStateMemory
from reprise.drafters import DEFAULT_DRAFTER, make_proposer
from reprise.offline.calls import select_calls
from reprise.offline.model_replay import decode_reference, simulate
from retrieval.config import DraftingConfig
from retrieval.draft_tree import DraftTree
from verifier.runner import ModelRunner, VerifyStep

DEFAULT_THRESHOLDS = (0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True, slots=True)
class HybridTuneSettings:
    """Which calls the target decodes (as ``reprise bench neural`` selects them) and how."""

    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    calls: int = 6
    trials: int = 3
    call_index: int = 1
    prompt_tokens: int = 512
    max_new_tokens: int = 48
    budget: int = 32

    def __post_init__(self) -> None:
        if not self.thresholds or any(not t >= 0 for t in self.thresholds):
            raise ValueError(f"thresholds must be numbers >= 0, got {self.thresholds}")
        for name in ("calls", "trials", "prompt_tokens", "max_new_tokens", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class HybridTuneResult:
    threshold: float
    a_ms: float
    b_ms: float
    calls: int
    tokens: int
    sweep: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "a_ms": round(self.a_ms, 2), "b_ms": round(self.b_ms, 3),
                "calls": self.calls, "tokens": self.tokens, "sweep": self.sweep}


def label(t: float) -> str:
    return "inf" if math.isinf(t) else f"{t:g}"


def estimated_speedup(report: dict[str, Any], a_ms: float, b_ms: float) -> float:
    """tau per unit of step cost: a + b x draft tokens + the drafter's own CPU time per step."""
    return report["tau"] * a_ms / (a_ms + b_ms * report["drafted_per_step"] + report["propose_ms_per_step"])


def measure_step_cost(model, prefix: int, reps: int = 7) -> tuple[float, float]:
    """(a, b): median CPU ms of a verify step with no draft, and the extra ms per draft token (16-node
    steps), after a ``prefix``-token prompt: the cost model the threshold choice uses."""
    runner = ModelRunner(model, max_len=prefix + 40 * reps, max_draft_nodes=16)
    vocab = runner.vocab_size
    rng = np.random.default_rng(0)
    slot = runner.start(rng.integers(0, vocab, prefix).tolist())
    times: dict[int, list[float]] = {0: [], 16: []}
    for rep in range(reps + 1):
        for d in (0, 16):
            tree = DraftTree.chain(rng.integers(0, vocab, d)) if d else DraftTree.empty()
            start = time.thread_time()
            runner.verify([VerifyStep(slot, tree)])
            if rep:  # the first round warms up
                times[d].append(1000 * (time.thread_time() - start))
    runner.release(slot)
    a = float(np.median(times[0]))
    return a, max(0.0, (float(np.median(times[16])) - a) / 16)


def tune_threshold(traces: Sequence[str | Path], config: DraftingConfig, lm: Any, head: Any,
                   settings: HybridTuneSettings = HybridTuneSettings(), *, cache_dir: str | Path | None = None,
                   progress: Callable[[str], None] | None = None,
                   cost: tuple[float, float] | None = None) -> HybridTuneResult:
    """Sweep ``settings.thresholds`` for the hybrid over retrieval with ``config`` on ``traces``.

    ``lm``: the loaded target (``verifier.models.LoadedModel``, its tokenizer's chat template renders
    the prompts); ``head``: a ``HeadDrafter`` (``neural_drafters.proposers.load_head_drafter``);
    ``cost``: (a, b) in CPU ms, measured on ``lm`` when None."""
    say = progress or (lambda message: None)
    s = settings
    references = []
    for path in traces:
        calls = select_calls(path, lm.tokenizer, calls=s.calls, trials=s.trials, call_index=s.call_index,
                             prompt_tokens=s.prompt_tokens)
        say(f"{Path(path).name}: the target decodes {len(calls)} calls")
        references += decode_reference(lm.model, lm.tokenizer, calls, max_new_tokens=s.max_new_tokens,
                                       cache_dir=cache_dir, model_key=str(getattr(lm, "source", "")))
    if not references:
        raise ValueError("no calls to decode in the traces")
    a_ms, b_ms = cost if cost is not None else measure_step_cost(lm.model, s.prompt_tokens)
    decode = lm.tokenizer.decode
    sweep: dict[str, dict[str, Any]] = {}
    for t in s.thresholds:
        retrieval = make_proposer(DEFAULT_DRAFTER, config)
        if hasattr(retrieval, "set_vocabulary"):
            retrieval.set_vocabulary(lambda i: decode([i]), len(lm.tokenizer))
        proposer = HybridProposer(retrieval, NeuralProposer(head), ReuseProposer(HiddenStateMemory()),
                                  HybridSettings(threshold=t))
        report = simulate(proposer, references, budget=s.budget, max_new_tokens=s.max_new_tokens).to_dict()
        report["estimated_speedup"] = round(estimated_speedup(report, a_ms, b_ms), 4)
        sweep[label(t)] = report
        say(f"threshold {label(t)}: tau {report['tau']:.3f}, estimated speedup {report['estimated_speedup']:.3f}")
    best = max(s.thresholds, key=lambda t: (sweep[label(t)]["estimated_speedup"], t))
    return HybridTuneResult(best, a_ms, b_ms, len(references), sum(len(r.output_ids) for r in references), sweep)
