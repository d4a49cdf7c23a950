"""When drafting stops paying: a tenant-wide acceptance monitor.

Each step's draft comes with its expected number of accepted tokens (``DraftTree.score``, from the
calibrated drafter); the monitor compares it with what the verifier actually accepted. The engine's
per-step budget (reprise/engine/draft_budget.py) already cuts each request's tree to what the cost model pays
for, using the request's own acceptance; this monitor adds memory across requests: when a tenant's
drafts keep failing (its traffic changed, or someone floods its history to collapse acceptance — the
"Mistletoe" style of attack, arXiv 2605.14005), its new requests stop drafting at once instead of each
relearning it, and a small probe every ``probe_every`` steps notices recovery.

Batch size is the engine's part: the base cost of a step is shared by the whole batch, so as the batch
grows each draft token costs relatively more (ArcticInference issue #185, vLLM #16258) and the cost
model keeps fewer of them (``reprise.engine.draft_budget``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# What a draft token adds to a verification step, as a share of a plain step, where nothing has been
# measured on the host: the one default of every fixed cost line (the draft budget's ``CostModel``,
# `reprise tune`, `reprise replay`'s estimated speedup). docs/verifier.md gives the measurement.
DRAFT_TOKEN_COST = 0.034


@dataclass(frozen=True, slots=True)
class MonitorConfig:
    """``threshold``: accepted / expected below which drafting is suspended; ``min_steps``: steps seen
    before suspending; ``decay``: per-step decay of the running sums (0.98: about 50 steps of memory);
    ``probe_every``: while suspended, one step in this many drafts; ``probe_budget``: its node cap."""

    threshold: float = 0.2
    min_steps: int = 64
    decay: float = 0.98
    probe_every: int = 16
    probe_budget: int = 4

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold}")
        if self.min_steps < 1 or self.probe_every < 1 or self.probe_budget < 1:
            raise ValueError(f"min_steps, probe_every and probe_budget must be >= 1, got {self}")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")


class AcceptanceMonitor:
    """Running expected vs accepted draft tokens of one scope (a tenant). Thread-safe."""

    def __init__(self, config: MonitorConfig | None = None) -> None:
        self.config = config if config is not None else MonitorConfig()
        self._expected = 0.0
        self._accepted = 0.0
        self._steps = 0
        self._since_probe = 0
        self._is_suspended = False  # kept by observe(): budget() reads it without the lock
        self._lock = threading.Lock()

    @property
    def ratio(self) -> float:
        """Accepted / expected over recent steps (1.0 before anything was drafted)."""
        with self._lock:
            return self._accepted / self._expected if self._expected > 0 else 1.0

    @property
    def suspended(self) -> bool:
        with self._lock:
            return self._suspended()

    def _suspended(self) -> bool:
        return (self._steps >= self.config.min_steps and self._expected > 0
                and self._accepted < self.config.threshold * self._expected)

    def budget(self, requested: int) -> int:
        """The node cap for a step that asked for ``requested``: unchanged normally; 0 while suspended,
        except a ``probe_budget`` probe every ``probe_every`` steps."""
        if not self._is_suspended:  # the common case, lock-free (a stale read costs one step at most)
            return requested
        with self._lock:
            if not self._suspended():
                return requested
            self._since_probe += 1
            if self._since_probe >= self.config.probe_every:
                self._since_probe = 0
                return min(requested, self.config.probe_budget)
            return 0

    def observe(self, expected: float, accepted: int) -> None:
        """One drafted step: the tree's score and the draft tokens the verifier accepted."""
        if expected <= 0:
            return
        d = self.config.decay
        with self._lock:
            self._expected = self._expected * d + expected
            self._accepted = self._accepted * d + accepted
            self._steps += 1
            self._is_suspended = self._suspended()
