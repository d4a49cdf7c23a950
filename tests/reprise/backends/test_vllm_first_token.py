"""The chain's first token re-ranked by the target's logits (reprise/backends/vllm/first_token.py) and
how vLLM + Reprise's proposer finds each row's hidden state, on fakes of vLLM's step (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from reprise.backends.vllm.first_token import FirstTokenRerank
from retrieval.draft_tree import DraftTree

torch = pytest.importorskip("torch")


def test_weight_zero_or_one_root_keeps_the_drafters_choice() -> None:
    values, logits = np.array([2.0, 1.0]), np.array([0.0, 9.0])
    assert FirstTokenRerank(top=4, weight=0.0).choose(values, logits) == 0
    assert FirstTokenRerank(top=1, weight=5.0).choose(values, logits) == 0
    assert FirstTokenRerank(top=4, weight=1.0).choose(values[:1], logits[:1]) == 0


def test_the_target_moves_the_chain_only_as_far_as_its_belief_outweighs_the_drafters() -> None:
    values = np.array([2.0, 1.0, 1.5])
    assert FirstTokenRerank(top=4, weight=1.0).choose(values, np.array([0.0, 3.0, 0.0])) == 1  # 1 * e^3 > 2
    assert FirstTokenRerank(top=4, weight=1.0).choose(values, np.array([0.0, 0.5, 0.0])) == 0  # 1 * e^.5 < 2
    assert FirstTokenRerank(top=2, weight=1.0).choose(values, np.array([0.0, 0.0, 9.0])) == 0  # root 3 not in top 2


@pytest.mark.parametrize("top, weight", [(0, 1.0), (2, -1.0), (2, float("nan"))])
def test_bad_settings_are_refused(top, weight) -> None:
    with pytest.raises(ValueError):
        FirstTokenRerank(top=top, weight=weight)


def _states(out_embed):
    """``TargetStates`` with the first-token re-rank over ``out_embed`` (no runner: nothing captured)."""
    from reprise.backends.vllm.proposer import ProposerHealth
    from reprise.backends.vllm.target_states import TargetStates

    return TargetStates(out_embed, FirstTokenRerank(top=4, weight=1.0), None, ProposerHealth())


def test_each_row_takes_the_hidden_state_its_last_token_was_sampled_from() -> None:
    states = _states(torch.zeros(4, 2))
    rows = torch.arange(8.0).repeat_interleave(2).reshape(8, 2)  # row k holds k
    # Row 0 verified 2 drafts and accepted 1 (2 sampled), row 1 had no draft, row 2 is prefilling,
    # row 3 verified 3 drafts and accepted all (4 sampled): logits rows 0-2, 3, 4, 5-8.
    states.step = (torch.cat([rows, torch.full((1, 2), 8.0)]), SimpleNamespace(num_draft_tokens=[2, 0, 0, 3]))
    hidden = states.rows([[5, 6], [7], [], [1, 2, 3, 4]])
    assert hidden[:, 0].tolist() == [1.0, 3.0, 4.0, 8.0]
    states.step = (rows, None)  # no drafts this step: one logits row per request
    assert states.rows([[5], [7], [9]])[:, 0].tolist() == [0.0, 1.0, 2.0]
    states.step = (rows[:2], None)  # a layout it does not know: nothing read
    assert states.rows([[5], [7], [9]]) is None
    states.step = None  # nothing captured this step
    assert states.rows([[5]]) is None


def test_the_runners_method_is_wrapped_once_and_hands_its_states_over_while_it_runs() -> None:
    from reprise.backends.vllm.proposer import ProposerHealth
    from reprise.backends.vllm.target_states import TargetStates

    seen = []

    class Runner:
        def get_model(self):
            return SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(4, 2), org_vocab_size=4))

        def propose_draft_token_ids(self, *args):
            seen.append(states.step)
            return "drafts"

    runner = Runner()
    states = TargetStates.attach(runner, FirstTokenRerank(), None, ProposerHealth())
    assert states is not None
    again = TargetStates.attach(runner, FirstTokenRerank(), None, ProposerHealth())  # a second attach
    assert runner.propose_draft_token_ids(0, 1, 2, 3, "h", 5, "meta") == "drafts"
    assert seen == [None] and again.step is None  # only the latest attach's states are handed over
    states = again
    assert runner.propose_draft_token_ids(0, 1, 2, 3, "h", 5, "meta") == "drafts"
    assert seen[-1] == ("h", "meta") and states.step is None
    assert TargetStates.attach(runner, None, None, ProposerHealth()) is None  # nothing reads them


class _Session:
    """What ``_rerank`` uses of a ``ChainSession``: the tree and ``send``."""

    def __init__(self, tree: DraftTree) -> None:
        self.tree, self.sent = tree, None

    def send(self, nodes):
        self.sent = [int(n) for n in nodes]
        return DraftTree.chain(self.tree.token_ids[nodes])


def test_the_proposer_sends_the_root_the_target_believes() -> None:
    states = _states(torch.eye(4))  # the logit of token t is hidden[t]
    # Root 1 (token 1, path 1-3: expected 1.5) is the drafter's choice; root 2 (token 2: 0.5).
    tree = DraftTree(np.array([1, 2, 3], dtype=np.int32), np.array([-1, -1, 0], dtype=np.int32),
                     np.array([0.8, 0.5, 0.7], dtype=np.float32), 2.0)
    chain = DraftTree.chain(np.array([1, 3], dtype=np.int32))
    session = _Session(tree)
    assert states.refine(session, chain, torch.tensor([0.0, 0.0, 0.5, 0.0]), 0.0, 1, 8) == (chain, None)
    assert session.sent is None and states.health.reranked_steps == 0
    moved, replaced = states.refine(session, chain, torch.tensor([0.0, 0.0, 4.0, 0.0]), 0.0, 1, 8)
    assert session.sent == [1] and moved.token_ids.tolist() == [2] and replaced is None
    assert states.health.reranked_steps == 1


def test_the_chain_session_sends_another_root_path_and_commits_through_it() -> None:
    from retrieval.chain import ChainSession, root_paths
    from retrieval.session import Verified

    class Inner:
        def __init__(self, tree):
            self.tree, self.committed, self.chain = tree, None, None

        def propose(self, budget):
            return self.tree

        def verify_only(self, chain):
            self.chain = chain

        def commit(self, verified):
            self.committed = verified.accepted.tolist()

    tree = DraftTree(np.array([1, 2, 3, 4], dtype=np.int32), np.array([-1, -1, 0, 1], dtype=np.int32),
                     np.array([0.8, 0.5, 0.6, 0.4], dtype=np.float32), 2.3)
    inner = Inner(tree)
    session = ChainSession(inner, 2)
    assert session.propose(4).token_ids.tolist() == [1, 3]
    paths, values = root_paths(tree, 4)
    assert [p.tolist() for p in paths] == [[0, 2], [1, 3]] and values.tolist() == pytest.approx([1.4, 0.9])
    chain = session.send(paths[1])
    assert chain.token_ids.tolist() == [2, 4] and chain.score == pytest.approx(0.9) and inner.chain is chain
    session.commit(Verified(np.array([2, 4, 9], dtype=np.int32), np.array([0, 1], dtype=np.int32), True))
    assert inner.committed == [1, 3]  # the tree's nodes of the chain that was sent


def test_the_worker_reports_the_measured_step_cost() -> None:
    from reprise.backends.vllm.proposer import RepriseVllmProposer
    from reprise.backends.vllm.worker import RepriseWorkerExtension

    proposer = RepriseVllmProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=8)))
    try:
        worker = RepriseWorkerExtension()
        worker.model_runner = SimpleNamespace(drafter=proposer)
        assert worker.reprise_step_cost() == {"steps": 0.0, "propose_s": 0.0, "rested_steps": 0.0}
        for i in range(80):
            batch, drafts = 1 + i % 3, i % 9
            proposer.step_cost.observe(batch, drafts, 0.05 + 0.01 * batch + 0.002 * drafts)
        cost = worker.reprise_step_cost()
        assert cost["steps"] == 80.0
        assert cost["base_s"] == pytest.approx(0.05) and cost["per_request_s"] == pytest.approx(0.01)
        assert cost["per_draft_s"] == pytest.approx(0.002) and cost["drafted_s"] == pytest.approx(0.0, abs=1e-9)
    finally:
        proposer.close()
