"""The step-cost fit: grid points, medians, refits, calibration on a runner, and the engine feeding it."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.engine.draft_budget import DraftBudget
from reprise.engine.engine import Engine, EngineConfig
from reprise.engine.step_cost import FALLBACK_POINTS, StepCostFit, interpolate, monotone
from retrieval.draft_tree import DraftTree
from retrieval.registry import make_proposer
from verifier.runner import ModelRunner
from verifier.testing import tiny_model


def test_steps_land_on_the_nearest_grid_point_and_the_table_is_their_median() -> None:
    fit = StepCostFit(window=4, min_samples=2, refresh_every=1000)
    assert not fit.measured and fit.cost(np.array([64]))[0] == FALLBACK_POINTS[-1][1]
    for seconds in (0.010, 0.011, 0.500, 0.012):  # one outlier: the median ignores it
        fit.observe(0, seconds)
    for seconds in (0.020, 0.022):
        fit.observe(16, seconds)
    fit.observe(17, 0.021)  # 17 is nearer to the grid point 16 than to the next one
    fit.observe(40, 0.100)  # a single step: below min_samples, left out
    fit.refit()
    assert fit.measured
    assert [(x, round(y, 4)) for x, y, _ in fit.table()] == [(0, 0.0115), (16, 0.021)]
    assert fit.cost(np.array([8]))[0] == pytest.approx(0.0115 + 0.5 * (0.021 - 0.0115))
    assert fit.cost(np.array([32]))[0] == pytest.approx(0.021 + 16 * (0.021 - 0.0115) / 16)  # the last slope


def test_more_rows_never_cost_less_and_old_steps_leave_the_window() -> None:
    fit = StepCostFit(window=2, min_samples=1, refresh_every=1)
    fit.observe(0, 0.05)
    fit.observe(4, 0.04)  # noise: cheaper than a plain step; the two pool
    assert [y for _, y, _ in fit.table()] == pytest.approx([0.045, 0.045])
    fit.observe(4, 0.09)
    fit.observe(4, 0.08)  # the window keeps the last two
    assert fit.table()[1][1] == pytest.approx(0.085)


def test_a_batch_pays_its_own_offset_over_the_single_request_table() -> None:
    """Eight requests of one row each read eight prefixes: a step dearer than one request's step of
    eight rows. Batched steps leave the table alone and price their batch size's offset."""
    fit = StepCostFit(window=4, min_samples=2, refresh_every=1000)
    for rows, seconds in ((0, 0.010), (0, 0.010), (7, 0.014), (7, 0.014), (16, 0.020), (16, 0.020)):
        fit.observe(rows, seconds)
    for seconds in (0.030, 0.031, 0.032):
        fit.observe(7, seconds, batch=8)  # plain steps of eight requests
    fit.observe(15, 0.036, batch=8)  # one draft token each
    fit.refit()
    assert [(x, y) for x, y, _ in fit.table()] == [(0, 0.010), (7, 0.014), (16, 0.020)]  # single requests only
    fifteen = 0.014 + 8 / 9 * 0.006  # the table between its points 7 and 16
    offset = float(np.median([0.016, 0.017, 0.018, 0.036 - fifteen]))
    assert fit.offsets() == {8: (pytest.approx(offset), 4)}
    assert fit.cost(np.array([7]), batch=8)[0] == pytest.approx(0.014 + offset)
    assert fit.cost(np.array([7]))[0] == pytest.approx(0.014)
    # No step of four or sixteen yet: each request past the first pays its part of the measured offset
    # (a batch size never run is not priced like a single request's step of as many rows).
    assert fit.cost(np.array([7]), batch=4)[0] == pytest.approx(0.014 + offset * 3 / 7)
    assert fit.cost(np.array([7]), batch=16)[0] == pytest.approx(0.014 + offset * 15 / 7)
    assert [o["batch"] for o in fit.report()["batch_offsets"]] == [8]
    # The budget weighs a batch's draft rows against its own plain step: relatively cheaper here.
    budget = DraftBudget(cost_model=fit)
    assert budget.share(np.array([1]), 8)[0] == pytest.approx((fifteen + offset) / 8)


def test_a_noisy_point_pools_with_its_neighbours_instead_of_lifting_them_to_itself() -> None:
    values = np.array([1.0, 1.1, 2.5, 1.3, 1.4, 1.6])  # the third point caught a busy moment
    assert monotone(values, np.ones(6)).tolist() == pytest.approx([1.0, 1.1, 1.7, 1.7, 1.7, 1.7])
    assert monotone(values, np.array([1, 1, 1, 10, 10, 10.0]))[2] < 1.5  # well-measured points weigh more


def test_interpolate_is_flat_before_and_linear_past_the_points() -> None:
    assert interpolate((2.0, 4.0), (1.0, 2.0), np.array([0, 3, 6])).tolist() == [1.0, 1.5, 3.0]
    assert interpolate((0.0,), (1.0,), np.array([0, 9])).tolist() == [1.0, 1.0]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        StepCostFit(window=2, min_samples=3)
    fit = StepCostFit()
    fit.observe(0, 0.01)
    with pytest.raises(RuntimeError, match="clock"):
        fit.use_clock_for("cpu", 1)


def test_calibration_measures_every_size_the_runner_can_verify() -> None:
    runner = ModelRunner(tiny_model("llama", vocab_size=64, seed=1), max_len=256, max_draft_nodes=16)
    fit = StepCostFit()
    fit.use_clock_for("cpu", 1)
    fit.calibrate(runner, reps=2)
    assert fit.calibrated and fit.clock_name == "thread_cpu"
    assert [x for x, _, _ in fit.table()] == [0, 1, 2, 3, 4, 6, 8, 12, 16]
    assert all(n == 2 for _, _, n in fit.table())
    assert runner.num_free_slots == 1  # the slot it borrowed is back
    report = fit.report()
    assert report["points"][0]["ratio_to_plain"] == 1.0 and report["clock"] == "thread_cpu"


def test_the_engine_calibrates_its_budget_and_times_every_step() -> None:
    model = tiny_model("llama", vocab_size=64, seed=1)
    engine = Engine(ModelRunner(model, num_slots=2, max_len=128, max_draft_nodes=8),
                    make_proposer("prompt_lookup"), None, EngineConfig())  # fmt: skip
    fit = engine.step_costs
    assert fit is engine.config.budget.cost_model and fit.calibrated
    calibration_steps = fit.num_observed
    result = engine.generate([5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=12, ignore_eos=True)
    assert fit.num_observed == calibration_steps + result.usage.steps
    # A fixed cost model is left alone, and a budget that does not adapt needs no calibration.
    fixed = Engine(ModelRunner(model, max_len=64), make_proposer("prompt_lookup"), None,
                   EngineConfig(budget=DraftBudget(adaptive=False)))  # fmt: skip
    assert fixed.step_costs is not None and not fixed.step_costs.calibrated
    plain = Engine(ModelRunner(model, max_len=64, max_draft_nodes=0), make_proposer("prompt_lookup"))
    assert plain.step_costs is not None and plain.step_costs.num_observed == 0
    assert len(DraftTree.empty()) == 0


def test_a_plain_step_of_a_batch_is_its_measured_plain_steps_where_there_are_enough() -> None:
    fit = StepCostFit(window=4, min_samples=2, refresh_every=1000)
    for rows, seconds in ((0, 0.010), (0, 0.010), (7, 0.014), (7, 0.014), (16, 0.020), (16, 0.020)):
        fit.observe(rows, seconds)
    for seconds in (0.060, 0.060):
        fit.observe(15, seconds, batch=8)  # drafted steps of eight: the offset prices plain ones at their median
    fit.refit()
    from_offset = fit.plain_step(8)
    assert from_offset == pytest.approx(float(fit.cost(np.asarray(7), 8)))
    fit.observe(7, 0.041, batch=8)
    fit.refit()
    assert fit.plain_step(8) == pytest.approx(float(fit.cost(np.asarray(7), 8)))  # one plain step is not enough
    fit.observe(7, 0.043, batch=8)
    fit.refit()
    assert fit.plain_step(8) == pytest.approx(0.042)  # two: their median, whatever the offset says
    assert fit.plain_step(1) == pytest.approx(0.010) and StepCostFit().plain_step(2) is None
