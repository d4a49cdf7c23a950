"""vLLM's neural fallback (reprise/backends/vllm/fallback.py): a Medusa head's chain from the row's
hidden state where retrieval's chain expects little, sent through the chain session and committed
without touching retrieval's tree; on fakes of vLLM's step (the real engine: test_vllm_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from reprise.backends.vllm.step_cost import StepCostMeter
from reprise.backends.vllm.tags import RequestTag, StepRecord
from reprise.backends.vllm.target_states import TargetStates
from retrieval.config import DraftingConfig
from retrieval.draft_tree import DraftTree
from retrieval.proposer import RepriseProposer

torch = pytest.importorskip("torch")


def _medusa(num_heads: int = 2, hidden: int = 8, vocab: int = 16, draft_vocab: int = 12):
    from neural_drafters.config import HeadConfig
    from neural_drafters.heads import build_head

    config = HeadConfig(kind="medusa", hidden_size=hidden, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                        intermediate_size=16, vocab_size=vocab, draft_vocab_size=draft_vocab, num_heads=num_heads)
    torch.manual_seed(0)
    head = build_head(config)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.5)
    head.d2t = torch.arange(vocab - draft_vocab, vocab)  # a draft vocabulary that is not the identity
    return head


def test_the_heads_chain_is_each_heads_best_token_of_the_draft_vocabulary() -> None:
    from reprise.backends.vllm.fallback import NeuralFallback

    head = _medusa()
    fallback = NeuralFallback(head)
    embed = torch.randn(16, 8)
    fallback.bind(embed)
    h = torch.randn(8)
    chain = fallback.draft(h, max_len=8)
    with torch.inference_mode():
        expected = [int(head.d2t[(block(h[None]) @ embed[head.d2t].T).argmax()]) for block in head.blocks]
    assert chain.token_ids.tolist() == expected and chain.source == "neural"
    assert chain.parents.tolist() == [-1, 0] and np.all((chain.probs > 0) & (chain.probs <= 1))
    assert chain.score == pytest.approx(float(chain.probs[0] + chain.probs[0] * chain.probs[1]), rel=1e-5)
    assert len(fallback.draft(h, max_len=1)) == 1


def test_only_a_medusa_checkpoint_loads(tmp_path) -> None:
    from neural_drafters.checkpoint import save_checkpoint
    from neural_drafters.config import HeadConfig
    from neural_drafters.heads import build_head
    from reprise.backends.vllm.fallback import load_fallback

    save_checkpoint(tmp_path / "medusa", _medusa(), step=1)
    assert load_fallback(tmp_path / "medusa").num_heads == 2
    eagle = build_head(HeadConfig(kind="eagle", hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                                  head_dim=4, intermediate_size=16, vocab_size=16, draft_vocab_size=16))
    save_checkpoint(tmp_path / "eagle", eagle, step=1)
    with pytest.raises(ValueError, match="Medusa"):
        load_fallback(tmp_path / "eagle")


class _Guess:
    """A fallback that always guesses ``tokens`` with probability ``p`` each."""

    def __init__(self, tokens: list[int], p: float) -> None:
        self.tokens, self.p = tokens, p

    def draft(self, hidden, max_len: int) -> DraftTree:
        return DraftTree.chain(np.array(self.tokens[:max_len], dtype=np.int32),
                               np.full(min(len(self.tokens), max_len), self.p, dtype=np.float32), source="neural")


def _proposer(tenants: RepriseProposer, fallback):
    from reprise.backends.vllm.proposer import RepriseVllmProposer
    from reprise.engine.draft_budget import DraftBudget

    batch = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["r1"]), execute_model=lambda out: None,
                            requests={"r1": SimpleNamespace(num_prompt_tokens=3, sampling_params=SimpleNamespace(
                                extra_args=RequestTag("acme", "s1").to_extra_args()))})
    p = RepriseVllmProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4)))
    p.attach(batch, tenants, chain_factor=2, stall_timeout_s=1.0, budget=DraftBudget(max_draft_tokens=4, adaptive=False))
    p.step_cost = StepCostMeter(guard=False)
    p.states = TargetStates(torch.zeros(16, 8), None, fallback, p.health)
    return p


def _step(p, row: list[int]) -> list[int]:
    tokens = np.array([row], dtype=np.int32)
    return p._draft_step([(0, "r1", RequestTag("acme", "s1"))], np.array([len(row)]), tokens, {"r1"}, 1,
                         hidden=torch.zeros(1, 8))[0]


def test_where_retrieval_has_nothing_the_head_drafts_and_its_tokens_commit_as_usual() -> None:
    tenants = RepriseProposer(DraftingConfig(hybrid_threshold=1.0))
    p = _proposer(tenants, _Guess([7, 8], 0.9))
    try:
        assert _step(p, [1, 2, 3, 4]) == [7, 8]  # an empty history: retrieval has nothing
        assert p.health.fallback_steps == 1
        assert _step(p, [1, 2, 3, 4, 7, 9]) == [7, 8]  # 7 accepted, 9 the target's own
        records = [StepRecord.from_wire(s) for s in p.drain_steps()]
        assert [(r.num_draft, r.num_accepted, r.source) for r in records][-1] == (2, 1, "neural")
        session = p._requests["r1"].session
        assert session.output_ids.tolist() == [4, 7, 9]  # retrieval's session saw every committed token
    finally:
        p.close()


def test_a_sure_retrieval_chain_or_an_unsure_head_keeps_retrievals_chain() -> None:
    text = [11, 12, 13, 14, 15, 16, 17, 18] * 3
    tenants = RepriseProposer(DraftingConfig(hybrid_threshold=1.0))
    tenants.record("acme", "old", [1, 2, 3], text)
    p = _proposer(tenants, _Guess([7, 8], 0.9))
    try:
        assert _step(p, [1, 2, 3, 11, 12, 13])[:2] == [14, 15]  # the history knows what follows
        assert p.health.fallback_steps == 0
    finally:
        p.close()
    tenants = RepriseProposer(DraftingConfig(hybrid_threshold=1.0))
    p = _proposer(tenants, _Guess([7, 8], 0.0))
    try:
        assert _step(p, [1, 2, 3, 4]) == []  # nothing from retrieval and a head that expects nothing
        assert p.health.fallback_steps == 0
    finally:
        p.close()


def test_a_tenants_own_threshold_switches_the_fallback() -> None:
    tenants = RepriseProposer(DraftingConfig(hybrid_threshold=1.0))
    tenants.set_tenant_config("acme", DraftingConfig(hybrid_threshold=0.0))  # never below 0: the head is off
    p = _proposer(tenants, _Guess([7, 8], 0.9))
    try:
        assert _step(p, [1, 2, 3, 4]) == [] and p.health.fallback_steps == 0
    finally:
        p.close()


def test_the_chain_session_commits_another_drafters_chain_as_no_draft_of_its_own() -> None:
    from retrieval.chain import ChainSession
    from retrieval.session import Verified

    class Inner:
        committed = None

        def propose(self, budget):
            return DraftTree.chain(np.array([1, 2], dtype=np.int32))

        def commit(self, verified):
            self.committed = verified

    inner = Inner()
    session = ChainSession(inner, 2)
    session.propose(4)
    other = DraftTree.chain(np.array([5, 6], dtype=np.int32))
    assert session.send_other(other) is other
    session.commit(Verified(np.array([5, 6, 9], dtype=np.int32), np.array([0, 1], dtype=np.int32), True))
    assert inner.committed.accepted.tolist() == [] and not inner.committed.draft_verified
    assert inner.committed.token_ids.tolist() == [5, 6, 9]
    session.propose(4)  # and the next chain is the tree's again
    session.commit(Verified(np.array([1, 2], dtype=np.int32), np.array([0], dtype=np.int32), True))
    assert inner.committed.accepted.tolist() == [0] and inner.committed.draft_verified


class _Slow(_Guess):
    """A guess that takes ``seconds`` to make."""

    def __init__(self, tokens: list[int], p: float, seconds: float) -> None:
        super().__init__(tokens, p)
        self.seconds = seconds

    def draft(self, hidden, max_len: int) -> DraftTree:
        import time

        time.sleep(self.seconds)
        return super().draft(hidden, max_len)


@pytest.mark.parametrize("right", [False, True])
def test_a_head_whose_calls_cost_more_than_its_chains_save_rests(right: bool) -> None:
    """Every call takes 2 ms; a step's plain share of a request is 50 ms. A head that is always wrong
    saves nothing and rests after ``min_calls`` calls; one whose two tokens always pass saves far more
    than it costs and keeps drafting."""
    from reprise.backends.vllm.fallback import FallbackPayoff
    from reprise.backends.vllm.step_cost import VllmStepCost

    tenants = RepriseProposer(DraftingConfig(hybrid_threshold=1.0))
    p = _proposer(tenants, _Slow([7, 8], 0.9, 0.002))
    p.states.payoff = FallbackPayoff(min_calls=4, rest_steps=100)
    p.step_cost._cut_cost = VllmStepCost(base=0.05, per_request=0.0, per_draft=0.0, drafted=0.0)  # 50 ms a step
    try:
        row = [1, 2, 3, 4]
        for i in range(8):  # the target's own tokens are new each step: retrieval never has anything
            _step(p, row)
            row = row + ([7, 8, 100 + i] if right else [100 + i])  # both draft tokens and the bonus, or a miss
        assert p.health.fallback_rests == (0 if right else 1)
        drafted = p.health.fallback_steps
        assert (_step(p, row) == [7, 8]) is right  # resting: retrieval's (empty) chain alone
        assert p.health.fallback_steps == drafted + int(right)
    finally:
        p.close()
