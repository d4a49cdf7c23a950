"""Draft heads while drafting equal the same heads run over whole sequences; tree invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.neural import VOCAB, hidden_of, random_head

from neural_drafters.drafting import DraftSettings, HeadDrafter
from neural_drafters.tree import sampled_tree, topk_tree


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def node_paths(draft) -> list[list[int]]:
    paths = []
    for i, p in enumerate(draft.parents.tolist()):
        paths.append((paths[p] if p >= 0 else []) + [int(draft.token_ids[i])])
    return paths


def eagle_reference(head, parts, hidden, ctx: list[int], path: list[int]) -> torch.Tensor:
    """p(next | ctx + path) by running the EAGLE head causally over whole sequences, feeding its own
    predicted features for the path tokens."""
    feats = hidden[: len(ctx) - 1]
    tokens = list(ctx[1:])
    with torch.inference_mode():
        out = head(parts.embed[torch.tensor(tokens)][None], feats[None], torch.arange(len(tokens))[None])[0][0]
        for tok in path:
            tokens.append(tok)
            feats = torch.cat([feats, out[-1:]])
            out = head(parts.embed[torch.tensor(tokens)][None], feats[None], torch.arange(len(tokens))[None])[0][0]
        return torch.softmax(parts.logits(out[-1]), -1)


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_eagle_tree_probs_equal_whole_sequence_runs(target, draft_vocab) -> None:
    head, parts = random_head(target, "eagle", draft_vocab=draft_vocab, seed=1, std=0.15)
    ctx = prompt(0, 24)
    hidden = hidden_of(target, ctx)
    request = HeadDrafter(head, parts, DraftSettings(top_k=3, depth=4)).start(ctx[:10])
    request.observe_hidden(hidden[:9])
    request.propose(8)  # drafting once must not disturb the context state
    request.observe_hidden(hidden[9:15])
    request.commit(ctx[10:16])
    draft = request.propose(12)
    assert 0 < len(draft) <= 12 and draft.q is None
    t2d = {int(t): i for i, t in enumerate(head.d2t.tolist())}
    for i, path in enumerate(node_paths(draft)):
        ref = eagle_reference(head, parts, hidden, ctx[:16], path[:-1])
        assert abs(float(ref[t2d[path[-1]]]) - float(draft.probs[i])) < 1e-4, (i, path)
    assert max(len(p) for p in node_paths(draft)) >= 3


def test_mtp_modules_draft_by_depth(target) -> None:
    head, parts = random_head(target, "mtp", num_heads=2, seed=2, std=0.15)
    ctx = prompt(1, 20)
    n = len(ctx)
    hidden = hidden_of(target, ctx)
    request = HeadDrafter(head, parts, DraftSettings(top_k=3, depth=5)).start(ctx)
    request.observe_hidden(hidden[: n - 1])
    draft = request.propose(16)
    paths = node_paths(draft)
    assert max(len(p) for p in paths) == 2  # one level per module
    with torch.inference_mode():
        m1, m2 = head.module(1), head.module(2)
        out1, _ = m1(parts.embed[torch.tensor(ctx[1:])][None], hidden[: n - 1][None], torch.arange(n - 1)[None])
        out1 = out1[0]
        root = torch.softmax(parts.logits(head.output_features(out1[-1], 1)), -1)
        for i, path in enumerate(paths):
            if len(path) == 1:
                assert abs(float(root[path[0]]) - float(draft.probs[i])) < 1e-4
                continue
            tokens = ctx[2:] + [path[0]]  # module 2 at position j reads token j+2; the last row is the draft
            out2, _ = m2(parts.embed[torch.tensor(tokens)][None], out1[None], torch.arange(n - 1)[None])
            p2 = torch.softmax(parts.logits(head.output_features(out2[0, -1], 2)), -1)
            assert abs(float(p2[path[1]]) - float(draft.probs[i])) < 1e-4, path


def test_medusa_heads_read_the_newest_state(target) -> None:
    head, parts = random_head(target, "medusa", num_heads=3, seed=3, std=0.2)
    ctx = prompt(2, 15)
    hidden = hidden_of(target, ctx)
    request = HeadDrafter(head, parts, DraftSettings(top_k=2, depth=6)).start(ctx)
    request.observe_hidden(hidden[:14])
    draft = request.propose(20)
    with torch.inference_mode():
        probs = torch.softmax(parts.logits(head(hidden[13])), -1)  # [K, V]
    for i, path in enumerate(node_paths(draft)):
        assert len(path) <= 3
        assert abs(float(probs[len(path) - 1, path[-1]]) - float(draft.probs[i])) < 1e-5


def test_missing_hidden_states_give_an_empty_draft(target) -> None:
    head, parts = random_head(target, "eagle")
    request = HeadDrafter(head, parts).start(prompt(3, 10))
    assert len(request.propose(8)) == 0  # nothing observed
    request.observe_hidden(torch.zeros(5, 64))
    assert len(request.propose(8)) == 0  # 5 of 9 states
    with pytest.raises(ValueError, match=r"hidden states must be \[n, 64\]"):
        request.observe_hidden(torch.zeros(3, 7))


# ---- tree builders over synthetic distributions (fakes: unit tests only) -------------------------
def fake_expand(vocab: int, seed: int):
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2, -1)
    tokens_of: dict[int, int] = {}

    def expand(nodes, parents, tokens, depth):
        for n, t in zip(nodes, tokens):
            tokens_of[n] = t
        return table[torch.tensor(tokens)]

    return table, expand


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.integers(1, 6), depth=st.integers(1, 6), budget=st.integers(1, 40))
def test_topk_tree_invariants(seed, top_k, depth, budget) -> None:
    table, expand = fake_expand(12, seed)
    tree = topk_tree(table[0], expand, top_k=top_k, depth=depth, budget=budget)
    n = len(tree)
    assert 1 <= n <= budget
    cum = np.zeros(n)
    depths = np.zeros(n, int)
    for i, p in enumerate(tree.parents.tolist()):
        assert -1 <= p < i
        cum[i] = tree.logq[i] + (cum[p] if p >= 0 else 0.0)
        depths[i] = 1 + (depths[p] if p >= 0 else 0)
        parent_token = 0 if p < 0 else int(tree.tokens[p])
        assert abs(float(table[parent_token, tree.tokens[i]]) - float(tree.logq[i])) < 1e-5
    assert depths.max() <= depth
    assert np.all(np.diff(cum) <= 1e-6)  # best first: a budget cut keeps the best prefix
    for p in set(tree.parents.tolist()):
        kids = tree.tokens[tree.parents == p]
        assert len(set(kids.tolist())) == len(kids)  # siblings are distinct


def test_sampled_tree_shape_and_q_rows() -> None:
    table, expand = fake_expand(10, 5)
    g = torch.Generator().manual_seed(0)
    tree = sampled_tree(table[3], expand, width=3, depth=4, budget=10, temperature=0.8, generator=g)
    assert len(tree) == 9  # 3 chains of 3 (10 // 3)
    assert tree.q is not None and torch.allclose(tree.q.sum(-1), torch.ones(len(tree)))
    roots = np.flatnonzero(tree.parents == -1)
    assert len(set(tree.tokens[roots].tolist())) == 3  # drawn without replacement
    assert torch.allclose(tree.q[roots[0]], torch.softmax(table[3] / 0.8, -1))
    for i, p in enumerate(tree.parents.tolist()):
        assert float(tree.q[i, tree.tokens[i]]) > 0
        if p >= 0:
            assert torch.allclose(tree.q[i], torch.softmax(table[tree.tokens[p]] / 0.8, -1))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampled_tree(table[0], expand, width=2, depth=2, budget=4, temperature=0.0, generator=g)
