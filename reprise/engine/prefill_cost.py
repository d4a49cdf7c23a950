"""What prefilling a prompt token costs on the host the engine runs on, for the savings estimate.

A prompt token whose KV comes from the prefix cache is a token not prefilled; what it saved is what
prefilling it would have cost. That price is fitted from the engine's own prefills: a least-squares
line ``seconds = a + b * tokens`` over recent prefills (exponential forgetting), ``b`` the per-token
price. ``calibrate`` times a few prefills of random prompts at start-up, so the price is known before
the first request; every served prefill then refines it. Prefilling ``n`` tokens after ``m`` cached ones
attends over ``m + n`` positions, so a long cached prefix makes the real price per token higher than
the fresh prefills' line says; docs/service.md says how far that moved the estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

CALIBRATION_SIZES = (32, 128, 384)


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
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self.num_observed = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A prefill of ``num_tokens`` tokens took ``seconds`` (a prefill of nothing teaches nothing)."""
        if num_tokens < 1 or seconds <= 0.0:
            return
        d = self.decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + num_tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + num_tokens * num_tokens
        self._xy = self._xy * d + num_tokens * seconds
        self.num_observed += 1

    def per_token(self) -> float | None:
        """Seconds per prefilled token (the line's slope), or None until enough prefills of spread sizes
        (then, with every prefill the same size, their mean time per token)."""
        if self.num_observed < self.min_prefills or self._n <= 0.0:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        if var < self.min_spread * self.min_spread:
            return mean_y / mean_x if mean_x > 0 else None
        return max((self._xy / self._n - mean_x * mean_y) / var, 0.0)

    def calibrate(self, runner: Any, *, sizes: Sequence[int] = CALIBRATION_SIZES, reps: int = 2,
                  seed: int = 1) -> None:  # fmt: skip
        """Time ``reps`` prefills of random prompts of each size on a free slot of ``runner`` (nothing
        cached: no cache scope, nothing kept)."""
        rng = np.random.default_rng(seed)
        sizes = [n for n in sizes if n + 1 < runner.max_len]
        for _ in range(reps):
            for n in sizes:
                start = self.clock()
                slot = runner.start(rng.integers(0, runner.vocab_size, n + 1).tolist())  # n prefilled + the root
                self.observe(n, self.clock() - start)
                runner.release(slot, keep_cache=False)
