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
        self.tokens = np.zeros((4, 1024), dtype=np.int32)
        self.lengths = np.zeros(4, dtype=np.int64)

    def add(self, req_id: str, tag: RequestTag | None, prompt: list[int]) -> None:
        row = len(self.input_batch.req_ids)
        self.input_batch.req_ids.append(req_id)
        self.requests[req_id] = SimpleNamespace(
            num_prompt_tokens=len(prompt), sampling_params=SimpleNamespace(extra_args=tag.to_extra_args() if tag else None))
        self.tokens[row, :len(prompt)] = prompt
        self.lengths[row] = len(prompt)

    def execute_model(self, scheduler_output: SimpleNamespace) -> None:
        """vLLM runs a step here; the proposer wraps it to time its steps."""

    def commit(self, row: int, ids: list[int]) -> None:
        n = int(self.lengths[row])
        self.tokens[row, n:n + len(ids)] = ids
        self.lengths[row] = n + len(ids)


def _proposer(batch: Batch, tenants: RepriseProposer, k: int = 8) -> RepriseVllmProposer:
    p = RepriseVllmProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k)))
    p.attach(batch, tenants, chain_factor=2, stall_timeout_s=1.0, budget=DraftBudget(max_draft_tokens=k, adaptive=False))
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


def test_steady_steps_replace_the_default_cost_model():
    from reprise.backends.vllm.step_cost import StepCostMeter, VllmStepCost

    p, batch = _one_request()
    p._budget = DraftBudget(max_draft_tokens=8)
    p.step_cost = StepCostMeter(min_steps=4, min_spread=0.01)
    rng = np.random.default_rng(1)
    for _ in range(70):  # one token per step, alternating text the history knows and noise
        p.propose([[1]], batch.lengths, batch.tokens)
        batch.commit(0, [int(rng.integers(30, 40))] if rng.random() < 0.5 else TEXT[:1])
    assert p.step_cost.num_steps >= 64 and p._cost is not None  # the cut prices drafts by what was measured
    batch.commit(0, TEXT[:4])  # text the history knows: a sure chain
    p._cost = VllmStepCost(0.01, 0.002, 10.0, 0.0)  # a draft token dearer than any step
    assert p.propose([[1]], batch.lengths, batch.tokens) == [[]]
    batch.commit(0, TEXT[4:5])
    p._cost = VllmStepCost(0.01, 0.002, 0.0, 0.0)  # free: every token that may pass goes
    assert len(p.propose([[1]], batch.lengths, batch.tokens)[0]) > 1


def test_the_cut_prices_a_drafted_step_once_and_sends_the_steps_surest_tokens():
    from reprise.backends.vllm.step_cost import VllmStepCost
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


class FixedLine:
    """A step cost meter whose fit is known: a plain step of B requests costs 0.01 + 0.002 * B s."""

    max_gap_s = 5.0
    num_steps = 0

    def observe(self, batch_size: int, draft_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        self.num_steps += 1

    def observe_propose(self, seconds: float) -> None:
        pass

    def fit(self):
        from reprise.backends.vllm.step_cost import VllmStepCost

        return VllmStepCost(0.01, 0.002, 0.001, 0.0)

    def plain_step(self, batch_size: int, context_tokens: float | None = None) -> float:
        return self.fit().plain_step(batch_size)


def test_timed_steps_carry_their_tokens_and_time_and_the_plain_schedule_prices_the_tokens():
    """Each timed step records the request's tokens and its share of the step's seconds; what the tokens
    would have cost without drafts comes from the plain schedule (serving/plain_schedule.py) as a
    ``late`` record once the request's plain run has ended."""
    p, batch = _one_request()
    p.step_cost = FixedLine()
    _decode(p, batch, TEXT)
    steps = [StepRecord.from_wire(s) for s in p.drain_steps()]
    timed = [s for s in steps if s.num_tokens]
    assert len(timed) == len(steps) - 1  # the first call has no step before it to time
    for s in timed:  # alone in its batch: the whole step is its own
        assert s.num_tokens == s.num_accepted + 1 and s.seconds > 0 and s.plain_seconds == 0.0
    assert any(s.num_tokens > 1 for s in timed)  # drafts committed several tokens in a step
    assert not any(s.late for s in steps)  # still running: its plain run has not ended
    late = [StepRecord.from_wire(s) for s in p.drain_steps(held=True)]  # the pass is over
    assert len(late) == 1 and late[0].late and late[0].tenant == "acme" and late[0].num_tokens == 0
    # alone: one plain step of one request (0.012 s) per token it was delivered
    assert late[0].plain_seconds == pytest.approx(sum(s.num_tokens for s in timed) * 0.012)


def test_tokens_past_the_end_of_an_output_are_not_counted():
    """A step that accepts drafts past the request's end (its EOS, or max_tokens) wrote them to the
    runner's buffer; vLLM cuts them and the user never gets them, so they count as no tokens."""
    from reprise.backends.vllm.proposer import _Stopping

    params = SimpleNamespace(max_tokens=6, min_tokens=0, stop_token_ids=[9], eos_token_id=2, ignore_eos=False)
    stop = _Stopping.of(params)
    assert stop.deliver(np.array([5, 6, 7])) == 3 and stop.deliver(np.array([8, 2, 4, 4])) == 2  # EOS ends it
    assert stop.deliver(np.array([4])) == 0
    longest = _Stopping.of(SimpleNamespace(max_tokens=4, min_tokens=0, stop_token_ids=None, eos_token_id=2,
                                           ignore_eos=True))
    assert longest.deliver(np.array([2, 2, 2])) == 3 and longest.deliver(np.array([2, 2])) == 1  # max_tokens
    early = _Stopping.of(SimpleNamespace(max_tokens=None, min_tokens=3, stop_token_ids=[9], eos_token_id=None))
    assert early.deliver(np.array([9, 9, 9, 9, 9])) == 4  # a stop before min_tokens does not stop
    assert _Stopping.of(None) is None and _Stopping.of(SimpleNamespace(extra_args=None)) is None

    p, batch = _one_request()
    batch.requests["r1"].sampling_params.max_tokens = 10  # read at the request's first step
    p.step_cost = FixedLine()
    _decode(p, batch, TEXT)  # drafts run well past 10 tokens
    steps = [StepRecord.from_wire(s) for s in p.drain_steps()]
    assert sum(s.num_tokens for s in steps) == 10 - 1  # the first, untimed here (no step before it), aside
    assert sum(s.num_accepted + 1 for s in steps[1:]) > 10  # what the steps verified ran past the end


class ColdLine(FixedLine):
    """``FixedLine`` once ``measured``; before, no step cost (the meter's first ``min_steps`` steps)."""

    measured = False

    def fit(self):
        return super().fit() if self.measured else None

    def plain_step(self, batch_size: int, context_tokens: float | None = None) -> float | None:
        return super().plain_step(batch_size) if self.measured else None


def _finished_request(cold: FixedLine) -> tuple[RepriseVllmProposer, list[StepRecord]]:
    """``_one_request`` run to its ``max_tokens`` (10) under step cost meter ``cold``; its step records."""
    p, batch = _one_request()
    batch.requests["r1"].sampling_params.max_tokens = 10
    p.step_cost = cold
    _decode(p, batch, TEXT[:12], steps=12)
    return p, [StepRecord.from_wire(s) for s in p.drain_steps()]


def test_a_finished_request_is_priced_once_the_step_cost_is_measured():
    """A fresh worker's first requests send their counts and seconds at once; their plain cost waits
    until the meter has a step cost (it needs ``min_steps`` steady steps), then goes out priced at the
    plain step (not at their own time: that would claim no saving for them)."""
    p, early = _finished_request(cold := ColdLine())
    assert any(s.num_draft for s in early) and not any(s.late for s in early)
    spent = sum(s.seconds for s in early)
    assert sum(s.num_tokens for s in early) == 10 - 1 and spent > 0  # the first, untimed here, aside
    cold.measured = True
    late = [StepRecord.from_wire(s) for s in p.drain_steps()]
    assert len(late) == 1 and late[0].late and late[0].plain_seconds == pytest.approx(9 * 0.012)


def test_a_request_no_step_cost_prices_in_time_goes_out_at_its_own_time():
    p, early = _finished_request(ColdLine())
    assert p.drain_steps() == []  # not yet given up on
    p.unpriced_hold_s = 0.0
    late = [StepRecord.from_wire(s) for s in p.drain_steps()]
    # no saving: the seconds of the steps that delivered its tokens (this runner keeps it in the batch after)
    assert len(late) == 1 and late[0].plain_seconds == pytest.approx(sum(s.seconds for s in early if s.num_tokens))
    assert len(p.schedule) == 0


def test_a_drain_that_ends_the_pass_gets_every_cost_priced_or_not():
    """What a benchmark does at the end of a pass: every request's plain cost in it."""
    p, batch = _one_request()
    p.step_cost = ColdLine()
    _decode(p, batch, TEXT[:12], steps=12)  # still running, and nothing prices it
    spent = sum(StepRecord.from_wire(s).seconds for s in p.drain_steps())
    late = [StepRecord.from_wire(s) for s in p.drain_steps(held=True)]
    assert len(late) == 1 and late[0].plain_seconds == pytest.approx(spent)


def test_a_step_that_is_not_steady_teaches_the_line_nothing_and_one_that_prefilled_claims_nothing():
    batch = Batch()
    batch.add("r1", RequestTag("acme", "s1"), [1, 2, 3])
    p = _proposer(batch, RepriseProposer())
    p.step_cost = FixedLine()
    p._last_step, p._step_start = (10.0, ("r1",), 1, 0.001, 600), 10.0
    p._scheduled = {"r1": 1, "r2": 299}  # r2 joined: its prompt was prefilled in this step
    joined = p._time_step(10.25, ["r1", "r2"], [[5], [6]])
    assert joined is not None and joined.seconds == pytest.approx(0.25) and joined.plain_step_seconds is None
    assert joined.share("r2") == pytest.approx(0.25 * 299 / 300)  # shared by the tokens each scheduled
    assert p.step_cost.num_steps == 0  # the cost line learns only from steady steps
    p._last_step = (20.0, ("r1", "r2"), 2, 0.001, 600)
    steady = p._time_step(20.05, ["r1", "r2"], [[5], [6]])
    assert steady is not None and steady.plain_step_seconds == pytest.approx(0.01 + 0.002 * 2)
    p._last_step = (30.0, ("r1", "r2"), 2, 0.001, 600)
    assert p._time_step(30.0 + p.step_cost.max_gap_s + 1, ["r1", "r2"], [[5], [6]]) is None  # idle, unreported
    p._last_step, p._step_start = (40.0, ("r1", "r2"), 2, 0.001, 600), 50.0  # idle, then a step begun at 50
    alone = p._time_step(50.3, ["r1", "r2"], [[5], [6]])
    assert alone is not None and alone.seconds == pytest.approx(0.3)  # decoding only: priced as decoding
    assert alone.plain_step_seconds == pytest.approx(0.01 + 0.002 * 2)
    p._last_step, p._step_start = (45.0, ("r1", "r2", "r3"), 3, 0.001, 600), 45.1  # r3 left: a step of two
    left = p._time_step(45.2, ["r1", "r2"], [[5], [6]])
    assert left.seconds == pytest.approx(0.1) and left.plain_step_seconds == pytest.approx(0.01 + 0.002 * 2)
    assert p.step_cost.num_steps == 1  # still only the steady step above
    p._last_step, p._step_start = (60.0, ("r0",), 1, 0.001, 600), 60.2  # the engine ran other work in between
    assert p._time_step(60.3, ["r1", "r2"], [[5], [6]]).seconds == pytest.approx(0.1)


def test_a_prefill_is_timed_from_the_runners_step_and_recorded_as_prefill():
    """The runner's step (``execute_model``) names the requests it began prefilling and when it began:
    after an idle engine the step is timed from there, shared by scheduled tokens, and each request's
    share is prefill seconds at their own price (vLLM's prefix cache is vLLM's, not a saving of Reprise's);
    a row that prefilled a chunk and sampled nothing is recorded as prefill too."""
    batch = Batch()
    p = _proposer(batch, RepriseProposer())
    clock = [100.0]

    def execute(scheduled: dict[str, int], new: list[str]) -> None:
        batch.execute_model(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
                                            num_scheduled_tokens=scheduled))

    import reprise.backends.vllm.proposer as module

    real = module.time.perf_counter
    module.time.perf_counter = lambda: clock[0]
    try:
        batch.add("a", RequestTag("acme", "s"), [3] * 300)
        batch.add("b", RequestTag("acme", "s"), [4] * 900)
        execute({"a": 300, "b": 100}, ["a", "b"])  # a whole, b's first chunk of 900
        clock[0] += 0.4
        batch.commit(0, [7])
        p.propose([[7], []], batch.lengths, batch.tokens)
    finally:
        module.time.perf_counter = real
    records = [StepRecord.from_wire(s) for s in p.drain_steps()]
    assert len(records) == 2 and all(r.seconds == 0.0 for r in records)
    chunk, first = sorted(records, key=lambda r: r.num_tokens)
    assert first.num_tokens == 1 and first.prefill_seconds == pytest.approx(0.3)  # 300 of the 400 tokens
    assert chunk.num_tokens == 0 and chunk.prefill_seconds == pytest.approx(0.1)
    assert all(r.plain_prefill_seconds == r.prefill_seconds for r in records)
    assert set(p._prefilling) == {"b"}  # still prefilling
    run = p.schedule._runs["a"]  # the plain schedule follows a from when it was scheduled, after its prefill
    assert run.arrived == pytest.approx(100.0) and run.prefill == pytest.approx(0.3)


def test_tokens_decoded_in_a_step_that_prefilled_another_prompt_are_one_at_its_cost_and_the_rest_scheduled():
    """A plain engine's step that prefilled b's chunk would have carried one token of a's too, at the
    same cost; the tokens a's drafts added are the plain schedule's to price."""
    tenants = RepriseProposer()
    tenants.record("acme", "old", [1, 2, 3], TEXT)
    batch = Batch()
    p = _proposer(batch, tenants)
    p.step_cost = FixedLine()
    batch.add("a", RequestTag("acme", "s"), [1, 2, 3])
    batch.commit(0, TEXT[:1])
    draft = p.propose([[1]], batch.lengths, batch.tokens)[0]  # a's first chain
    assert len(draft) >= 3
    batch.add("b", RequestTag("acme", "s2"), [4] * 300)
    batch.execute_model(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="b")],
                                        num_scheduled_tokens={"a": 1 + len(draft), "b": 200}))
    batch.commit(0, TEXT[1:4])  # two of a's draft tokens accepted, and the bonus
    p.propose([[1], []], batch.lengths, batch.tokens)
    a = next(StepRecord.from_wire(s) for s in p.drain_steps() if StepRecord.from_wire(s).num_tokens == 3)
    assert a.seconds > 0 and a.plain_seconds == a.seconds  # its share of the step, for one token
    assert p.schedule._runs["a"].delivered == 2 and p.schedule._runs["a"].spent == 0.0
