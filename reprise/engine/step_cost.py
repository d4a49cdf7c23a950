"""What a verification step costs on the host the engine runs on, fitted from the engine's own steps.

The draft budget (reprise/engine/draft_budget.py) weighs each draft against the cost of the step that verifies
it. That cost depends on the machine, the model, the prefix and the batch (on a CPU the first draft rows
ride on the same weight reads, on a GPU a step is flat until the device saturates), so it is measured
where it runs: every step's time is recorded against its rows beyond the first (``B * Q - 1`` for ``B``
requests padded to ``Q`` rows: the x of the budget's cost table), and the table is the median of the
last ``window`` steps at each grid point, made non-decreasing (more rows never cost less). Until a grid
point has ``min_samples`` steps it is left out and the table interpolates over it.

A step of ``B`` requests reads ``B`` cached prefixes (attention, the gather of their KV) besides its
rows, so it costs more than one request's step of as many rows: the table is fitted from single-request
steps only, and each batch size ``B > 1`` adds its own offset, the median over its last ``2 * window``
steps of their time less the table's price of their rows (``cost(rows, batch=B) = table(rows) +
offset[B]``; rows and prefixes are the two things a step pays for, the matrix products by row and
attention by request). One table over every batch size would price a single request's seven draft
rows like a plain step of eight requests.

``calibrate`` fills the table at start-up with a few steps of each draft size on a random prompt;
without calibration or steps the budget uses ``FALLBACK_POINTS``, a table of ratios to a plain step
(docs/verifier.md, "The draft budget's cost model", says where it was measured).

Hot path: ``observe`` writes one number into a preallocated array; the table is refitted every
``refresh_every`` observations (one median over a ``[grid, window]`` array), never per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Step cost by draft rows as ratios to a plain step, before the host has measured its own: `reprise bench
# verify`'s table for SmolLM2-135M (docs/verifier.md, "The draft budget's cost model").
FALLBACK_POINTS = ((0, 1.0), (1, 1.01), (2, 1.07), (4, 1.47), (8, 1.87), (16, 2.08), (32, 2.65), (64, 3.66))
CALIBRATION_SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _grid(limit: int = 4096) -> np.ndarray:
    """Rows beyond the first: every count to 8, then four points an octave (10, 12, 14, 16, 20, ...)."""
    points = list(range(8))
    octave = 8
    while octave < limit:
        points += [octave, octave * 5 // 4, octave * 3 // 2, octave * 7 // 4]
        octave *= 2
    return np.array(points + [octave], dtype=np.int64)


def monotone(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest to ``values`` in weighted least squares (pool adjacent
    violators): a noisy point pools with its neighbours into their weighted mean instead of lifting every
    later point to itself (as a running maximum would)."""
    blocks: list[tuple[float, float, int]] = []  # (weighted mean, weight, points pooled)
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append((v, w, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = ((v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2)
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


def interpolate(xs: Sequence[float], ys: Sequence[float], x: np.ndarray) -> np.ndarray:
    """Piecewise-linear through ``(xs, ys)`` (sorted), extended past the last point along the last
    segment's slope and flat before the first."""
    x = np.asarray(x, dtype=np.float64)
    inside = np.interp(x, xs, ys)
    if len(xs) < 2:
        return inside
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), inside)


class StepCostFit:
    """Step cost by rows beyond the first, from measured steps (seconds). ``cost`` is the budget's view."""

    def __init__(self, *, window: int = 32, min_samples: int = 2, refresh_every: int = 16,
                 clock: Callable[[], float] = time.perf_counter, clock_name: str = "wall") -> None:  # fmt: skip
        if window < 1 or min_samples < 1 or min_samples > window or refresh_every < 1:
            raise ValueError(
                f"need 1 <= min_samples <= window and refresh_every >= 1, got window={window}, "
                f"min_samples={min_samples}, refresh_every={refresh_every}"
            )
        self.grid = _grid()
        # Nearest grid point (by ratio) of every row count up to the grid's end.
        counts = np.arange(self.grid[-1] + 1, dtype=np.float64)
        upper = np.searchsorted(self.grid, counts).clip(1, len(self.grid) - 1)
        lower = upper - 1
        nearer_lower = (counts + 1) / (self.grid[lower] + 1) < (self.grid[upper] + 1) / (counts + 1)
        self._bucket = np.where(nearer_lower | (self.grid[upper] < counts), lower, upper)
        self._bucket[self.grid] = np.arange(len(self.grid))
        self.window = window
        self.min_samples = min_samples
        self.refresh_every = refresh_every
        self.clock = clock
        self.clock_name = clock_name
        self._samples = np.full((len(self.grid), window), np.nan)  # [grid, window] seconds, a ring per point
        self._counts = np.zeros(len(self.grid), dtype=np.int64)
        # Batch size -> ring of [rows beyond the first, seconds] of its last 2 * window steps; steps seen.
        self._batch_steps: dict[int, np.ndarray] = {}
        self._batch_seen: dict[int, int] = {}
        self._offsets: dict[int, float] = {}  # batch size -> seconds a step pays beyond the table; whole, as _points
        self._plain: dict[int, float] = {}  # batch size -> median of its recent plain steps, where enough; whole
        self._pending = 0
        self.calibrated = False
        self.num_observed = 0
        # (xs, ys), replaced whole so that a reader on another thread (metrics) never sees half a refit.
        self._points: tuple[tuple[float, ...], tuple[float, ...]] = (
            tuple(float(d) for d, _ in FALLBACK_POINTS), tuple(c for _, c in FALLBACK_POINTS)
        )
        self.measured = False  # False while the table is FALLBACK_POINTS

    def use_clock_for(self, device: Any, num_threads: int) -> None:
        """CPU time of the engine thread on a CPU with one torch thread (every op runs on that thread,
        and time the machine spends on other processes is left out); wall time otherwise (a GPU step
        ends with a host sync). Call before anything is recorded: samples of two clocks do not mix."""
        if self.num_observed:
            raise RuntimeError("the clock of a fit that has recorded steps cannot change")
        if str(device) == "cpu" and num_threads == 1:
            self.clock, self.clock_name = time.thread_time, "thread_cpu"
        else:
            self.clock, self.clock_name = time.perf_counter, "wall"

    # ---- recording (engine thread) ----------------------------------------------------------------------
    def observe(self, extra_rows: int, seconds: float, batch: int = 1) -> None:
        """One step of ``batch`` requests and ``extra_rows`` rows beyond the first took ``seconds``."""
        if batch > 1:
            ring = self._batch_steps.setdefault(batch, np.full((2 * self.window, 2), np.nan))
            seen = self._batch_seen.get(batch, 0)
            ring[seen % len(ring)] = (extra_rows, seconds)
            self._batch_seen[batch] = seen + 1
        else:
            i = self._bucket[min(max(extra_rows, 0), len(self._bucket) - 1)]
            self._samples[i, self._counts[i] % self.window] = seconds
            self._counts[i] += 1
        self.num_observed += 1
        self._pending += 1
        if self._pending >= self.refresh_every:
            self.refit()

    def refit(self) -> None:
        """Recompute the table from the recorded single-request steps (kept as it is while none is
        usable), then each batch size's offset against it (once the table is measured)."""
        self._pending = 0
        usable = np.flatnonzero(self._counts >= self.min_samples)
        if len(usable):
            medians = np.nanmedian(self._samples[usable], axis=1)
            weights = np.minimum(self._counts[usable], self.window).astype(np.float64)
            xs = tuple(float(x) for x in self.grid[usable])
            self._points = (xs, tuple(float(y) for y in monotone(medians, weights)))
            self.measured = True
        if self.measured:
            offsets, plain = {}, {}
            for batch, ring in self._batch_steps.items():
                seen = self._batch_seen[batch]
                if seen >= self.min_samples:
                    steps = ring[: min(seen, len(ring))]
                    offsets[batch] = float(np.median(steps[:, 1] - interpolate(*self._points, steps[:, 0])))
                    undrafted = steps[steps[:, 0] == batch - 1, 1]
                    if len(undrafted) >= self.min_samples:
                        plain[batch] = float(np.median(undrafted))
            self._offsets, self._plain = offsets, plain

    def calibrate(self, runner: Any, *, sizes: Sequence[int] = CALIBRATION_SIZES, reps: int = 3,
                  prefix_len: int = 512, seed: int = 0) -> None:  # fmt: skip
        """Time ``reps`` steps of each draft size (random chains: one row each beyond the root) after a
        random ``prefix_len``-token prompt in a free slot of ``runner``, then refit."""
        from retrieval.draft_tree import DraftTree
        from verifier.runner import VerifyStep

        rng = np.random.default_rng(seed)
        sizes = [d for d in sizes if d <= runner.max_draft_nodes]
        room = len(sizes) * reps * 2 + max(sizes) + 4  # tokens the steps commit, plus the last tree
        prefix_len = max(1, min(prefix_len, runner.max_len - room))
        slot = runner.start(rng.integers(0, runner.vocab_size, prefix_len).tolist())
        try:
            runner.verify([VerifyStep(slot, DraftTree.empty())])  # warm-up
            for rep in range(reps):
                order = sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]  # spread drift over sizes
                for d in order:
                    if runner.remaining(slot) <= d + 1:
                        break
                    tree = DraftTree.chain(rng.integers(0, runner.vocab_size, d)) if d else DraftTree.empty()
                    start = self.clock()
                    runner.verify([VerifyStep(slot, tree)])
                    self.observe(d, self.clock() - start)
        finally:
            runner.release(slot, keep_cache=False)
        self.refit()
        self.calibrated = self.measured

    # ---- the budget's view ---------------------------------------------------------------------------
    def cost(self, num_draft: np.ndarray, batch: int = 1) -> np.ndarray:
        """Cost of steps of ``batch`` requests with ``num_draft`` rows beyond the first (vectorised;
        seconds once measured): the table's price of the rows plus the batch size's offset. A step is
        never priced below a tenth of the table's cheapest (an offset fitted on a busier host)."""
        xs, ys = self._points
        rows = interpolate(xs, ys, num_draft)
        offset = self._offset(batch)
        return np.maximum(rows + offset, 0.1 * ys[0]) if offset else rows

    def plain_step(self, batch: int) -> float | None:
        """A step of ``batch`` requests without drafts (None until measured): the median of such steps
        among the batch size's recent ones where at least ``min_samples`` were plain (no model between the
        measurement and the price: the table and offset are fitted on drafted steps, whose rows do not add
        up as a batch's do), else ``cost(batch - 1, batch)``."""
        if not self.measured:
            return None
        measured = self._plain.get(batch)
        return measured if measured is not None else float(self.cost(np.asarray(batch - 1), batch))

    def _offset(self, batch: int) -> float:
        """The batch size's offset: as measured where it was, else interpolated in the batch size between
        the measured ones (one request: none), beyond the largest in proportion to the requests past the
        first (each reads its own prefix). A batch size the engine has not run at yet (the plain schedule
        prices the smaller batches a plain engine would have run) is not priced like a single request."""
        if batch in self._offsets or batch <= 1 or not self._offsets:
            return self._offsets.get(batch, 0.0)
        sizes = sorted(self._offsets)
        if batch > sizes[-1]:
            return self._offsets[sizes[-1]] * (batch - 1) / max(sizes[-1] - 1, 1)
        return float(np.interp(batch, [1] + sizes, [0.0] + [self._offsets[b] for b in sizes]))

    def table(self) -> list[tuple[int, float, int]]:
        """The fitted points: (rows beyond the first, seconds, steps recorded there)."""
        if not self.measured:
            return []
        xs, ys = self._points
        return [(int(x), y, int(self._counts[self._bucket[int(x)]])) for x, y in zip(xs, ys)]

    def offsets(self) -> dict[int, tuple[float, int]]:
        """Each batch size's offset: (seconds beyond the table, steps recorded at that size)."""
        return {b: (o, self._batch_seen[b]) for b, o in sorted(self._offsets.items())}

    def report(self) -> dict[str, Any]:
        """The fitted model as plain values (``reprise bench verify --json``)."""
        table = self.table()
        base = table[0][1] if table else 0.0
        return {
            "clock": self.clock_name,
            "calibrated": self.calibrated,
            "steps_observed": self.num_observed,
            "points": [
                {"extra_rows": x, "ms": round(1000 * y, 2), "ratio_to_plain": round(y / base, 3) if base else None,
                 "steps": n}
                for x, y, n in table
            ],
            "batch_offsets": [{"batch": b, "ms": round(1000 * o, 2), "steps": n} for b, (o, n) in self.offsets().items()],
        }  # fmt: skip
