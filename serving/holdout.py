"""What drafting saves a tenant, measured: a share of its requests decoded without drafts (a holdout).

The savings estimate (``serving.savings``) is derived from the engines' cost models; where an operator
wants a measurement instead, ``server.holdout_share`` (off by default) decodes that share of each
tenant's drafting requests without drafts (their output is the same: drafts change only speed). Every
finished request of two tokens or more gives one observation: its decoding seconds per token after the
first (from its first token to its last, as the serving core saw them). The tenant's measured speedup
is the held-out requests' mean seconds per token over the drafted requests' mean, with a 95 %
confidence interval by the delta method (each group's mean has variance ``s^2 / n``)::

    r = mean_plain / mean_drafted
    var(r) ~= r^2 * (s_plain^2 / (n_plain mean_plain^2) + s_drafted^2 / (n_drafted mean_drafted^2))

What it costs: the held-out requests run at plain speed (their share of the tenant's speedup is given up).
What it measures: seconds per token as requests experienced them in the batches they ran in, so at
several requests in flight a held-out request shares steps with drafted ones and the ratio is not the
A/B of two separate engines (docs/service.md, "What Reprise saves").
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from dataclasses import dataclass

from serving.records import Request

Z95 = 1.959964  # the normal distribution's 97.5 % quantile


@dataclass(frozen=True, slots=True)
class MeasuredSpeedup:
    """A tenant's held-out and drafted requests and, with two of each, their per-token ratio."""

    held_out: int = 0
    drafted: int = 0
    speedup: float | None = None
    low: float | None = None
    high: float | None = None


class _Moments:
    """Count, sum and sum of squares of one group's seconds per token."""

    __slots__ = ("n", "squares", "sum")

    def __init__(self) -> None:
        self.n, self.sum, self.squares = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.sum += x
        self.squares += x * x

    def mean_and_variance(self) -> tuple[float, float]:
        mean = self.sum / self.n
        return mean, max(self.squares / self.n - mean * mean, 0.0) * self.n / max(self.n - 1, 1)


class Holdout:
    """Which requests decode without drafts, and the per-tenant measurement (thread-safe)."""

    def __init__(self, share: float, rng: random.Random | None = None) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"the holdout share must be in [0, 1), got {share}")
        self.share = share
        self._rng = rng or random.Random()
        self._groups: dict[tuple[str, bool], _Moments] = {}
        self._lock = threading.Lock()

    def take(self, request: Request) -> tuple[Request, bool]:
        """``request``, without drafts when it falls in the holdout; and whether it does. A request that
        asked for no drafts is no observation either way."""
        if not self.share or not request.params.speculate or self._rng.random() >= self.share:
            return request, False
        return dataclasses.replace(request, params=dataclasses.replace(request.params, speculate=False)), True

    def record(self, tenant: str, held_out: bool, tokens: int, seconds: float) -> None:
        """A finished request that drafted or was held out: ``tokens`` decoded in ``seconds`` after the first."""
        if not self.share or tokens < 1 or seconds <= 0.0:
            return
        with self._lock:
            self._groups.setdefault((tenant, held_out), _Moments()).add(seconds / tokens)

    def forget(self, tenant: str) -> None:
        with self._lock:
            for key in [(tenant, True), (tenant, False)]:
                self._groups.pop(key, None)

    def figures(self, tenant: str) -> MeasuredSpeedup:
        with self._lock:
            plain, drafted = self._groups.get((tenant, True)), self._groups.get((tenant, False))
            n_plain, n_drafted = (plain.n if plain else 0), (drafted.n if drafted else 0)
            if plain is None or drafted is None or n_plain < 2 or n_drafted < 2:
                return MeasuredSpeedup(n_plain, n_drafted)
            (mp, vp), (md, vd) = plain.mean_and_variance(), drafted.mean_and_variance()
        ratio = mp / md
        half = Z95 * ratio * math.sqrt(vp / (n_plain * mp * mp) + vd / (n_drafted * md * md))
        return MeasuredSpeedup(n_plain, n_drafted, ratio, max(ratio - half, 0.0), ratio + half)
