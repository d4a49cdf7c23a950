"""What prefilling prompt tokens costs on the host the engine runs on, for the savings estimate.

A prompt token whose KV comes from the prefix cache is a token not prefilled; what it saved is what
prefilling it would have cost. Prefilling ``n`` tokens is a per-token part (the weights, the MLPs) and an
attention part that grows with the context each token attends over (``n * n / 2`` positions for a fresh
prompt), so the fit is ``seconds = a + b * n + c * n * n / 2``, by least squares over recent fresh
prefills (exponential forgetting), and ``m`` cached tokens saved ``b * m + c * m * m / 2``: prefilling
them first would have cost that much, while the tokens after them attend over the same context either
way. ``calibrate`` times a few prefills of random prompts at start-up, so the price is known before the
first request; every fresh prefill served then refines it. With too little spread in sizes for the
attention term the fit is a line; with no spread, the mean price per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

CALIBRATION_SIZES = (32, 256, 768)


class PrefillCostFit:
    """Running least squares of prefill seconds on prefilled tokens. One thread (the engine's)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, decay: float = 0.99,
                 min_prefills: int = 3, min_spread: float = 16.0) -> None:  # fmt: skip
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.clock = clock
        self.decay = decay
        self.min_prefills = min_prefills
        self.min_spread = min_spread
        self._xx = np.zeros((3, 3))  # decayed sums of x x^T, x = (1, n, n * n / 2)
        self._xy = np.zeros(3)  # decayed sums of x * seconds
        self.num_observed = 0
        self._coefficients: tuple[float, float, float] | None = None  # (a, b, c), refitted on observe

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A fresh prefill (nothing cached) of ``num_tokens`` tokens took ``seconds``."""
        if num_tokens < 1 or seconds <= 0.0:
            return
        x = np.array([1.0, num_tokens, num_tokens * num_tokens / 2])
        self._xx = self._xx * self.decay + np.outer(x, x)
        self._xy = self._xy * self.decay + x * seconds
        self.num_observed += 1
        self._coefficients = self._fit()

    def _fit(self) -> tuple[float, float, float] | None:
        if self.num_observed < self.min_prefills:
            return None
        n, sum_x, sum_xx = self._xx[0, 0], self._xx[0, 1], self._xx[1, 1]
        mean_x, mean_y = sum_x / n, self._xy[0] / n
        if sum_xx / n - mean_x * mean_x < self.min_spread * self.min_spread:
            return (0.0, mean_y / mean_x, 0.0) if mean_x > 0 else None  # one size: the mean price per token
        scale = np.array([1.0, mean_x, mean_x * mean_x])  # columns of similar size: a well-posed solve
        xx = self._xx / np.outer(scale, scale)
        a, b, c = np.linalg.lstsq(xx, self._xy / scale, rcond=1e-10)[0] / scale
        if c < 0 or b < 0:  # no measurable attention term (or noise): a line
            line = np.linalg.lstsq(self._xx[:2, :2], self._xy[:2], rcond=None)[0]
            a, b, c = float(line[0]), max(float(line[1]), 0.0), 0.0
        return float(a), float(b), float(c)

    def cached_seconds(self, num_cached: int) -> float | None:
        """What prefilling ``num_cached`` tokens from the start would have cost (None until fitted)."""
        if self._coefficients is None:
            return None
        _, b, c = self._coefficients
        return b * num_cached + c * num_cached * num_cached / 2

    def calibrate(self, runner: Any, *, sizes: Sequence[int] = CALIBRATION_SIZES, reps: int = 2,
                  seed: int = 1) -> None:  # fmt: skip
        """Time ``reps`` prefills of random prompts of each size (cut to the runner's context) on a free
        slot of ``runner`` (nothing cached: no cache scope, nothing kept)."""
        rng = np.random.default_rng(seed)
        sizes = sorted({max(1, min(n, runner.max_len - 2)) for n in sizes})  # the largest a prompt may be
        for _ in range(reps):
            for n in sizes:
                start = self.clock()
                slot = runner.start(rng.integers(0, runner.vocab_size, n + 1).tolist())  # n prefilled + the root
                self.observe(n, self.clock() - start)
                runner.release(slot, keep_cache=False)
