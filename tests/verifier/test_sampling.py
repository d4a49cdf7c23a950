"""Sampling: processors match transformers, and every acceptance rule reproduces the target exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from retrieval.draft_tree import DraftTree
from verifier.acceptance import accept_by_targets, accept_with_q
from verifier.sampling import RowContext, SamplingParams, apply_processors, sample_rows, warp_probs
from verifier.testing import chi_square, chi_square_critical
from verifier.tree import layout_tree


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.6),
    ],
)
def test_warp_matches_transformers(params) -> None:
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)) * 3
    expected = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        expected = TopKLogitsWarper(params.top_k)(None, expected)
    if params.top_p < 1.0:
        expected = TopPLogitsWarper(params.top_p)(None, expected)
    assert torch.allclose(warp_probs(logits, params), torch.softmax(expected, -1), atol=1e-6)


def test_processors_see_each_rows_own_path() -> None:
    tree = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, 0, -1], np.int32), np.ones(3, np.float32))
    layout = layout_tree(tree)
    context = np.array([2, 3, 4])  # prompt [2, 3], output [4] so far; 4 is the root
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(repetition_penalty=1.7)
    ctx = RowContext(context, num_generated=1, min_new_tokens=3, suppress_ids=(1, 9))
    got = apply_processors(logits.clone(), params, ctx, layout)
    row_paths = [[], [5], [5, 6], [7]]
    for row, path in enumerate(row_paths):
        ids = torch.tensor([context.tolist() + path])
        expected = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[row : row + 1].clone())
        # output tokens before this row's token: 1 + depth; EOS-like ids banned while fewer than 3
        expected = MinNewTokensLengthLogitsProcessor(2, 3, [1, 9])(ids, expected)
        assert torch.allclose(got[row], expected[0]), row


def test_sample_rows_distribution_and_zero_mass() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.2, 0.3, 0.0], [0.25, 0.25, 0.0, 0.0, 0.5]])
    g = torch.Generator().manual_seed(3)
    draws = torch.stack([sample_rows(probs, g) for _ in range(4000)])  # [N, 2]
    for row in range(2):
        counts = np.bincount(draws[:, row].numpy(), minlength=5)
        stat, df = chi_square(counts, probs[row].numpy())
        assert stat < chi_square_critical(df), (row, counts)


# ---- a synthetic order-1 target and drafter (V small) for exact joint distributions -------------
V = 6
TARGET = (
    torch.randn(V, V, generator=torch.Generator().manual_seed(10), dtype=torch.float64) * 1.5
)  # logits[next | last]
DRAFT = TARGET + torch.randn(
    V, V, generator=torch.Generator().manual_seed(11), dtype=torch.float64
)  # a similar, wrong q


def target_probs(last_tokens: list[int], params: SamplingParams) -> torch.Tensor:
    return warp_probs(TARGET[last_tokens], params)


def exact_joint(first: int, params: SamplingParams) -> np.ndarray:
    """p(x1, x2 | first) over V x V."""
    p1 = target_probs([first], params)[0]
    p2 = target_probs(list(range(V)), params)
    return (p1[:, None] * p2).numpy()


def row_lasts(layout, root: int) -> list[int]:
    return [root] + layout.token_ids.tolist()  # each row's last token is its own token


def deterministic_tree(rng: np.random.Generator) -> DraftTree:
    """A fixed-shape tree of distinct-sibling tokens drawn without looking at the target."""
    a, b = rng.choice(V, 2, replace=False)
    c, d = rng.choice(V, 2, replace=False)
    e = rng.integers(V)
    tokens = [a, b, c, d, e]
    return DraftTree(
        np.array(tokens, np.int32), np.array([-1, -1, 0, 0, 1], np.int32), np.ones(5, np.float32)
    )


def run_two_tokens(step, first: int, trials: int) -> np.ndarray:
    counts = np.zeros((V, V))
    for _ in range(trials):
        out: list[int] = []
        while len(out) < 2:
            out += step(out[-1] if out else first)
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=4),
        SamplingParams(temperature=1.2, top_p=0.7),
    ],
)
def test_deterministic_drafts_preserve_distribution(params) -> None:
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(1)
    table = target_probs(list(range(V)), params)  # [V, V]: every row's distribution given its last token
    layouts = [layout_tree(deterministic_tree(rng)) for _ in range(32)]

    def step(root: int) -> list[int]:
        layout = layouts[rng.integers(len(layouts))]
        targets = sample_rows(table[row_lasts(layout, root)], g).numpy()
        path, bonus = accept_by_targets(layout, targets)
        return layout.token_ids[path].tolist() + [bonus]

    counts = run_two_tokens(step, first=2, trials=4000)
    stat, df = chi_square(counts, exact_joint(2, params))
    assert stat < chi_square_critical(df), stat


@pytest.mark.parametrize(
    "mode,params",
    [
        ("iid", SamplingParams(temperature=1.0)),
        ("iid", SamplingParams(temperature=0.8, top_k=4)),
        ("without_replacement", SamplingParams(temperature=0.8, top_k=4)),
    ],
)
def test_sampled_drafts_with_q_preserve_distribution(mode, params) -> None:
    g = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(3)
    q_table = torch.softmax(DRAFT, -1)
    table = target_probs(list(range(V)), params)

    def draw_children(q_row: torch.Tensor, k: int) -> list[int]:
        if mode == "iid":
            return rng.choice(V, size=k, p=q_row.numpy()).tolist()
        return rng.choice(V, size=k, replace=False, p=q_row.numpy()).tolist()

    def step(root: int) -> list[int]:
        # depth 1: 3 children of the root; depth 2: 2 children under the first child
        top = draw_children(q_table[root], 3)
        below = draw_children(q_table[top[0]], 2)
        tree = DraftTree(
            np.array(top + below, np.int32), np.array([-1, -1, -1, 0, 0], np.int32), np.ones(5, np.float32)
        )
        layout = layout_tree(tree)
        q = torch.stack([q_table[root]] * 3 + [q_table[top[0]]] * 2)
        path, token = accept_with_q(layout, table[row_lasts(layout, root)], q, g, mode)
        return layout.token_ids[path].tolist() + [token]

    counts = run_two_tokens(step, first=4, trials=3000)
    stat, df = chi_square(counts, exact_joint(4, params))
    assert stat < chi_square_critical(df), stat


def test_greedy_walk_picks_deepest_matching_path() -> None:
    tree = DraftTree(
        np.array([3, 4, 5, 6, 7], np.int32), np.array([-1, -1, 1, 2, 1], np.int32), np.ones(5, np.float32)
    )
    layout = layout_tree(tree)
    targets = np.array([4, 0, 5, 6, 9, 0])  # root->4 (node 1), then 5 (node 2), then 6 (node 3), bonus 9
    path, bonus = accept_by_targets(layout, targets)
    assert path.tolist() == [1, 2, 3] and bonus == 9
    path, bonus = accept_by_targets(layout, np.array([8, 0, 0, 0, 0, 0]))
    assert path.tolist() == [] and bonus == 8


def test_q_rejects_bad_input() -> None:
    layout = layout_tree(DraftTree.chain([2]))
    probs = torch.full((2, V), 1.0 / V, dtype=torch.float64)
    q = torch.zeros(1, V, dtype=torch.float64)
    with pytest.raises(ValueError, match="zero probability"):
        accept_with_q(layout, probs, q, torch.Generator(), "iid")
    with pytest.raises(ValueError, match="unknown draft q mode 'greedy'"):
        accept_with_q(layout, probs, q + 1 / V, torch.Generator(), "greedy")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, "temperature must be"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"seed": -5}, "seed must be"),
    ],
)
def test_sampling_params_validate(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_all_cells_reachable_sanity() -> None:
    """The exact joint used above is a distribution (guards the test's own arithmetic)."""
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=4)):
        joint = exact_joint(1, params)
        assert abs(joint.sum() - 1) < 1e-9
        assert all(joint[a, b] >= 0 for a, b in itertools.product(range(V), range(V)))
