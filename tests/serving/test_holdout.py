"""The measured speedup (serving/holdout.py): which requests are held out, and the ratio with its interval."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from serving.holdout import Z95, Holdout
from serving.records import Request


def _request(speculate: bool = True) -> Request:
    return Request.of_tokens((1, 2), tenant="t", request_id="r", max_new_tokens=8, speculate=speculate)


def test_a_share_of_drafting_requests_decodes_without_drafts() -> None:
    holdout = Holdout(0.25, random.Random(3))
    taken = [holdout.take(_request()) for _ in range(4000)]
    held = [r for r, h in taken if h]
    assert all(not r.params.speculate for r in held) and all(r.params.speculate for r, h in taken if not h)
    assert abs(len(held) / 4000 - 0.25) < 0.03
    assert holdout.take(_request(speculate=False)) == (_request(speculate=False), False)  # asked for none
    off = Holdout(0.0)
    assert not any(off.take(_request())[1] for _ in range(100))
    with pytest.raises(ValueError, match="holdout share"):
        Holdout(1.0)


def test_the_ratio_of_mean_seconds_per_token_and_its_interval() -> None:
    holdout = Holdout(0.1)
    plain = [0.10, 0.12, 0.11, 0.09, 0.13]  # seconds per token of requests without drafts
    drafted = [0.05, 0.06, 0.04, 0.05]
    for x in plain:
        holdout.record("t", True, 10, 10 * x)
    for x in drafted:
        holdout.record("t", False, 20, 20 * x)
    holdout.record("t", False, 0, 1.0)  # one token: no observation
    m = holdout.figures("t")
    ratio = statistics.mean(plain) / statistics.mean(drafted)
    half = Z95 * ratio * math.sqrt(statistics.variance(plain) / (5 * statistics.mean(plain) ** 2)
                                   + statistics.variance(drafted) / (4 * statistics.mean(drafted) ** 2))
    assert (m.held_out, m.drafted) == (5, 4)
    assert m.speedup == pytest.approx(ratio) and m.low == pytest.approx(ratio - half) and m.high == pytest.approx(ratio + half)
    assert holdout.figures("other").speedup is None
    holdout.record("u", True, 10, 1.0)
    assert holdout.figures("u").speedup is None and holdout.figures("u").held_out == 1  # two of each needed
    holdout.forget("t")
    assert holdout.figures("t").held_out == 0


def test_the_interval_covers_the_true_ratio_about_95_times_in_100() -> None:
    rng = random.Random(11)
    covered = 0
    for trial in range(400):
        holdout = Holdout(0.1)
        for _ in range(30):
            holdout.record("t", True, 1, rng.gauss(0.1, 0.02))
            holdout.record("t", False, 1, rng.gauss(0.05, 0.01))
        m = holdout.figures("t")
        covered += m.low <= 2.0 <= m.high
    assert 0.9 <= covered / 400 <= 0.99
