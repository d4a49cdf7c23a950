"""PlainSchedule: the batches a plain engine would have decoded the drafted run's requests in."""

from __future__ import annotations

import pytest

from serving.plain_schedule import PlainSchedule


def price(batch_size: int, context_tokens: int) -> float:
    """A plain step of B requests: 1 s plus 0.1 s a request (their contexts aside)."""
    return 1.0 + 0.1 * batch_size


def _costs(ended: list[tuple[str | None, float, float]]) -> list[float]:
    return [plain for _, plain, _ in ended]


def test_a_request_that_drafts_well_spends_its_last_plain_steps_alone():
    """Three requests arrive together; with drafts the long one took 5 tokens a step alongside the
    short ones' 1. Without drafts the short ones end after 2 steps and the long one runs 8 more alone,
    where a step is dearest per token (holding the drafted batch would price all 10 at a third of 1.3 s)."""
    s = PlainSchedule(max_batch=8)
    for key in "abc":
        s.arrive(key, key, "", 0.0)  # each its own tenant, to tell them apart
    for t in (1.0, 2.0):  # two drafted steps
        s.deliver("a", 5, 0.5, t)
        s.deliver("b", 1, 0.5, t)
        s.deliver("c", 1, 0.5, t)
    for key in "abc":
        s.finish(key)
    ended = {tenant: plain for tenant, plain, _ in s.advance(price)}
    assert ended["b"] == ended["c"] == pytest.approx(2 * 1.3 / 3)
    assert ended["a"] == pytest.approx(2 * 1.3 / 3 + 8 * 1.1)
    assert len(s) == 0


def test_a_request_to_an_idle_engine_waits_for_every_earlier_plain_end():
    """Nothing was in flight when it came, so it may be the client's answer to what finished: it reaches
    the plain engine as long after the others' plain end as it came after their drafted end."""
    s = PlainSchedule(max_batch=8)
    s.arrive("a", "acme", "", 0.0)
    s.deliver("a", 10, 1.0, 1.0)
    s.finish("a")
    s.arrive("b", "acme", "", 3.0)  # idle since 1.0: 2 s later
    s.deliver("b", 10, 1.0, 4.0)
    s.finish("b")
    assert _costs(s.advance(price)) == pytest.approx([11.0, 11.0])  # each alone: 10 steps of 1.1 s
    assert s._ended["b"][1:] == pytest.approx((11.0 + 2.0, 11.0 + 2.0 + 11.0))  # (plain start, plain end)


def test_requests_that_arrive_on_their_own_keep_their_offset_into_the_busy_period():
    s = PlainSchedule(max_batch=8)
    s.arrive("a", "acme", "", 0.0)
    s.arrive("b", "acme", "", 0.5)  # a is in flight: b came on its own, 0.5 s into the period
    for key in "ab":
        s.deliver(key, 4, 0.5, 1.0)
        s.finish(key)
    s.advance(price)
    assert s._ended["b"][1] == pytest.approx(0.5)
    # a's first step (1.1 s, alone) ends at 1.1; b joins then: three steps of two, and b's last one alone
    assert s._ended["a"][2] == pytest.approx(1.1 + 3 * 1.2)
    assert s._ended["b"][2] == pytest.approx(1.1 + 3 * 1.2 + 1.1)


def test_an_agent_sessions_next_call_follows_its_previous_calls_plain_end():
    """Another request keeps the engine busy, but the session's next call waits on its previous one:
    it reaches the plain engine as long after that one's plain end as the agent took with drafts."""
    s = PlainSchedule(max_batch=8)
    s.arrive("first", "acme", "agent-1", 0.0)
    s.arrive("other", "acme", "", 0.0)
    s.deliver("first", 4, 0.2, 0.4)
    s.finish("first")
    s.arrive("next", "acme", "agent-1", 0.9)  # 0.5 s after its previous call ended
    s.deliver("next", 2, 0.2, 1.2)
    s.finish("next")
    s.deliver("other", 40, 2.0, 2.0)
    s.finish("other")
    s.advance(price)
    first_end = 4 * 1.2  # four steps of two
    assert s._ended["first"][2] == pytest.approx(first_end)
    assert s._ended["next"][1] == pytest.approx(first_end + 0.5)
    other = PlainSchedule(max_batch=8)  # the same call of another session came on its own: at 0.9
    other.arrive("first", "acme", "agent-1", 0.0)
    other.arrive("other", "acme", "", 0.0)
    other.arrive("next", "acme", "agent-2", 0.9)
    assert other._runs["next"].origin == "first" and other._runs["next"].delay == pytest.approx(0.9)


def test_at_most_max_batch_requests_share_a_plain_step_and_the_rest_queue_in_arrival_order():
    s = PlainSchedule(max_batch=2)
    for key in "abc":
        s.arrive(key, "acme", "", 0.0)
        s.deliver(key, 3, 0.3, 1.0)
        s.finish(key)
    ended = {k: (c, s._ended[k][2]) for (k, c) in zip("abc", _costs(s.advance(price)))}
    assert ended["a"] == ended["b"] == pytest.approx((3 * 1.2 / 2, 3 * 1.2))
    assert ended["c"] == pytest.approx((3 * 1.1, 3 * 1.2 + 3 * 1.1))  # alone, once a slot freed


def test_a_plain_step_waits_until_the_drafted_run_has_delivered_its_tokens():
    s = PlainSchedule(max_batch=8)
    s.arrive("a", "acme", "", 0.0)
    s.arrive("b", "acme", "", 0.0)
    s.deliver("a", 3, 0.3, 1.0)
    s.deliver("b", 1, 0.3, 1.0)
    assert s.advance(price) == [] and s._runs["a"].done == 1  # b's second token is not out yet
    s.finish("a")
    s.deliver("b", 2, 0.3, 2.0)
    s.finish("b")
    assert _costs(s.advance(price)) == pytest.approx([3 * 1.2 / 2] * 2)


def test_without_a_price_nothing_is_stepped_and_a_flush_gives_the_finished_their_own_time():
    s = PlainSchedule(max_batch=8)
    s.arrive("a", "acme", "", 0.0)
    s.arrive("b", None, "", 0.0)  # no tenant accounted: it still takes a place
    s.arrive("c", "acme", "", 0.0)
    s.deliver("a", 5, 0.7, 1.0)
    s.deliver("b", 5, 0.7, 1.0)
    s.deliver("c", 5, 0.7, 3.0)
    s.finish("a")
    s.finish("b")
    assert s.advance(lambda batch, context: None) == []
    assert s.flush(before=2.0) == [("acme", 0.7, 0.7), (None, 0.7, 0.7)]  # c still runs
    s.finish_all()
    assert s.flush(before=float("inf")) == [("acme", 0.7, 0.7)] and len(s) == 0


def test_a_request_that_ended_at_its_prefill_decodes_nothing_without_drafts_either():
    s = PlainSchedule(max_batch=8)
    s.arrive("a", "acme", "", 0.0)
    s.finish("a")
    assert s.advance(price) == [("acme", 0.0, 0.0)]


def test_the_batch_limit_is_checked():
    with pytest.raises(ValueError, match="max_batch must be at least 1, got 0"):
        PlainSchedule(max_batch=0)


def test_a_schedule_that_falls_too_far_behind_lets_its_oldest_finished_requests_go(monkeypatch):
    import serving.plain_schedule as module

    monkeypatch.setattr(module, "MAX_RUNS", 2)
    s = PlainSchedule(max_batch=8)
    for i, key in enumerate("abc"):
        s.arrive(key, "acme", "", float(i))
        s.deliver(key, 2, 0.25 * (i + 1), float(i) + 0.5)
    s.finish("b")
    s.finish("c")
    assert s.trim() == [("acme", 0.5, 0.5)] and len(s) == 2 and s.trim() == []  # b, at its own time


def test_a_prefill_keeps_the_plain_engine_busy_before_the_requests_decode_together():
    """Three requests scheduled together, each prefilled in 2 s: without drafts as with them the engine
    prefills all three (6 s) before the three decode side by side."""
    s = PlainSchedule(max_batch=8)
    for key in "abc":
        s.arrive(key, "acme", "", 0.0, prefill_seconds=2.0)
        s.deliver(key, 2, 0.2, 7.0)
        s.finish(key)
    assert _costs(s.advance(price)) == pytest.approx([2 * 1.3 / 3] * 3)  # prefill is not the schedule's
    assert s._ended["a"][2] == pytest.approx(6.0 + 2 * 1.3)


def test_a_plain_step_is_priced_at_its_batchs_contexts_as_they_grow():
    seen = []

    def by_context(batch_size: int, context_tokens: int) -> float:
        seen.append((batch_size, context_tokens))
        return 1.0

    s = PlainSchedule(max_batch=8)
    s.arrive("a", "acme", "", 0.0, context_tokens=100)
    s.arrive("b", "acme", "", 0.0, context_tokens=500)
    s.deliver("a", 2, 0.1, 1.0)
    s.deliver("b", 3, 0.1, 1.0)
    s.finish_all()
    s.advance(by_context)
    assert seen == [(2, 600), (2, 602), (1, 502)]
