"""The savings estimate's inputs from the own engine: the prefill price fit, and every step's reports
carrying the request's share of the step's time and the plain-step estimate of its tokens."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.engine.draft_budget import DraftBudget
from reprise.engine.engine import Engine, EngineConfig, StepReport
from reprise.engine.prefill_cost import PrefillCostFit
from reprise.engine.step_cost import StepCostFit
from retrieval.registry import make_proposer
from verifier.runner import ModelRunner
from verifier.testing import tiny_model


def test_the_prefill_price_is_the_slope_of_recent_prefills() -> None:
    fit = PrefillCostFit(min_prefills=3)
    assert fit.per_token() is None
    for n in (32, 128, 384, 128):
        fit.observe(n, 0.01 + 0.002 * n)  # a fixed cost and 2 ms a token
    assert fit.per_token() == pytest.approx(0.002)
    fit.observe(0, 5.0)  # nothing prefilled: nothing learned
    assert fit.per_token() == pytest.approx(0.002)
    same = PrefillCostFit(min_prefills=2)
    same.observe(100, 0.3)
    same.observe(100, 0.3)  # no spread in sizes: the mean price per token
    assert same.per_token() == pytest.approx(0.003)
    with pytest.raises(ValueError, match="decay"):
        PrefillCostFit(decay=1.0)


def test_calibration_prices_a_token_on_the_runner() -> None:
    runner = ModelRunner(tiny_model("llama", vocab_size=64), max_len=512)
    fit = PrefillCostFit()
    fit.calibrate(runner)
    assert fit.num_observed == 6 and fit.per_token() is not None and fit.per_token() > 0
    assert runner.num_free_slots == runner.pool.num_slots  # nothing left behind


class Reports:
    def __init__(self) -> None:
        self.steps: list[list[StepReport]] = []

    def on_step(self, reports) -> None:
        self.steps.append(list(reports))

    def on_finish(self, result) -> None:
        pass


def test_reports_carry_each_requests_share_and_its_plain_estimate() -> None:
    runner = ModelRunner(tiny_model("llama", vocab_size=64), num_slots=2, max_len=256, max_draft_nodes=8,
                         prefix_cache_bytes=1 << 20)
    seen = Reports()
    frozen = StepCostFit(refresh_every=10**9)  # calibrated at start-up, then never refitted: a fixed price
    engine = Engine(runner, make_proposer("prompt_lookup"), None,
                    EngineConfig(budget=DraftBudget(cost_model=frozen), observer=seen))
    assert engine.step_costs is not None and engine.step_costs.measured  # calibrated at start-up
    assert engine.prefill_costs.per_token() is not None
    prompt = [5, 6, 7, 8, 9] * 12
    engine.generate(prompt, max_new_tokens=24, tenant="t", ignore_eos=True)
    seen.steps.clear()
    for tenant in ("t", "u"):  # two requests share steps; t's prompt is cached from its first request
        engine.submit(_request(prompt, tenant))
    engine.run_until_idle()
    batched = [step for step in seen.steps if len(step) == 2]
    assert batched
    fit = engine.step_costs
    for step in batched:
        rows = [1 + r.num_draft for r in step]
        shares = [r.cost.seconds for r in step]
        assert shares[0] * rows[1] == pytest.approx(shares[1] * rows[0])  # time shared by rows
        plain = float(fit.cost(np.asarray(1)))  # a plain step of two requests: one row beyond the first
        for r in step:
            assert r.cost.plain_seconds == pytest.approx(r.num_tokens * plain / 2)
    prefills = {r.tenant: r.prefill for step in seen.steps for r in step if r.prefill is not None}
    assert set(prefills) == {"t", "u"}
    assert prefills["t"].plain_seconds > prefills["t"].seconds  # its cached tokens priced in
    assert prefills["u"].plain_seconds == prefills["u"].seconds  # nothing cached for u


def _request(prompt, tenant):
    from reprise.engine.request import GenerationRequest, StoppingParams

    return GenerationRequest(tuple(prompt), stopping=StoppingParams(max_new_tokens=24, ignore_eos=True), tenant=tenant)
