"""Tree layout, packed step batches and the float additive mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.draft_tree import DraftTree
from verifier.tree import additive_mask, chain_batch, check_additive_mask, layout_tree, pack_steps


@st.composite
def trees(draw, max_nodes: int = 24) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return DraftTree(np.array(tokens, np.int32), np.array(parents, np.int32), np.ones(n, np.float32))


def brute_ancestors(parents: list[int]) -> np.ndarray:
    n = len(parents) + 1
    anc = np.zeros((n, n), dtype=bool)
    for row in range(n):
        cur = row
        while cur >= 0:
            anc[row, cur] = True
            cur = parents[cur - 1] + 1 if cur > 0 else -1
    return anc


@settings(max_examples=100, deadline=None)
@given(trees())
def test_layout_matches_brute_force(tree: DraftTree) -> None:
    layout = layout_tree(tree)
    expected = brute_ancestors(tree.parents.tolist())
    assert np.array_equal(layout.ancestors, expected)
    assert np.array_equal(layout.depths[1:], tree.depths())
    assert layout.depths[0] == 0
    assert np.array_equal(layout.depths, expected.sum(axis=1) - 1)


def test_layout_rejects_bad_parents() -> None:
    tree = DraftTree(np.array([1, 2], np.int32), np.array([-1, 1], np.int32), np.ones(2, np.float32))
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        layout_tree(tree)
    tree = DraftTree(np.array([-3], np.int32), np.array([-1], np.int32), np.ones(1, np.float32))
    with pytest.raises(ValueError, match="negative token id -3"):
        layout_tree(tree)


def test_pack_pads_and_positions() -> None:
    a = layout_tree(
        DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, 0, -1], np.int32), np.ones(3, np.float32))
    )
    b = layout_tree(DraftTree.empty())
    batch = pack_steps([a, b], root_ids=[9, 4], prefix_lens=[10, 3])
    assert batch.input_ids.tolist() == [[9, 5, 6, 7], [4, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[10, 11, 12, 11], [3, 3, 3, 3]]
    assert batch.write_positions.tolist() == [[10, 11, 12, 13], [3, 4, 5, 6]]
    assert batch.kv_len == 14
    # padding rows see only themselves; real rows never see padding
    assert batch.tree_mask[1].tolist() == np.eye(4, dtype=bool).tolist()
    assert batch.tree_mask[0, 2].tolist() == [True, True, True, False]


def test_additive_mask_values() -> None:
    batch = pack_steps([layout_tree(DraftTree.chain([1, 2]))], [0], [3])
    mask = additive_mask(batch.prefix_lens, batch.tree_mask, batch.kv_len + 2, torch.float32)
    assert mask.shape == (1, 1, 3, 8) and mask.dtype == torch.float32
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],
    ]
    assert mask.min().item() == torch.finfo(torch.float32).min


def test_chain_batch_is_causal() -> None:
    batch = chain_batch([4, 5, 6], prefix_len=2)
    assert batch.position_ids.tolist() == [[2, 3, 4]]
    assert np.array_equal(batch.tree_mask[0], np.tril(np.ones((3, 3), dtype=bool)))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int8])
def test_non_float_masks_rejected(dtype) -> None:
    with pytest.raises(TypeError, match="float additive mask"):
        check_additive_mask(torch.ones(1, 1, 2, 2, dtype=dtype))
    check_additive_mask(torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16))
