"""serving.savings: the estimate's arithmetic on constructed observations (known costs, known speedup)."""

from __future__ import annotations

import pytest

from serving.savings import RequestCost, Savings, attribute_prefill, attribute_step


def test_a_step_is_shared_by_rows_and_priced_by_plain_steps() -> None:
    # Two requests in a 0.3 s step: 1 + 4 rows (4 draft nodes, 3 accepted: 4 tokens) and 1 row (1 token).
    # A plain step of 2 requests costs 0.1 s: 4 tokens would have taken 4 such steps, half of each theirs.
    first, second = attribute_step(0.3, [5, 1], [4, 1], plain_step_seconds=0.1)
    assert first.seconds == pytest.approx(0.25) and second.seconds == pytest.approx(0.05)
    assert first.plain_seconds == pytest.approx(4 * 0.1 / 2) and second.plain_seconds == pytest.approx(0.1 / 2)


def test_without_a_cost_model_a_step_counts_as_no_saving() -> None:
    (only,) = attribute_step(0.2, [3], [2], plain_step_seconds=None)
    assert only.seconds == only.plain_seconds == pytest.approx(0.2)
    assert attribute_prefill(0.4, None) == RequestCost(0.4, 0.4)
    with pytest.raises(ValueError, match="differ in length"):
        attribute_step(0.2, [3, 1], [2], 0.1)


def test_a_cached_prompt_token_saves_its_prefill_price() -> None:
    assert attribute_prefill(0.5, 0.6) == RequestCost(0.5, pytest.approx(0.5 + 0.6))


def test_known_costs_give_a_known_speedup() -> None:
    """A tenant decodes 100 tokens in 25 steps of 0.12 s alone (plain steps cost 0.1 s) after a 1 s
    prefill that found 400 tokens cached at 2 ms each: 4 s spent against 10 + 1.8 s without Reprise."""
    s = Savings()
    s = s.add_prefill(attribute_prefill(1.0, 400 * 0.002))
    for _ in range(25):
        (cost,) = attribute_step(0.12, [1 + 6], [4], plain_step_seconds=0.1)
        s = s.add_step(cost, 4)
    assert s.seconds == pytest.approx(4.0) and s.plain_seconds == pytest.approx(11.8)
    assert s.speedup == pytest.approx(11.8 / 4.0)
    assert s.seconds_saved_drafts == pytest.approx(10.0 - 3.0)
    assert s.seconds_saved_cache == pytest.approx(0.8)
    assert s.seconds_saved == pytest.approx(7.8)
    assert s.tokens_per_second == pytest.approx(100 / 4.0)
    figures = s.figures()
    assert figures["speedup"] == s.speedup and figures["seconds_saved_cache"] == s.seconds_saved_cache


def test_drafts_that_cost_more_than_they_save_show_a_slowdown() -> None:
    s = Savings()
    for _ in range(10):  # 0.2 s steps of 1 + 8 rows that commit 1 token each; a plain step costs 0.1 s
        (cost,) = attribute_step(0.2, [9], [1], plain_step_seconds=0.1)
        s = s.add_step(cost, 1)
    assert s.speedup == pytest.approx(0.5) and s.seconds_saved_drafts == pytest.approx(-1.0)


def test_an_interval_is_the_difference_of_two_samples() -> None:
    before = Savings(1.0, 2.0, 0.5, 0.5, 10)
    after = Savings(3.0, 8.0, 1.5, 2.5, 50)
    interval = after - before
    assert interval == Savings(2.0, 6.0, 1.0, 2.0, 40)
    assert interval.speedup == pytest.approx(8.0 / 3.0)
    assert Savings().speedup is None and Savings().tokens_per_second is None
