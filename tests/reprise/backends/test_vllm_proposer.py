"""RepriseVllmProposer's bookkeeping without vLLM: a stand-in runner holds the batch's request ids and
tags, the way vLLM's model runner does; the real engine runs in test_vllm_engine.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from reprise.backends.vllm.proposer import RepriseVllmProposer
from reprise.backends.vllm.step_cost import StepCostMeter, VllmStepCost
from reprise.backends.vllm.tags import RequestTag, StepRecord
from reprise.engine.draft_budget import DraftBudget
from retrieval.proposer import RepriseProposer

TEXT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26] * 2


class Batch:
    """What the proposer reads of vLLM's runner: ``input_batch.req_ids`` and ``requests[id]``."""

    def __init__(self) -> None:
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict[str, SimpleNamespace] = {}
        self.tokens = np.zeros((4, 1024), dtype=np.int32)
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
    """A proposer whose step-cost meter always lets drafts go (its payoff guard has its own tests)."""
    p = RepriseVllmProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k)))
    p.attach(batch, tenants, chain_factor=2, stall_timeout_s=1.0, budget=DraftBudget(max_draft_tokens=k, adaptive=False))
    p.step_cost = StepCostMeter(guard=False)
    return p


def _one_request(k: int = 8) -> tuple[RepriseVllmProposer, Batch]:
    """A proposer over a batch of one request, ``r1`` of tenant acme, whose history holds ``TEXT``."""
    tenants = RepriseProposer()
    tenants.record("acme", "old", [1, 2, 3], TEXT)
    batch = Batch()
    batch.add("r1", RequestTag("acme", "s1"), [1, 2, 3])
    return _proposer(batch, tenants, k), batch


def _decode(p: RepriseVllmProposer, batch: Batch, target: list[int], steps: int = 40) -> list[list[int]]:
    """Greedy chain verification of row 0 against ``target`` (accepted prefix + one bonus token)."""
    drafts: list[list[int]] = []
    batch.commit(0, target[:1])  # the prefill step's token
    pos, step = 1, target[:1]
    for _ in range(steps):
        out = p.propose([list(step)], batch.lengths, batch.tokens)
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
    p, batch = _one_request()
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


def test_the_step_cost_meter_tells_requests_from_draft_tokens_and_waits_for_enough_steps():
    from reprise.backends.vllm.step_cost import StepCostMeter

    def cost(batch: int, drafts: int) -> float:  # a request reads its KV: dearer than a draft token
        return 0.02 + 0.01 * batch + 0.001 * drafts + (0.004 if drafts else 0.0)

    meter = StepCostMeter(min_steps=16)
    rng = np.random.default_rng(0)
    for i in range(15):
        meter.observe(1, 8 + i % 9, cost(1, 8 + i % 9))
    assert meter.fit() is None  # too few steps yet
    for _ in range(300):
        batch, drafts = int(rng.integers(1, 9)), int(rng.integers(0, 40)) * int(rng.random() < 0.7)
        meter.observe(batch, drafts, cost(batch, drafts) + float(rng.normal(0, 1e-5)))
    meter.observe(2, 10, 60.0)  # an idle gap is not a step
    fit = meter.fit()
    assert fit is not None
    assert fit.plain_step(8) == pytest.approx(cost(8, 0), rel=0.02)  # the savings estimate's plain step
    assert fit.per_draft == pytest.approx(0.001, rel=0.05) and fit.drafted == pytest.approx(0.004, rel=0.1)
    model = fit.cost_model(4)  # by rows beyond the first, for 4 requests: none, then one draft token each
    assert model.cost(np.array([3.0]))[0] == pytest.approx(cost(4, 0), rel=0.02)
    assert model.cost(np.array([7.0]))[0] == pytest.approx(cost(4, 4), rel=0.02)
    assert model.cost(np.array([11.0]))[0] == pytest.approx(cost(4, 8), rel=0.02)

    one_batch = StepCostMeter(min_steps=16)  # every step one request: its base holds the request's part
    for i in range(40):
        drafts = 0 if i % 4 == 0 else i % 20
        one_batch.observe(1, drafts, cost(1, drafts))
    assert one_batch.fit().plain_step(1) == pytest.approx(cost(1, 0), rel=0.02)

    skewed = StepCostMeter(min_steps=16)  # plain steps measured at a batch size price it as measured
    for i in range(60):
        skewed.observe(8, 0 if i % 2 else 12, 0.101 if i % 2 else 0.13)
    assert skewed.plain_step(8) == pytest.approx(0.101) and skewed.plain_step(3) is not None
    assert skewed.measured_plain() == {8: pytest.approx(0.101)}

    flat = StepCostMeter(min_steps=4)
    for _ in range(10):
        flat.observe(2, 8, 0.05)
    assert flat.fit() is None  # no spread in draft tokens: their price is unknown


def test_the_step_cost_meter_prices_a_plain_step_by_its_batchs_contexts():
    """Each request reads its whole context: a batch of long prompts costs more a step than one of short
    ones, and the plain step (fitted, or measured at a batch size and moved by the fit) follows it."""
    from reprise.backends.vllm.step_cost import StepCostMeter

    def cost(batch: int, drafts: int, context: int) -> float:
        return 0.02 + 0.005 * batch + 0.00001 * context + 0.001 * drafts + (0.004 if drafts else 0.0)

    meter = StepCostMeter(min_steps=16)
    rng = np.random.default_rng(2)
    for _ in range(400):
        batch, drafts = int(rng.integers(1, 9)), int(rng.integers(0, 30)) * int(rng.random() < 0.7)
        context = int(sum(rng.integers(300, 2500, size=batch)))  # prompts of 300 to 2,500 tokens
        meter.observe(batch, drafts, cost(batch, drafts, context), context)
    fit = meter.fit()
    assert fit is not None and fit.per_context == pytest.approx(0.00001, rel=0.05)
    for batch, context in ((1, 500), (1, 2000), (8, 4000), (8, 16000)):
        assert meter.plain_step(batch, context) == pytest.approx(cost(batch, 0, context), rel=0.02)
    assert meter.plain_step(1, 2000) > meter.plain_step(1, 500) * 1.2
    assert fit.plain_step(4) == pytest.approx(cost(4, 0, round(4 * fit.context)), rel=0.02)  # context not known

    same = StepCostMeter(min_steps=16)  # every request 1,000 tokens: the context tells nothing apart
    for i in range(60):
        batch, drafts = 1 + i % 8, (i % 5) * 3
        same.observe(batch, drafts, cost(batch, drafts, 1000 * batch), 1000 * batch)
    assert same.fit().per_context == 0.0 and same.plain_step(4) == pytest.approx(cost(4, 0, 4000), rel=0.02)
    growing = StepCostMeter(min_steps=16)  # 1,500-token prompts that grow by what they decode: still too alike
    for i in range(200):
        batch, drafts, context = 1 + i % 8, (i % 5) * 3, 1500 + i % 128
        growing.observe(batch, drafts, cost(batch, drafts, context * batch), context * batch)
    assert growing.fit().per_context == 0.0


def test_steady_steps_give_the_cut_its_step_cost():
    p, batch = _one_request()
    p._budget = DraftBudget(max_draft_tokens=8)
    p.step_cost = StepCostMeter(min_steps=4, min_spread=0.01, guard=False)
    rng = np.random.default_rng(1)
    for _ in range(70):  # one token per step, alternating text the history knows and noise
        p.propose([[1]], batch.lengths, batch.tokens)
        batch.commit(0, [int(rng.integers(30, 40))] if rng.random() < 0.5 else TEXT[:1])
    assert p.step_cost.num_steps >= 64 and p.step_cost.cost is not None  # the cut prices drafts by it
    # A request of another tenant, whose history knows the text: what it sends depends on the step cost
    # alone (the noise taught r1's tenant, through cuts on measured times, to draft little).
    p.tenants.record("beta", "old", [1, 2, 3], TEXT)
    batch = Batch()
    batch.add("r2", RequestTag("beta", "s"), [1, 2, 3])
    p.runner = batch
    batch.commit(0, TEXT[:4])  # a sure chain follows
    p.step_cost._cut_cost = VllmStepCost(0.01, 0.002, 10.0, 0.0)  # a draft token dearer than any step
    assert p.propose([TEXT[:4]], batch.lengths, batch.tokens) == [[]]
    batch.commit(0, TEXT[4:5])
    p.step_cost._cut_cost = VllmStepCost(0.01, 0.002, 0.0, 0.0)  # free: every token that may pass goes
    assert len(p.propose([TEXT[4:5]], batch.lengths, batch.tokens)[0]) > 1


def test_the_cut_prices_a_drafted_step_once_and_sends_the_steps_surest_tokens():
    from retrieval.draft_tree import DraftTree

    cost = VllmStepCost(base=0.02, per_request=0.01, per_draft=0.001, drafted=0.004)
    assert list(cost.cut([np.array([0.9, 0.8, 0.5, 0.1])], 1)) == [4]  # even 0.1 token beats the step's rate
    # One unsure token among 8 requests: the drafted step's overhead is the step's, not an eighth of it.
    # Each request weighing its own share (as if all 8 drafted) would send it.
    assert list(cost.cut([np.array([0.3])], 8)) == [0]
    chain = DraftTree.chain(np.array([5], dtype=np.int32), np.array([0.3]))
    assert len(DraftBudget(cost_model=cost.cost_model(8)).select(chain, 1, batch_size=8)) == 1
    dear = VllmStepCost(base=0.02, per_request=0.01, per_draft=0.004, drafted=0.004)
    assert list(dear.cut([np.array([0.95, 0.9]), np.array([0.2, 0.1])], 2)) == [2, 0]  # the surest overall
    assert list(dear.cut([np.array([0.95, 0.9]), np.array([])], 2, plain_step=0.04, overhead=0.0)) == [2, 0]
    assert list(dear.cut([], 3)) == []


def _priced(meter: StepCostMeter) -> StepCostMeter:
    """``meter`` with a known fit: a plain step of B requests costs 0.01 + 0.002 * B s, a draft token 1 ms."""
    meter._cut_cost = VllmStepCost(0.01, 0.002, 0.001, 0.0)
    return meter


def test_each_step_is_priced_by_rows_against_its_tokens_plain_steps_at_its_batch_size():
    """Two requests share every step: each record carries its share of the step (by rows verified) and
    its delivered tokens' plain steps of two requests (serving/savings.py)."""
    tenants = RepriseProposer()
    tenants.record("acme", "old", [1, 2, 3], TEXT)
    batch = Batch()
    batch.add("a", RequestTag("acme", "s"), [1, 2, 3])
    batch.add("b", RequestTag("acme", "s2"), [7, 8, 9])
    p = _proposer(batch, tenants)
    p.step_cost = _priced(StepCostMeter(guard=False))
    batch.commit(0, TEXT[:1])
    batch.commit(1, [40])
    drafts = p.propose([[TEXT[0]], [40]], batch.lengths, batch.tokens)  # their prompts' step: no records
    assert p.drain_steps() == [] and len(drafts[0]) >= 3 and drafts[1] == []
    batch.commit(0, TEXT[1:4])  # two of a's draft tokens accepted, and the bonus
    batch.commit(1, [41])
    call = p.step_cost.propose_seconds  # the proposer's own call, a cost of every drafted step
    p.propose([TEXT[1:4], [41]], batch.lengths, batch.tokens)
    a, b = (StepRecord.from_wire(s) for s in p.drain_steps())
    assert (a.num_draft, a.num_accepted, a.num_tokens) == (len(drafts[0]), 2, 3)
    assert (b.num_draft, b.num_accepted, b.num_tokens) == (0, 0, 1)
    step = 0.01 + 0.002 * 2 + 0.001 * len(drafts[0]) + call
    assert a.seconds == pytest.approx(step * (1 + len(drafts[0])) / (2 + len(drafts[0])))
    assert b.seconds == pytest.approx(step / (2 + len(drafts[0])))
    assert a.plain_seconds == pytest.approx(3 * 0.014 / 2) and b.plain_seconds == pytest.approx(0.014 / 2)


def test_before_a_step_cost_is_measured_steps_are_counted_but_claim_nothing():
    p, batch = _one_request()
    _decode(p, batch, TEXT)
    steps = [StepRecord.from_wire(s) for s in p.drain_steps()]
    assert steps and all(s.seconds == 0.0 and s.plain_seconds == 0.0 for s in steps)
    assert sum(s.num_tokens for s in steps) == len(TEXT) - 1  # the prompt's step's token aside


def test_tokens_past_max_tokens_are_not_counted():
    """A step that accepts drafts past the request's ``max_tokens`` wrote them to the runner's buffer;
    vLLM cuts them and the user never gets them, so they count as no tokens."""
    p, batch = _one_request()
    batch.requests["r1"].sampling_params.max_tokens = 10  # read at the request's first step
    _decode(p, batch, TEXT)  # drafts run well past 10 tokens
    steps = [StepRecord.from_wire(s) for s in p.drain_steps()]
    assert sum(s.num_tokens for s in steps) == 10 - 1  # the prompt's step's token aside
    assert sum(s.num_accepted + 1 for s in steps) > 10  # what the steps verified ran past the end


def test_the_meter_times_only_steady_steps():
    """Between two calls over the same requests, every row decoding, lies one step (less the earlier
    call's own seconds); a batch that changed, a prefilling row or an idle gap is no such step."""
    meter = StepCostMeter()
    meter.after_call(10.0, ("r1",), 3, 0.001, 600)  # r1 sent two draft tokens
    meter.on_call(10.05, ("r1",), True, 603, 3)
    assert meter.num_steps == 1
    meter.after_call(10.05, ("r1",), 1, 0.001, 603)
    meter.on_call(10.1, ("r1", "r2"), True, 900, 2)  # r2 joined
    meter.after_call(10.1, ("r1", "r2"), 2, 0.001, 900)
    meter.on_call(10.15, ("r1", "r2"), False, 900, 1)  # a row still prefilling
    meter.after_call(10.15, ("r1", "r2"), 2, 0.001, 900)
    meter.on_call(10.15 + meter.max_gap_s + 1, ("r1", "r2"), True, 900, 2)  # idle in between
    assert meter.num_steps == 1


def _steps(meter: StepCostMeter, n: int, batch: tuple[str, ...], drafted_seconds: float, drafted_tokens: int,
           plain_seconds: float) -> list[bool]:
    """``n`` steady steps the guard decides: a drafted one takes ``drafted_seconds`` and commits
    ``drafted_tokens``, an undrafted one ``plain_seconds`` and one token a request. The decisions."""
    decisions, now = [], 100.0
    meter.after_call(now, batch, len(batch), 0.0, 0)
    for _ in range(n):
        draft = meter.drafts_pay(len(batch))
        decisions.append(draft)
        meter.after_call(now, batch, len(batch) + (4 if draft else 0), 0.0, 0)
        now += drafted_seconds if draft else plain_seconds
        meter.on_call(now, batch, True, 0, drafted_tokens if draft else len(batch))
    return decisions


def test_the_payoff_guard_stops_drafting_where_drafted_steps_measure_slower():
    batch = ("r1", "r2")
    slow = StepCostMeter()  # a drafted step: 3 tokens in 0.02 s; a plain one: 2 in 0.01 s
    decisions = _steps(slow, 400, batch, 0.02, 3, 0.01)
    assert decisions[:16].count(True) == 8  # both sides measured first, one step each in turn
    late = decisions[100:]
    assert late.count(True) == len(late) // slow.payoff.probe_every  # one probe in probe_every still drafts
    assert slow.payoff.rested_steps > 0
    fast = StepCostMeter()  # a drafted step: 6 tokens in 0.012 s
    late = _steps(fast, 400, batch, 0.012, 6, 0.01)[100:]
    assert late.count(False) == len(late) // fast.payoff.probe_every  # one plain probe in probe_every
    assert all(StepCostMeter(guard=False).drafts_pay(2) for _ in range(3))


@pytest.mark.parametrize("preempted", [True, False])
def test_a_chain_dropped_by_a_preemption_counts_neither_accepted_nor_rejected(preempted):
    """vLLM clears a preempted request's draft; when it resumes (its KV recomputed: the runner's state
    says fewer tokens computed than the session has seen) its first step verified no draft, and the
    session goes on drafting. Without the preemption the same step rejected the whole chain."""
    p, batch = _one_request()
    batch.commit(0, TEXT[:1])
    [chain] = p.propose([TEXT[:1]], batch.lengths, batch.tokens)  # its first step: a chain from acme's history
    assert len(chain) > 0
    p.drain_steps()
    if preempted:
        batch.requests["r1"].num_computed_tokens = 0  # recomputed from the start (no cached block)
    batch.commit(0, TEXT[1:2])  # one token: the step's own (the chain was not verified, or not accepted)
    [again] = p.propose([TEXT[1:2]], batch.lengths, batch.tokens)
    [step] = [StepRecord.from_wire(s) for s in p.drain_steps()]
    assert (step.num_draft, step.num_accepted) == ((0, 0) if preempted else (len(chain), 0))
    assert len(again) > 0
