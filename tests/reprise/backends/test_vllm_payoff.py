"""The payoff guard (reprise/backends/vllm/payoff.py): drafting stops at a batch size where drafted steps
deliver fewer tokens per second than undrafted ones, and comes back when that changes."""

from __future__ import annotations

import pytest

from reprise.backends.vllm.payoff import PayoffGuard


def _run(guard: PayoffGuard, steps: int, batch: int, drafted: tuple[int, float], plain: tuple[int, float]) -> list[bool]:
    """``steps`` decisions at ``batch``, each observed as ``drafted`` or ``plain`` (tokens, seconds)."""
    out = []
    for _ in range(steps):
        draft = guard.drafts_pay(batch)
        guard.observe(batch, draft, *(drafted if draft else plain))
        out.append(draft)
    return out


def test_both_sides_are_measured_first_then_the_faster_wins_with_probes() -> None:
    guard = PayoffGuard(min_steps=8, probe_every=16)
    slow = _run(guard, 200, 4, drafted=(6, 0.04), plain=(4, 0.02))  # 150 vs 200 tokens/s
    assert slow[:16].count(True) == 8
    assert slow[100:].count(True) == 100 // 16 and guard.rested_steps > 0
    assert guard.rates()[4] == pytest.approx((150.0, 200.0))
    fast = _run(guard, 400, 4, drafted=(12, 0.04), plain=(4, 0.02))  # drafts now pay: 300 tokens/s
    assert fast[-100:].count(False) == 100 // 16  # back to drafting, one plain probe in 16
    other = _run(guard, 16, 2, drafted=(6, 0.04), plain=(4, 0.02))  # another batch size learns on its own
    assert other.count(True) == 8


def test_a_disabled_guard_always_drafts_and_bad_settings_are_refused() -> None:
    guard = PayoffGuard(enabled=False)
    assert all(_run(guard, 50, 1, drafted=(1, 1.0), plain=(1, 0.01)))
    with pytest.raises(ValueError, match="decay"):
        PayoffGuard(decay=1.0)
    with pytest.raises(ValueError, match="min_steps"):
        PayoffGuard(probe_every=1)
