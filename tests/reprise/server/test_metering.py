"""reprise.server.metering: the per-step figures equal the pipeline's own usage counts, exactly."""

from __future__ import annotations

import numpy as np

from reprise.engine.draft_budget import DraftBudget
from reprise.engine.engine import Engine, EngineConfig, StepReport
from reprise.offline.tiny import tiny_llama
from reprise.server.metering import StepMeter, TenantAccounting
from reprise.server.metrics import ServiceMetrics
from retrieval.draft_tree import DraftTree
from retrieval.registry import make_proposer
from serving.records import Request
from serving.savings import RequestCost
from verifier.runner import ModelRunner
from verifier.testing import hf_greedy


def test_accounting_figures() -> None:
    acc = TenantAccounting()
    acc.record_steps([StepReport("t", drafted, accepted, source, 0, 1e-5, True)
                      for drafted, accepted, source in [(8, 3, "reprise"), (4, 0, "reprise"), (0, 0, ""),
                                                        (6, 1, "corpus")]])
    acc.record_request("t")
    s = acc.stats("t", index_tokens=10)
    assert (s.num_steps, s.num_drafted_steps, s.num_draft_tokens, s.num_accepted_tokens) == (4, 3, 18, 4)
    assert s.hit_rate == 0.75 and s.tau == (4 + 4) / 4 and s.index_tokens == 10 and s.num_requests == 1
    assert s.acceptance_by_position == (2 / 3, 1 / 3, 1 / 3)
    assert s.drafter_steps == {"reprise": 2, "corpus": 1}
    acc.forget("t")
    assert acc.stats("t").num_steps == 0


def test_a_steps_costs_add_to_the_tenants_savings() -> None:
    accounting = TenantAccounting()
    metrics = ServiceMetrics()
    meter = StepMeter(accounting, metrics)
    meter.on_step([StepReport("t", 4, 2, "reprise", 0, None, True, 3, RequestCost(0.1, 0.3))])
    s = accounting.stats("t")
    assert (s.num_steps, s.num_drafted_steps, s.num_accepted_tokens) == (1, 1, 2)
    assert s.savings.decode_seconds == 0.1 and s.savings.plain_decode_seconds == 0.3 and s.savings.num_tokens == 3
    body = metrics.render()[0].decode()
    assert 'reprise_engine_plain_seconds_total{phase="decode"} 0.3' in body


class TruthSession:
    """Unit-test drafter: drafts a branchy tree whose one path follows the model's greedy continuation
    for a varying number of tokens, so acceptance lengths vary from step to step."""

    def __init__(self, truth: list[int], prompt_len: int) -> None:
        self.truth, self.pos, self.step = truth, 0, 0

    def propose(self, budget: int) -> DraftTree:
        self.step += 1
        good = self.truth[self.pos: self.pos + min(budget - 1, self.step % 5)]
        ids = good + [(good[0] + 1) % 250 if good else 3]  # a wrong sibling of the first node
        parents = list(range(-1, len(good) - 1)) + [-1]
        return DraftTree(np.array(ids, np.int32), np.array(parents, np.int32), np.full(len(ids), 0.9, np.float32),
                         source="truth")

    def commit(self, verified) -> None:
        self.pos += len(verified.token_ids)

    def finish(self, record: bool = True) -> None:
        pass


class TruthProposer:
    def __init__(self, model) -> None:
        self.model = model

    def begin(self, tenant, session_id, prompt_ids, request_id=""):
        return TruthSession(hf_greedy(self.model, list(prompt_ids), 60), len(prompt_ids))


def test_metered_figures_equal_the_engines_usage() -> None:
    model = tiny_llama()
    accounting = TenantAccounting()
    metrics = ServiceMetrics()
    budget = DraftBudget(adaptive=False)  # verify every draft: something to count
    engine = Engine(ModelRunner(model, num_slots=3, max_len=400), TruthProposer(model), None,
                    EngineConfig(budget=budget, observer=StepMeter(accounting, metrics)))
    rng = np.random.default_rng(0)
    usages = []
    for _ in range(4):
        result = engine.generate(rng.integers(3, 250, 12).tolist(), max_new_tokens=40, tenant="t", ignore_eos=True)
        usages.append(result.usage)
    s = accounting.stats("t")
    assert s.num_requests == 4 and s.drafter_steps == {"truth": s.num_drafted_steps}
    assert s.num_steps == sum(u.steps for u in usages)
    assert s.num_draft_tokens == sum(u.drafted_tokens for u in usages) > 0
    assert s.num_accepted_tokens == sum(u.accepted_tokens for u in usages) > 0
    assert len(set(s.acceptance_by_position)) > 1  # acceptance varied by position
    body = metrics.render()[0].decode()
    assert f"reprise_spec_decode_num_accepted_tokens_total {float(s.num_accepted_tokens)}" in body


def test_speculation_off_drafts_nothing_same_output() -> None:
    model = tiny_llama()
    accounting = TenantAccounting()
    metrics = ServiceMetrics()
    engine = Engine(ModelRunner(model, num_slots=1, max_len=400), make_proposer("prompt_lookup"), None,
                    EngineConfig(observer=StepMeter(accounting, metrics)))
    prompt = [7, 8, 9, 10] * 8
    on = engine.generate(prompt, max_new_tokens=30)
    assert on.usage.drafted_tokens > 0
    handle = engine.submit(Request.of_tokens(prompt, max_new_tokens=30, tenant="off", speculate=False))
    engine.run_until_idle()
    off = handle.wait()
    assert off.token_ids == on.token_ids and off.usage.drafted_tokens == 0
    assert off.usage.steps == len(off.token_ids)
    assert accounting.stats("off").num_steps == off.usage.steps and accounting.stats("off").num_drafted_steps == 0
    assert 'reprise_index_lookups_total{result="skipped"} ' in metrics.render()[0].decode()
