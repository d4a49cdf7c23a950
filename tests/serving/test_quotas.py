"""The AppendTrajectory quotas' token buckets on a fake clock: what passes, what is refused, and the
retry hint a refusal carries (a client that waits that long gets through)."""

from __future__ import annotations

import math

import pytest

from serving import errors
from serving.quotas import AppendQuotas


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_call_rate_allows_a_burst_then_hints_the_wait() -> None:
    clock, refused = Clock(), []
    quotas = AppendQuotas(calls_per_s=2, burst_calls=3, tokens_per_minute=0, clock=clock, on_refused=refused.append)
    for _ in range(3):
        quotas.admit_call("a")
    with pytest.raises(errors.ResourceExhausted, match="at most 2 calls per second") as exc:
        quotas.admit_call("a")
    assert exc.value.retry_after_s == pytest.approx(0.5) and refused == ["calls"]
    quotas.admit_call("b")  # another tenant has its own bucket
    clock.now += exc.value.retry_after_s
    quotas.admit_call("a")  # waiting the hint is enough
    with pytest.raises(errors.ResourceExhausted):
        quotas.admit_call("a")


def test_the_token_rate_refuses_what_does_not_fit_and_never_what_fits_later() -> None:
    clock = Clock()
    quotas = AppendQuotas(calls_per_s=0, burst_calls=0, tokens_per_minute=600, clock=clock)
    quotas.admit_tokens("a", 400)
    with pytest.raises(errors.ResourceExhausted, match="at most 600 tokens per minute") as exc:
        quotas.admit_tokens("a", 400, "content")
    assert exc.value.retry_after_s == pytest.approx(20.0) and exc.value.param == "content"
    quotas.admit_tokens("a", 200)  # a refusal took nothing: the 200 left are still there
    clock.now += 40.0
    quotas.admit_tokens("a", 400)
    with pytest.raises(errors.ResourceExhausted, match="more than a tenant may add in a minute") as exc:
        quotas.admit_tokens("b", 601)
    assert exc.value.retry_after_s == 60.0


def test_zero_turns_a_quota_off_and_bad_settings_are_refused() -> None:
    quotas = AppendQuotas(calls_per_s=0, burst_calls=0, tokens_per_minute=0)
    for _ in range(10_000):
        quotas.admit_call("a")
    quotas.admit_tokens("a", 10**9)
    with pytest.raises(ValueError, match="burst_calls must be >= 1"):
        AppendQuotas(calls_per_s=1, burst_calls=0, tokens_per_minute=0)
    with pytest.raises(ValueError, match=">= 0"):
        AppendQuotas(calls_per_s=-1, burst_calls=1, tokens_per_minute=0)


def test_the_defaults_take_an_agent_and_refuse_a_flood() -> None:
    """Defaults (server.append_*): an agent appending a 4k-token turn every second for a minute passes;
    three 4M-token turns in 34 s (the attack in issue 22) are refused."""
    from serving.prepare import ServingSettings

    s = ServingSettings()
    clock = Clock()
    quotas = AppendQuotas(s.append_calls_per_s, s.append_burst_calls, s.append_tokens_per_minute, clock=clock)
    for _ in range(60):
        quotas.admit_call("agent")
        quotas.admit_tokens("agent", 4_000)
        clock.now += 1.0
    for _ in range(3):
        with pytest.raises(errors.ResourceExhausted) as exc:
            quotas.admit_tokens("attacker", 4_000_000)
        assert not math.isinf(exc.value.retry_after_s)
        clock.now += 11.0
