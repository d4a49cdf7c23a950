"""Whether drafting pays at a batch size, measured: tokens per second of drafted against undrafted steps.

On vLLM the step's cut decides each step's drafts on a cost model fitted online
(reprise/backends/vllm/step_cost.py). A fit can be wrong where its terms are correlated or the host's
load shifts, and a cut on a wrong fit sends drafts that cost more than they win: a step slower than no
drafts at all. So the worker also keeps, per batch size, the tokens per second its drafted and its
undrafted steps actually delivered (decayed: recent steps weigh more), and ``drafts_pay`` stops drafting
at a batch size where drafted steps measure slower, whatever the fit says. (The own engine's cut prices
drafts on a table of its own steps, measured by rows at every batch size: reprise/engine/step_cost.py.) Until both sides are
measured at a batch size, every other step drafts; after that one step in ``probe_every`` takes the
other side, so both measurements stay current and a change of load or traffic turns drafting back on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class _Sides:
    """Decayed (steps, tokens, seconds) of one batch size's drafted and undrafted steps."""

    drafted: np.ndarray = field(default_factory=lambda: np.zeros(3))
    plain: np.ndarray = field(default_factory=lambda: np.zeros(3))
    calls: int = 0  # decisions taken at this batch size


class PayoffGuard:
    """Per batch size, whether drafted steps deliver at least the tokens per second undrafted ones do.
    One thread (the engine's step, or vLLM's proposer calls)."""

    def __init__(self, min_steps: int = 8, probe_every: int = 32, decay: float = 0.98, enabled: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if min_steps < 1 or probe_every < 2:
            raise ValueError(f"need min_steps >= 1 and probe_every >= 2, got {min_steps}, {probe_every}")
        self.min_steps = min_steps
        self.probe_every = probe_every
        self.decay = decay
        self.enabled = enabled  # False: drafts_pay always says yes (unit tests of drafting itself)
        self.rested_steps = 0  # steps sent without drafts where drafts measured slower
        self._sides: dict[int, _Sides] = {}

    def observe(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch_size`` requests, with drafts or not, committed ``tokens`` in ``seconds``."""
        if seconds <= 0.0 or batch_size < 1:
            return
        sides = self._sides.setdefault(batch_size, _Sides())
        if drafted:
            sides.drafted = sides.drafted * self.decay + np.array([1.0, tokens, seconds])
        else:
            sides.plain = sides.plain * self.decay + np.array([1.0, tokens, seconds])

    def drafts_pay(self, batch_size: int) -> bool:
        """Whether the coming step of ``batch_size`` requests may send drafts (module docstring)."""
        if not self.enabled:
            return True
        sides = self._sides.setdefault(batch_size, _Sides())
        sides.calls += 1
        if sides.plain[0] < self.min_steps or sides.drafted[0] < self.min_steps:
            return sides.calls % 2 == 0
        pays = sides.drafted[1] / sides.drafted[2] >= sides.plain[1] / sides.plain[2]
        if not pays:
            self.rested_steps += 1
        return pays != (sides.calls % self.probe_every == 0)

    def rates(self) -> dict[int, tuple[float, float]]:
        """Per batch size measured on both sides: (drafted, undrafted) tokens per second."""
        return {b: (float(s.drafted[1] / s.drafted[2]), float(s.plain[1] / s.plain[2]))
                for b, s in sorted(self._sides.items()) if s.drafted[0] >= self.min_steps and s.plain[0] >= self.min_steps}
