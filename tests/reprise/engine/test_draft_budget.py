"""The draft budget: cost model, expected-acceptance pruning, calibration."""

from __future__ import annotations

import numpy as np
import pytest

from reprise.engine.draft_budget import AcceptanceTracker, CostModel, DraftBudget
from reprise.engine.engine import Engine, EngineConfig
from reprise.engine.step_cost import StepCostFit
from retrieval.draft_tree import DraftTree, conditional_probs, path_probs, subtree
from retrieval.registry import make_proposer
from serving.records import Request
from verifier.runner import ModelRunner
from verifier.testing import tiny_model


def tree_of(probs, parents=None) -> DraftTree:
    n = len(probs)
    parents = list(range(-1, n - 1)) if parents is None else parents
    return DraftTree(
        np.arange(10, 10 + n, dtype=np.int32), np.array(parents, np.int32), np.array(probs, np.float32)
    )


def test_cost_model_line_and_points() -> None:
    line = CostModel(a=10.0, b=2.0)
    assert line.cost(np.array([0, 5])).tolist() == [10.0, 20.0]
    table = CostModel(points=((0, 66.0), (16, 140.0), (32, 171.0)))
    assert table.cost(np.array([8]))[0] == pytest.approx(103.0)
    assert table.cost(np.array([48]))[0] == pytest.approx(202.0)  # extrapolates the last segment
    with pytest.raises(ValueError, match="a > 0 and b >= 0, got a=0"):
        CostModel(a=0.0)
    with pytest.raises(ValueError, match="points must be positive"):
        CostModel(points=((0, -1.0),))


def test_confident_chain_is_kept_and_doubtful_one_is_cut() -> None:
    budget = DraftBudget(cost_model=CostModel(a=66.0, b=3.4))
    sure = tree_of([0.99] * 20)
    assert len(budget.choose(sure, 32)) == 20
    doubtful = tree_of([0.05] * 20)
    assert len(budget.choose(doubtful, 32)) == 0  # a plain step is cheaper per expected token
    middling = tree_of([0.7] * 30)
    kept = len(budget.choose(middling, 32))
    assert 0 < kept < 30
    assert len(budget.choose(middling, 5)) <= 5
    assert len(DraftBudget(adaptive=False).choose(middling, 32)) == 30


def test_batch_width_is_chosen_for_the_padded_batch() -> None:
    """The own engine pads every request to the widest draft: one sure tree among seven requests with
    nothing to draft would make all eight pay for its rows, so the batch's width stays 0; when all eight
    are sure, they all verify wide trees. One request alone is ``select``'s cut."""
    budget = DraftBudget(cost_model=CostModel(a=66.0, b=3.4))
    sure, empty = tree_of([0.99] * 20), DraftTree.empty()
    alone_in_share = budget.select(sure, 32, batch_size=8)
    assert len(alone_in_share) == 20  # its share of a flattened batch pays for it
    keeps = budget.select_batch([sure] + [empty] * 7, [32] * 8, [1.0] * 8)
    assert [len(k) for k in keeps] == [0] * 8
    keeps = budget.select_batch([sure] * 8, [32] * 8, [1.0] * 8)
    assert len({len(k) for k in keeps}) == 1 and len(keeps[0]) >= 10
    middling = tree_of([0.7] * 30)
    for tree in (sure, middling, tree_of([0.05] * 20)):
        assert budget.select_batch([tree], [32], [1.0])[0].tolist() == budget.select(tree, 32).tolist()
    # Requests fill the chosen width with their own best nodes, each up to its own limit.
    keeps = budget.select_batch([sure, sure, middling], [32, 4, 32], [1.0, 1.0, 1.0])
    width = len(keeps[0])
    assert len(keeps[1]) == min(4, width) and len(keeps[2]) == min(30, width)
    assert [len(k) for k in DraftBudget(adaptive=False).select_batch([sure, middling], [32, 5], [1.0, 1.0])] == [20, 5]


def test_choice_keeps_parents_and_best_branches() -> None:
    # root children: 0 (p .9) and 1 (p .2); 2 under 0 (.9); 3 under 1 (.9); 4 under 2 (.1)
    tree = tree_of([0.9, 0.2, 0.9, 0.9, 0.1], parents=[-1, -1, 0, 1, 2])
    kept = DraftBudget(adaptive=False).choose(tree, 3)
    assert kept.token_ids.tolist() == [10, 11, 12] and kept.parents.tolist() == [-1, -1, 0]
    kept = DraftBudget(adaptive=False).choose(tree, 2)
    assert kept.token_ids.tolist() == [10, 12] and kept.parents.tolist() == [-1, 0]
    assert kept.score == pytest.approx(0.9 + 0.81)


def test_subtree_requires_closed_node_sets() -> None:
    tree = tree_of([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="include every kept node's parent"):
        subtree(tree, np.array([0, 2]))


def test_tracker_learns_from_rejections() -> None:
    tracker = AcceptanceTracker()
    tree = tree_of([1.0] * 8)  # prompt lookup style: every prob is 1
    for _ in range(20):
        tracker.update(tree, np.array([0]))  # one level passes, the next fails
    assert 0.45 < tracker.scale < 0.6
    budget = DraftBudget(cost_model=CostModel(a=66.0, b=3.4))
    assert len(budget.choose(tree, 8, tracker.scale)) < 8
    tracker.update(DraftTree.empty(), np.zeros(0, np.int32))  # no draft: nothing learnt
    assert 0.45 < tracker.scale < 0.6


def test_path_and_conditional_probability_trees_are_read_alike() -> None:


    parents = [-1, 0, 1, -1, 3]
    cond = np.array([0.9, 0.8, 0.5, 0.3, 0.9])
    conditional = DraftTree(np.arange(5, dtype=np.int32), np.array(parents, np.int32), cond.astype(np.float32),
                            score=float(0.9 + 0.72 + 0.36 + 0.3 + 0.27))  # fmt: skip
    path = np.array([0.9, 0.72, 0.36, 0.3, 0.27])
    stored_as_path = DraftTree(
        np.arange(5, dtype=np.int32),
        np.array(parents, np.int32),
        path.astype(np.float32),
        score=float(path.sum()),
    )  # fmt: skip  (what the suffix-index drafters emit)
    for tree in (conditional, stored_as_path):
        assert np.allclose(path_probs(tree), path, atol=1e-6)
        assert np.allclose(conditional_probs(tree), cond, atol=1e-6)
    budget = DraftBudget(cost_model=CostModel(a=66.0, b=3.4))
    assert (
        budget.choose(conditional, 5).token_ids.tolist()
        == budget.choose(stored_as_path, 5).token_ids.tolist()
    )


def test_default_budget_before_measuring_uses_the_development_machines_table() -> None:
    budget = DraftBudget()
    assert isinstance(budget.cost_model, StepCostFit) and not budget.cost_model.measured
    assert budget.cost_model.cost(np.array([0]))[0] == 1.0
    assert len(budget.choose(tree_of([0.99] * 32), 32)) >= 16
    # One or two draft rows cost about 1 % more than a plain step on this CPU, the third one 20 %: a
    # doubtful chain is cut to its first two nodes, a hopeless one to none.
    assert len(budget.choose(tree_of([0.3] * 32), 32)) == 2
    assert len(budget.choose(tree_of([0.005] * 32), 32)) == 0


def test_larger_batches_keep_fewer_draft_tokens() -> None:
    budget = DraftBudget(cost_model=CostModel(a=1.0, b=0.1))
    tree = tree_of([0.9] * 32)
    kept = [len(budget.choose(tree, 32, batch_size=b)) for b in (1, 4, 16, 64)]
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    assert kept[0] == len(budget.choose(tree, 32))  # batch 1 is the single-request cost model
    # A request's share: B requests share one step's base cost, and each draft token adds B rows.
    assert budget.share(np.array([0]), 4)[0] == pytest.approx((1.0 + 0.1 * 3) / 4)
    assert budget.share(np.array([2]), 4)[0] == pytest.approx((1.0 + 0.1 * 11) / 4)
    # Sure drafts are still verified in a large batch; doubtful ones stop first.
    assert len(budget.choose(tree_of([0.999] * 8), 8, batch_size=64)) == 8
    assert len(budget.choose(tree_of([0.5] * 8), 8, batch_size=64)) < len(budget.choose(tree_of([0.5] * 8), 8))


def test_the_engine_cuts_its_whole_batch_to_one_width() -> None:
    seen: list[tuple[int, set[int]]] = []

    class Spy(DraftBudget):
        def select_batch(self, trees, max_nodes, scales):
            keeps = super().select_batch(trees, max_nodes, scales)
            seen.append((len(trees), {len(k) for k, t in zip(keeps, trees) if len(t) > len(k)}))
            return keeps

    model = tiny_model("llama", vocab_size=64, seed=1)
    engine = Engine(ModelRunner(model, num_slots=3, max_len=64), make_proposer("prompt_lookup"), None,
                    EngineConfig(budget=Spy()))

    handles = [engine.submit(Request.of_tokens((1, 2, 3 + i), max_new_tokens=4, ignore_eos=True))
               for i in range(3)]
    engine.run_until_idle()
    assert all(len(h.wait().token_ids) == 4 for h in handles)
    assert seen and max(n for n, _ in seen) == 3
    assert all(len(cut) <= 1 for _, cut in seen)  # every tree the budget cut was cut to the same width
