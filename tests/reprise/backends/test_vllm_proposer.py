"""RepriseVllmProposer's bookkeeping without vLLM: a stand-in runner holds the batch's request ids and
tags, the way vLLM's model runner does; the real engine runs in test_vllm_engine.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from reprise.backends.vllm.proposer import RepriseVllmProposer
from reprise.backends.vllm.tags import RequestTag, StepRecord
from reprise.engine.draft_budget import DraftBudget
from retrieval.proposer import RepriseProposer

TEXT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26] * 2


class Batch:
    """What the proposer reads of vLLM's runner: ``input_batch.req_ids`` and ``requests[id]``."""

    def __init__(self) -> None:
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict[str, SimpleNamespace] = {}
        self.tokens = np.zeros((4, 256), dtype=np.int32)
        self.lengths = np.zeros(4, dtype=np.int64)

    def add(self, req_id: str, tag: RequestTag | None, prompt: list[int]) -> None:
        row = len(self.input_batch.req_ids)
        self.input_batch.req_ids.append(req_id)
        self.requests[req_id] = SimpleNamespace(
            num_prompt_tokens=len(prompt), sampling_params=SimpleNamespace(extra_args=tag.to_extra_args() if tag else None))
        self.tokens[row, :len(prompt)] = prompt
        self.lengths[row] = len(prompt)

    def commit(self, row: int, ids: list[int]) -> None:
        n = int(self.lengths[row])
        self.tokens[row, n:n + len(ids)] = ids
        self.lengths[row] = n + len(ids)


def _proposer(batch: Batch, tenants: RepriseProposer, k: int = 8) -> RepriseVllmProposer:
    p = RepriseVllmProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k)))
    p.attach(batch, tenants, chain_factor=2, stall_timeout_s=1.0, budget=DraftBudget(max_draft_tokens=k, adaptive=False))
    return p


def _decode(p: RepriseVllmProposer, batch: Batch, target: list[int], steps: int = 40) -> list[list[int]]:
    """Greedy chain verification of row 0 against ``target`` (accepted prefix + one bonus token)."""
    drafts: list[list[int]] = []
    pos, draft = 0, []
    batch.commit(0, target[:1])  # the prefill step's token
    pos = 1
    for _ in range(steps):
        out = p.propose([[1]], batch.lengths, batch.tokens)
        draft = out[0]
        drafts.append(draft)
        k = 0
        while k < len(draft) and pos + k < len(target) and draft[k] == target[pos + k]:
            k += 1
        step = target[pos:pos + k + 1]
        if not step:
            break
        batch.commit(0, step)
        pos += len(step)
    return drafts


def test_steps_carry_the_tenant_and_exact_accept_counts():
    tenants = RepriseProposer()
    tenants.record("acme", "old", [1, 2, 3], TEXT)
    batch = Batch()
    batch.add("r1", RequestTag("acme", "s1"), [1, 2, 3])
    p = _proposer(batch, tenants)
    drafts = _decode(p, batch, TEXT)
    steps = [StepRecord.from_wire(s) for s in p.drain_steps()]
    assert {s.tenant for s in steps} == {"acme"}
    assert any(len(d) for d in drafts) and all(len(d) <= 8 for d in drafts)
    assert sum(s.num_accepted for s in steps) + len(steps) >= len(TEXT) - 2  # every token counted once
    assert all(s.num_accepted <= s.num_draft for s in steps)
    assert p.drain_steps() == []


def test_untagged_and_speculation_off_requests_draft_nothing():
    tenants = RepriseProposer()
    tenants.record("acme", "old", [1, 2, 3], TEXT)
    for tag in (None, RequestTag("acme", "s", speculate=False)):
        batch = Batch()
        batch.add("r", tag, [1, 2, 3])
        p = _proposer(batch, tenants)
        assert not any(_decode(p, batch, TEXT, steps=10))


def test_a_raising_or_stalling_step_drafts_nothing_and_warns_once(caplog):
    tenants = RepriseProposer()
    batch = Batch()
    batch.add("r", RequestTag("acme"), [1, 2, 3])
    p = _proposer(batch, tenants)

    def fail(*args):
        raise RuntimeError("boom")

    p._draft_step = fail  # type: ignore[method-assign]
    for _ in range(5):
        assert p.propose([[1]], batch.lengths, batch.tokens) == [[]]
    assert p.health.failed_steps == 5 and p.health.warnings == 1
    assert sum("drafting failed" in r.message for r in caplog.records) == 1

    p = _proposer(batch, tenants)
    p.stall_timeout_s = 0.05
    p._draft_step = lambda *args: time.sleep(0.3) or [[]]  # type: ignore[method-assign]
    assert p.propose([[1]], batch.lengths, batch.tokens) == [[]]
    assert p.propose([[1]], batch.lengths, batch.tokens) == [[]]  # the stalled call still runs: skipped
    assert p.health.stalled_steps == 1 and p.health.skipped_steps == 1 and p.health.warnings == 1


def test_an_unattached_proposer_drafts_nothing():
    p = RepriseVllmProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4)))
    assert p.propose([[1], []], np.array([3, 3]), np.zeros((2, 8), dtype=np.int32)) == [[], []]


def test_the_step_cost_meter_fits_seconds_per_row_and_waits_for_enough_steps():
    from reprise.backends.vllm.step_cost import StepCostMeter

    meter = StepCostMeter(min_steps=16)
    rng = np.random.default_rng(0)
    for i in range(15):
        meter.observe(8 + i % 9, 0.02 + 0.003 * (8 + i % 9))
    assert meter.line() is None  # too few steps yet
    for _ in range(200):
        rows = int(rng.integers(8, 40))
        meter.observe(rows, 0.02 + 0.003 * rows + float(rng.normal(0, 1e-4)))
    meter.observe(10, 60.0)  # an idle gap is not a step
    line = meter.line()
    assert line is not None
    assert line.a == pytest.approx(0.02, rel=0.1) and line.b == pytest.approx(0.003, rel=0.05)
    model = line.cost_model()
    assert model.cost(np.array([0.0]))[0] == pytest.approx(0.023, rel=0.1)  # one row: a + b

    flat = StepCostMeter(min_steps=4)
    for _ in range(10):
        flat.observe(8, 0.05)
    assert flat.line() is None  # no spread in rows: the slope is unknown


def test_steady_steps_replace_the_default_cost_model():
    from reprise.backends.vllm.step_cost import StepCostMeter

    tenants = RepriseProposer()
    tenants.record("acme", "old", [1, 2, 3], TEXT)
    batch = Batch()
    batch.add("r1", RequestTag("acme", "s1"), [1, 2, 3])
    p = _proposer(batch, tenants)
    p._budget = default = DraftBudget(max_draft_tokens=8)
    p.step_cost = StepCostMeter(min_steps=4, min_spread=0.01)
    rng = np.random.default_rng(1)
    for _ in range(70):  # one token per step, alternating text the history knows and noise
        p.propose([[1]], batch.lengths, batch.tokens)
        batch.commit(0, [int(rng.integers(30, 40))] if rng.random() < 0.5 else TEXT[:1])
    assert p.step_cost.num_steps >= 64
    assert p._budget is not default and p._budget.cost_model != default.cost_model


class FixedLine:
    """A step cost meter whose line is known: a plain step of B requests costs 0.01 + 0.002 * B s."""

    max_gap_s = 5.0
    num_steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        self.num_steps += 1

    def line(self):
        from reprise.backends.vllm.step_cost import StepCostLine

        return StepCostLine(0.01, 0.002)


def test_steady_steps_carry_their_time_and_the_plain_estimate_of_their_tokens():
    tenants = RepriseProposer()
    tenants.record("acme", "old", [1, 2, 3], TEXT)
    batch = Batch()
    batch.add("r1", RequestTag("acme", "s1"), [1, 2, 3])
    p = _proposer(batch, tenants)
    p.step_cost = FixedLine()
    _decode(p, batch, TEXT)
    steps = [StepRecord.from_wire(s) for s in p.drain_steps()]
    timed = [s for s in steps if s.num_tokens]
    assert len(timed) == len(steps) - 1  # the first call has no step before it to time
    for s in timed:  # alone in its batch: the whole step is its own; plain steps of one request each token
        assert s.num_tokens == s.num_accepted + 1 and s.seconds > 0
        assert s.plain_seconds == pytest.approx(s.num_tokens * 0.012)
    assert any(s.num_tokens > 1 for s in timed)  # drafts committed several tokens in a step


def test_a_step_that_is_not_steady_is_priced_at_its_own_time_and_teaches_the_line_nothing():
    batch = Batch()
    batch.add("r1", RequestTag("acme", "s1"), [1, 2, 3])
    p = _proposer(batch, RepriseProposer())
    p.step_cost = FixedLine()
    p._last_step = (10.0, ("r1",), 1)
    joined = p._time_step(10.25, ["r1", "r2"], [[5], [6]])  # r2 joined: its prefill is in this gap
    assert joined is not None and joined.seconds == pytest.approx(0.25) and joined.plain_step_seconds is None
    assert p.step_cost.num_steps == 0  # the cost line learns only from steady steps
    p._last_step = (20.0, ("r1", "r2"), 2)
    steady = p._time_step(20.05, ["r1", "r2"], [[5], [6]])
    assert steady is not None and steady.plain_step_seconds == pytest.approx(0.01 + 0.002 * 2)
    p._last_step = (30.0, ("r1",), 1)
    assert p._time_step(30.0 + p.step_cost.max_gap_s + 1, ["r1", "r2"], [[5], [6]]) is None  # idle, not a step
