"""What a vLLM step costs by the requests in it and the draft tokens it verifies, measured online.

Three readers need the price of a step on the running host: the step's cut
(``VllmStepCost.cut``), which keeps the draft tokens a step pays for, the savings estimate
(serving/savings.py), which prices each token at a plain step of its batch size, and the payoff guard,
which stops drafting at a batch size where drafted steps deliver fewer tokens per second than plain
ones. vLLM's kernels, the hardware and the machine's load price a step differently from the own
engine's table, so the meter times the proposer's own calls: vLLM calls ``propose`` once per step, so
the time between two calls over the same requests is one step plus the proposer's last call, and the
step verified one row per request plus the drafts sent at that call (``on_call``, ``after_call``: the
only timing in the adapter).

A request and a draft token are not the same row: each request in a batch reads its own KV (its whole
context), while a draft token reads its request's KV once more within the same attention call; and a
step that verifies any draft runs vLLM's rejection sampler and a wider logits pass that a plain step
does not. So the fit, by least squares over recent steady steps (exponential forgetting), is

    seconds = base + per_request * requests + per_context * context_tokens + per_draft * draft_tokens
              + drafted * (any draft in the step)

(``context_tokens``: the tokens of every request's context, summed over the batch) and a plain step of
``B`` requests costs ``base + per_request * B + per_context * context_tokens``. Where the steps seen so
far do not tell a term apart (one batch size only, no undrafted step, or requests' contexts within a few
hundred tokens of each other), that term is left out of the fit.

A fit can be wrong where its terms are correlated (batches that verify more drafts are also smaller
ones), and a cut on a wrong fit sends drafts that cost more than they win. So besides the fit the meter
keeps, per batch size, the tokens per second that drafted and undrafted steps actually delivered
(``payoff.PayoffGuard``): whatever the fit says, a step never
drafts where drafting measured slower than not drafting.

Only steady steps count: the same requests in both calls (a new request's prefill, or an idle engine
between requests, would make the gap a different thing), and gaps under ``max_gap_s``. Until
``min_steps`` such steps, spread over at least ``min_spread`` draft tokens, there is no fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reprise.backends.vllm.payoff import PayoffGuard
from reprise.engine.draft_budget import CostModel

_TERMS = ("base", "per_request", "per_draft", "drafted", "per_context")
# How much a request's context must vary across the steps seen (standard deviation, tokens) for the fit
# to price context: a request's own decoding adds a few hundred tokens at most, which on its own leaves
# the term's coefficient to noise (it then trades against ``per_request`` and misprices large batches).
MIN_CONTEXT_SPREAD = 256.0


@dataclass(frozen=True, slots=True)
class VllmStepCost:
    """``seconds = base + per_request * requests + per_draft * draft_tokens + drafted * [any draft]
    + per_context * context_tokens``; ``context``: the mean context a request of the fitted steps had
    (what a step is priced at where its context is not known)."""

    base: float
    per_request: float
    per_draft: float
    drafted: float
    per_context: float = 0.0
    context: float = 0.0

    def plain_step(self, batch_size: int, context_tokens: float | None = None) -> float:
        """A step of ``batch_size`` requests without drafts, whose contexts hold ``context_tokens`` in all
        (None: ``context`` a request)."""
        b = max(batch_size, 1)
        kv = self.context * b if context_tokens is None else context_tokens
        return self.base + self.per_request * b + self.per_context * kv

    def cost_model(self, batch_size: int) -> CostModel:
        """The draft budget's cost model at ``batch_size`` requests, as a table by rows beyond the first
        (the budget prices ``d`` draft tokens for each of ``B`` requests at ``cost(B * (1 + d) - 1) / B``):
        no draft is a plain step; the first draft token adds the drafted step's overhead and its rows;
        each further one its rows."""
        b = max(batch_size, 1)
        plain = self.plain_step(b)
        first = plain + self.drafted + self.per_draft * b
        points = ((b - 1, plain), (2 * b - 1, first), (2 * b - 1 + 32 * b, first + self.per_draft * 32 * b))
        return CostModel(points=points)

    def cut(self, probs: Sequence[np.ndarray], batch_size: int, plain_step: float | None = None,
            overhead: float = 0.0) -> np.ndarray:
        """How many draft tokens each request of a step sends, the step's tokens per second at its best.

        ``probs[r]``: request ``r``'s draft tokens' path probabilities in the order it would send them
        (non-increasing: a chain's). A step of ``batch_size`` requests that sends ``n`` draft tokens in
        all commits ``batch_size + sum`` of their probabilities in expectation and costs ``plain_step +
        overhead + drafted + per_draft * n`` (``plain_step``: the measured one where given, else this
        fit's; ``overhead``: what every step pays either way, the proposer's own call). A draft token
        costs the same row whichever request it rides on, so the tokens sent are the step's surest
        overall, as many as maximise tokens per second; none where a plain step does better. Unlike
        each request weighing its own share (``DraftBudget.select``), this prices the drafted step's
        overhead once for the step, however few of its requests draft."""
        counts = np.zeros(len(probs), dtype=np.int64)
        if not len(probs):
            return counts
        flat = np.concatenate([np.asarray(p, dtype=np.float64) for p in probs])
        if not len(flat):
            return counts
        owner = np.repeat(np.arange(len(probs)), [len(p) for p in probs])
        order = np.argsort(-flat, kind="stable")  # within a request its own order stays
        b = max(batch_size, 1)
        base = (self.plain_step(b) if plain_step is None else plain_step) + overhead
        n = np.arange(1, len(flat) + 1)
        rate = (b + np.cumsum(flat[order])) / (base + self.drafted + self.per_draft * n)
        best = int(np.argmax(rate))
        if rate[best] <= b / base:
            return counts
        return np.bincount(owner[order[: best + 1]], minlength=len(probs)).astype(np.int64)


@dataclass(slots=True)
class _Call:
    """A propose call: when it began, the batch's requests, the rows the next step verifies (one per
    request plus the drafts sent), the call's own seconds and the batch's context tokens."""

    at: float
    batch: tuple[str, ...]
    rows: int
    own: float
    context: int


class StepCostMeter:
    """Running least squares of step seconds on (requests, draft tokens, context), and each batch size's
    measured throughput with and without drafts. One thread (the proposer's caller)."""

    def __init__(self, decay: float = 0.995, min_steps: int = 64, min_spread: float = 4.0,
                 max_gap_s: float = 5.0, min_undrafted: int = 8, probe_every: int = 32,
                 refresh_every: int = 32, guard: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_steps = min_steps
        self.min_spread = min_spread
        self.max_gap_s = max_gap_s
        self.min_undrafted = min_undrafted
        self.probe_every = probe_every
        self.refresh_every = refresh_every
        self.payoff = PayoffGuard(min_undrafted, probe_every, enabled=guard)  # per batch size, measured
        self._xx = np.zeros((5, 5))  # decayed sums of x x^T, x = (1, requests, draft tokens, any draft, context)
        self._xy = np.zeros(5)
        self._steps = 0
        self._batches: set[int] = set()
        self._fit: VllmStepCost | None = None
        self._cut_cost: VllmStepCost | None = None  # the fit the cut and the savings use, refreshed now and then
        self.propose_seconds = 0.0  # the proposer's own call per step, a running mean (forgetting as above)
        self._propose_weight = 0.0
        # batch -> decayed (weight, seconds sum, steps, context tokens sum) of its undrafted steps
        self._plain: dict[int, tuple[float, float, int, float]] = {}
        self._request_context = np.zeros(3)  # decayed (weight, sum, sum of squares) of a step's context a request
        self._last: _Call | None = None

    # ---- timing (the proposer's calls) ---------------------------------------------------------------

    def on_call(self, now: float, batch: tuple[str, ...], decoding: bool, context: int, tokens: int) -> None:
        """vLLM called the proposer at ``now`` for ``batch``, whose rows committed ``tokens`` in the step
        since the previous call (``decoding``: every row sampled; none prefilled). Where the batch is the
        one the previous call drafted for, that step is observed: its seconds less the previous call's
        own for the fit, with it for the throughput."""
        last, self._last = self._last, None
        if last is None or not decoding or last.batch != batch or now - last.at > self.max_gap_s:
            return
        self.observe(len(batch), last.rows - len(batch), now - last.at - last.own, last.context)
        self.payoff.observe(len(batch), last.rows > len(batch), tokens, now - last.at)

    def after_call(self, now: float, batch: tuple[str, ...], rows: int, own: float, context: int) -> None:
        """The call that began at ``now`` took ``own`` seconds and sent drafts for ``rows`` rows in all."""
        self.observe_propose(own)
        self._last = _Call(now, batch, rows, own, context)
        if self._steps and self._steps % self.refresh_every == 0 or self._cut_cost is None:
            self._cut_cost = self.fit()

    def drafts_pay(self, batch_size: int) -> bool:
        """Whether the coming step of ``batch_size`` requests may send drafts (``PayoffGuard``: a step and
        the proposer's call before it, timed between two calls)."""
        return self.payoff.drafts_pay(batch_size)

    @property
    def cost(self) -> VllmStepCost | None:
        """The fit the cut and the savings price by (refreshed every ``refresh_every`` steps, so a step's
        decisions do not move with each observation)."""
        return self._cut_cost

    def price(self, batch_size: int, draft_tokens: int, context_tokens: float) -> tuple[float, float] | None:
        """(seconds of a step of ``batch_size`` requests verifying ``draft_tokens`` in all with the
        proposer's call, seconds of a plain step of them) on the fit, or None before there is one."""
        fit = self._cut_cost
        if fit is None:
            return None
        plain = self.plain_step(batch_size, context_tokens) or fit.plain_step(batch_size, context_tokens)
        drafted = fit.drafted + fit.per_draft * draft_tokens if draft_tokens else 0.0
        return plain + drafted + self.propose_seconds, plain

    def observe(self, batch_size: int, draft_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        """One steady step: ``batch_size`` requests whose contexts held ``context_tokens`` in all verified
        ``draft_tokens`` draft tokens in ``seconds``."""
        if seconds <= 0.0 or seconds > self.max_gap_s or batch_size < 1 or draft_tokens < 0:
            return
        x = np.array([1.0, batch_size, draft_tokens, 1.0 if draft_tokens else 0.0, float(context_tokens)])
        self._xx = self._xx * self.decay + np.outer(x, x)
        self._xy = self._xy * self.decay + x * seconds
        per_request = context_tokens / batch_size
        self._request_context = self._request_context * self.decay + np.array([1.0, per_request, per_request ** 2])
        self._steps += 1
        self._batches.add(batch_size)
        self._fit = None
        if draft_tokens == 0:  # a plain step, measured as it is
            w, total, steps, kv = self._plain.get(batch_size, (0.0, 0.0, 0, 0.0))
            self._plain[batch_size] = (w * self.decay + 1.0, total * self.decay + seconds, steps + 1,
                                       kv * self.decay + context_tokens)

    def plain_step(self, batch_size: int, context_tokens: float | None = None) -> float | None:
        """What a step of ``batch_size`` requests without drafts costs, their contexts ``context_tokens`` in
        all (None: as the steps seen): the running mean of such steps where at least ``min_undrafted`` were
        seen at that batch size (no model between the measurement and the price), moved by the fit's
        ``per_context`` from their mean context to ``context_tokens``; else the fit's plain step; else
        None. The fit's terms are correlated where batches that verify more drafts are also smaller
        ones, so its plain step can be off by a fifth at 8-16 requests; measured plain steps are not."""
        w, total, steps, kv = self._plain.get(batch_size, (0.0, 0.0, 0, 0.0))
        fit = self.fit()
        if steps >= self.min_undrafted and w > 0.0:
            moved = 0.0 if fit is None or context_tokens is None else fit.per_context * (context_tokens - kv / w)
            return max(total / w + moved, 1e-6)
        return fit.plain_step(batch_size, context_tokens) if fit is not None else None

    def measured_plain(self) -> dict[int, float]:
        """The plain step by batch size where it was measured (``plain_step``'s first choice), at the
        mean context of the steps measured."""
        return {b: total / w for b, (w, total, steps, _) in sorted(self._plain.items())
                if steps >= self.min_undrafted and w > 0.0}

    def observe_propose(self, seconds: float) -> None:
        """The proposer's own call took ``seconds`` (drafting time every step pays, drafts or not)."""
        self._propose_weight = self._propose_weight * self.decay + 1.0
        self.propose_seconds += (seconds - self.propose_seconds) / self._propose_weight

    @property
    def num_steps(self) -> int:
        return self._steps

    def fit(self) -> VllmStepCost | None:
        """The fitted step cost, or None until enough steady steps with enough spread in draft tokens."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> VllmStepCost | None:
        n = self._xx[0, 0]
        if self._steps < self.min_steps or n <= 0.0:
            return None
        mean_d = self._xx[0, 2] / n
        if self._xx[2, 2] / n - mean_d * mean_d < self.min_spread:
            return None  # no spread in draft tokens: their price is unknown
        terms = [0, 2]  # base and per draft token always; the others where the steps tell them apart
        mean_b = self._xx[0, 1] / n
        if len(self._batches) > 1 and self._xx[1, 1] / n - mean_b * mean_b > 1e-6:
            terms.insert(1, 1)
        undrafted = sum(steps for _, _, steps, _ in self._plain.values())
        if undrafted >= self.min_undrafted and self._xx[3, 3] < n * (1 - 1e-6):
            terms.append(3)
        w, total, squares = self._request_context
        if w > 0.0 and squares / w - (total / w) ** 2 >= MIN_CONTEXT_SPREAD ** 2:
            terms.append(4)
        idx = np.array(terms)
        scale = np.maximum(np.sqrt(np.diag(self._xx)[idx] / n), 1e-12)  # columns of similar size
        xx = self._xx[np.ix_(idx, idx)] / np.outer(scale, scale)
        solved = np.linalg.lstsq(xx, self._xy[idx] / scale, rcond=1e-10)[0] / scale
        coef = dict.fromkeys(_TERMS, 0.0)
        for i, value in zip(terms, solved):
            coef[_TERMS[i]] = float(value)
        coef["per_draft"] = max(coef["per_draft"], 0.0)
        coef["per_request"] = max(coef["per_request"], 0.0)
        coef["drafted"] = max(coef["drafted"], 0.0)
        mean_y = self._xy[0] / n
        coef["per_context"] = max(coef["per_context"], 0.0)
        if coef["base"] <= 0.0:  # the other terms explain everything: keep a small base so ratios stay finite
            coef["base"] = max(mean_y * 0.05, 1e-6)
        return VllmStepCost(**coef, context=float(self._xx[0, 4] / max(self._xx[0, 1], 1e-12)))
