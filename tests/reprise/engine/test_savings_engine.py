"""The savings estimate's inputs from the own engine: the prefill price fit, and every step's reports
carrying the request's share of the step's time and its tokens' plain steps on the fitted step cost."""

from __future__ import annotations

import pytest

from reprise.engine.draft_budget import DraftBudget
from reprise.engine.engine import Engine, EngineConfig, StepReport
from reprise.engine.prefill_cost import PrefillCostFit
from reprise.engine.step_cost import StepCostFit
from retrieval.registry import make_proposer
from verifier.runner import ModelRunner
from verifier.testing import tiny_model


def test_the_prefill_price_has_a_per_token_and_an_attention_part() -> None:
    fit = PrefillCostFit(min_prefills=3)
    assert fit.cached_seconds(100) is None
    price = lambda n: 0.01 + 0.002 * n + 1e-6 * n * n / 2  # a fixed cost, 2 ms a token, attention
    for n in (32, 128, 384, 1024, 128):
        fit.observe(n, price(n))
    assert fit.cached_seconds(500) == pytest.approx(price(500) - 0.01, rel=1e-6)  # the fixed cost is paid anyway
    fit.observe(0, 5.0)  # nothing prefilled: nothing learned
    assert fit.cached_seconds(500) == pytest.approx(price(500) - 0.01, rel=1e-6)
    line = PrefillCostFit(min_prefills=3)
    for n in (32, 128, 384):
        line.observe(n, 0.01 + 0.002 * n - 1e-7 * n * n)  # cheaper per token as prompts grow: a line
    assert line.cached_seconds(100) == pytest.approx(0.2, rel=0.1)
    same = PrefillCostFit(min_prefills=2)
    same.observe(100, 0.3)
    same.observe(100, 0.3)  # no spread in sizes: the mean price per token
    assert same.cached_seconds(10) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="decay"):
        PrefillCostFit(decay=1.0)


def test_calibration_prices_a_token_on_the_runner() -> None:
    runner = ModelRunner(tiny_model("llama", vocab_size=64), max_len=1024)
    fit = PrefillCostFit()
    fit.calibrate(runner)
    assert fit.num_observed == 6 and fit.cached_seconds(64) > 0
    assert runner.num_free_slots == runner.pool.num_slots  # nothing left behind


class Reports:
    def __init__(self) -> None:
        self.steps: list[list[StepReport]] = []

    def on_step(self, reports) -> None:
        self.steps.append(list(reports))

    def on_finish(self, result) -> None:
        pass


def test_reports_carry_each_requests_share_and_its_tokens_plain_steps_at_its_batch_size() -> None:
    runner = ModelRunner(tiny_model("llama", vocab_size=64), num_slots=2, max_len=256, max_draft_nodes=8,
                         prefix_cache_bytes=1 << 20)
    seen = Reports()
    frozen = StepCostFit(refresh_every=10**9)  # calibrated at start-up, then never refitted: a fixed price
    engine = Engine(runner, make_proposer("prompt_lookup"), None,
                    EngineConfig(budget=DraftBudget(cost_model=frozen), observer=seen))
    assert engine.step_costs is not None and engine.step_costs.measured  # calibrated at start-up
    assert engine.prefill_costs.cached_seconds(10) is not None
    prompt = [5, 6, 7, 8, 9] * 12
    engine.generate(prompt, max_new_tokens=24, tenant="t", ignore_eos=True)
    seen.steps.clear()
    for tenant in ("t", "u"):  # two requests share steps; t's prompt is cached from its first request
        engine.submit(_request(prompt, tenant))
    engine.run_until_idle()
    batched = [step for step in seen.steps if len(step) == 2]
    assert batched
    plain = {b: engine.step_costs.plain_step(b) for b in (1, 2)}
    for step in seen.steps:
        rows = [1 + r.num_draft for r in step]
        shares = [r.cost.seconds for r in step]
        assert shares[0] * rows[-1] == pytest.approx(shares[-1] * rows[0])  # time shared by rows
        for r in step:  # each token one plain step of this batch size, shared by its requests
            assert r.cost.plain_seconds == pytest.approx(r.num_tokens * plain[len(step)] / len(step))
    assert sum(r.num_tokens for step in seen.steps for r in step if r.tenant == "u") == 24
    prefills = {r.tenant: r.prefill for step in seen.steps for r in step if r.prefill is not None}
    assert set(prefills) == {"t", "u"}
    assert prefills["t"].plain_seconds > prefills["t"].seconds  # its cached tokens priced in
    assert prefills["u"].plain_seconds == prefills["u"].seconds  # nothing cached for u


def _request(prompt, tenant):
    from serving.records import Request

    return Request.of_tokens(prompt, max_new_tokens=24, ignore_eos=True, tenant=tenant)
