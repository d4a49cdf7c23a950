"""What a vLLM step costs by the rows it verifies, measured online in the worker.

The step budget (``reprise.engine.draft_budget.DraftBudget``) keeps the draft tokens a step pays for,
under a cost model ``cost(rows beyond the first)``. Its default table was measured on Reprise's own
engine (transformers); vLLM's kernels, the hardware and the machine's load price a draft row
differently, and in a batch the price decides whether drafting pays at all. So the proposer times its
own calls: vLLM calls ``propose`` once per step, so the time between two calls is one step, and the step
verified one row per request plus the drafts sent at the previous call. A least-squares line
``seconds = a + b * rows`` over recent steps (exponential forgetting) becomes the budget's cost model.

Only steady decoding steps count: the same requests in both calls (a new request's prefill, or an
idle engine between requests, would make the gap a different thing), and gaps under ``max_gap_s``.
Until ``min_steps`` such steps, spread over at least ``min_spread`` rows, the default table stays.
"""

from __future__ import annotations

from dataclasses import dataclass

from reprise.engine.draft_budget import CostModel


@dataclass(frozen=True, slots=True)
class StepCostLine:
    """``seconds = a + b * rows`` of one vLLM step."""

    a: float
    b: float

    def cost_model(self) -> CostModel:
        """The draft budget's cost model (by rows beyond the first; only ratios matter)."""
        return CostModel(a=self.a + self.b, b=self.b)


class StepCostMeter:
    """Running least squares of step seconds on verified rows. One thread (the proposer's caller)."""

    def __init__(self, decay: float = 0.995, min_steps: int = 64, min_spread: float = 4.0,
                 max_gap_s: float = 5.0) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_steps = min_steps
        self.min_spread = min_spread
        self.max_gap_s = max_gap_s
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        """One steady step: ``rows`` verified in ``seconds``."""
        if seconds <= 0.0 or seconds > self.max_gap_s or rows < 1:
            return
        d = self.decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds
        self._steps += 1

    @property
    def num_steps(self) -> int:
        return self._steps

    def line(self) -> StepCostLine | None:
        """The fitted line, or None until enough steady steps with enough spread in rows."""
        if self._steps < self.min_steps or self._n <= 0.0:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        if var < self.min_spread:
            return None
        b = max((self._xy / self._n - mean_x * mean_y) / var, 0.0)
        a = mean_y - b * mean_x
        if a <= 0.0:  # the per-row price explains everything: keep a small base so ratios stay finite
            a = max(mean_y * 0.05, 1e-6)
        return StepCostLine(a, b)
