"""The tenant acceptance monitor: suspends drafting on collapse, probes, recovers."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval.policy import AcceptanceMonitor, MonitorConfig
from retrieval.proposer import RepriseProposer


def test_defaults_keep_drafting_while_drafts_are_accepted() -> None:
    m = AcceptanceMonitor()
    for _ in range(500):
        m.observe(expected=3.0, accepted=3)
    assert not m.suspended and m.budget(32) == 32 and m.ratio == pytest.approx(1.0)


def test_collapse_suspends_then_probes_then_recovers() -> None:
    m = AcceptanceMonitor(MonitorConfig(threshold=0.2, min_steps=10, decay=0.9, probe_every=4, probe_budget=2))
    for _ in range(9):
        m.observe(expected=4.0, accepted=0)
    assert not m.suspended  # not enough evidence yet
    m.observe(expected=4.0, accepted=0)
    assert m.suspended
    budgets = [m.budget(32) for _ in range(8)]
    assert budgets == [0, 0, 0, 2, 0, 0, 0, 2]  # a small probe every 4 steps
    for _ in range(60):  # the probes start to pay off again
        m.observe(expected=1.0, accepted=1)
    assert not m.suspended and m.budget(32) == 32


def test_threshold_zero_never_suspends_and_bad_configs_fail() -> None:
    m = AcceptanceMonitor(MonitorConfig(threshold=0.0, min_steps=1))
    for _ in range(100):
        m.observe(expected=5.0, accepted=0)
    assert m.budget(16) == 16
    m.observe(expected=0.0, accepted=0)  # empty drafts are not evidence
    with pytest.raises(ValueError):
        MonitorConfig(threshold=1.5)
    with pytest.raises(ValueError):
        MonitorConfig(decay=1.0)
    with pytest.raises(ValueError):
        MonitorConfig(probe_every=0)


def test_proposer_stops_drafting_for_a_collapsed_tenant() -> None:
    p = RepriseProposer()
    monitor = p.history("t").monitor
    for _ in range(200):
        monitor.observe(expected=5.0, accepted=0)
    s = p.begin("t", "s", np.array([1, 2, 3, 1, 2], dtype=np.int32))
    sizes = [len(s.propose(16)) for _ in range(16)]
    assert sizes.count(0) >= 14 and max(sizes) <= monitor.config.probe_budget
