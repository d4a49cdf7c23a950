"""Tree layout of one verification step: rows, depths, ancestor masks, and the packed batch.

One request's step feeds ``1 + T`` rows to the model: row 0 is the *root*, the last committed token
whose KV is not yet cached (the previous step's bonus token, or the prompt's last token); rows ``1..T``
are the draft tree's nodes in the tree's own (parents-first) order. Row ``r`` sits at position
``cache_len + depth[r]`` and attends to the whole cached prefix plus its ancestors-or-self among the rows.
Several requests pack into one forward pass by padding every request to the same number of rows
(padding rows attend only to themselves and are never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from retrieval.draft_tree import DraftTree


@dataclass(frozen=True, slots=True)
class TreeLayout:
    """Derived structure of one request's step rows (root + T nodes).

    ``parent_rows[r]`` is the row of row r's parent (-1 for the root); ``depths[r]`` is 0 for the root;
    ``ancestors[r, c]`` is True when row c is row r or one of its ancestors (so column 0 is all True).
    """

    token_ids: np.ndarray  # [T] int64, the draft tokens (rows 1..T)
    parent_rows: np.ndarray  # [1+T] int64
    depths: np.ndarray  # [1+T] int64
    ancestors: np.ndarray  # [1+T, 1+T] bool

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        return len(self.token_ids) + 1


def layout_tree(tree: DraftTree) -> TreeLayout:
    """Validate ``tree`` and derive its rows; raise ValueError naming the first bad node."""
    parents = np.asarray(tree.parents, dtype=np.int64)
    num_nodes = len(parents)
    nodes = np.arange(num_nodes)
    bad = np.nonzero((parents < -1) | (parents >= nodes))[0]
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"DraftTree node {i} has parent {int(parents[i])}: parents must be -1 or precede the node"
        )
    token_ids = np.asarray(tree.token_ids, dtype=np.int64)
    if num_nodes and token_ids.min() < 0:
        raise ValueError(f"DraftTree has a negative token id {int(token_ids.min())}")
    parent_rows = np.concatenate(([-1], parents + 1))  # node i is row i+1; the root is row 0
    num_rows = num_nodes + 1
    ancestors = np.eye(num_rows, dtype=bool)
    depths = np.zeros(num_rows, dtype=np.int64)
    # Climb one generation per iteration for every row at once: as many iterations as the tree is deep.
    rows = np.arange(num_rows)
    cur = parent_rows.copy()
    while True:
        live = cur >= 0
        if not live.any():
            break
        ancestors[rows[live], cur[live]] = True
        depths[live] += 1
        cur[live] = parent_rows[cur[live]]
    return TreeLayout(token_ids, parent_rows, depths, ancestors)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Host-side inputs of one packed forward pass over B requests, padded to Q rows each."""

    input_ids: np.ndarray  # [B, Q] int64
    position_ids: np.ndarray  # [B, Q] int64
    write_positions: np.ndarray  # [B, Q] int64, the cache row each input row's KV is written to
    prefix_lens: np.ndarray  # [B] int64, cached rows before this step (visible to every row)
    tree_mask: np.ndarray  # [B, Q, Q] bool, ancestor-or-self among the step's rows; padding sees itself
    kv_len: int  # keys the attention reads per request: max(prefix_lens) + Q
    causal: bool = False  # one request's chain from position 0: plain causal attention, no mask needed

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[1]


def pack_steps(
    layouts: Sequence[TreeLayout], root_ids: Sequence[int], prefix_lens: Sequence[int]
) -> StepBatch:
    """Pad every request's rows to the longest and stack them (the "pad" form of packing)."""
    batch = len(layouts)
    q = max(layout.num_rows for layout in layouts)
    input_ids = np.zeros((batch, q), dtype=np.int64)
    depths = np.zeros((batch, q), dtype=np.int64)
    tree_mask = np.zeros((batch, q, q), dtype=bool)
    tree_mask[:, np.arange(q), np.arange(q)] = True
    for b, layout in enumerate(layouts):
        n = layout.num_rows
        input_ids[b, 0] = root_ids[b]
        input_ids[b, 1:n] = layout.token_ids
        depths[b, :n] = layout.depths
        tree_mask[b, :n, :n] = layout.ancestors
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    write_positions = prefix[:, None] + np.arange(q)[None, :]
    return StepBatch(
        input_ids=input_ids,
        position_ids=prefix[:, None] + depths,
        write_positions=write_positions,
        prefix_lens=prefix,
        tree_mask=tree_mask,
        kv_len=int(prefix.max()) + q,
    )


def chain_batch(token_ids: Sequence[int], prefix_len: int) -> StepBatch:
    """One request's plain causal chunk (prefill): rows are consecutive tokens."""
    ids = np.asarray(token_ids, dtype=np.int64)[None, :]
    q = ids.shape[1]
    positions = prefix_len + np.arange(q, dtype=np.int64)[None, :]
    return StepBatch(
        input_ids=ids,
        position_ids=positions,
        write_positions=positions.copy(),
        prefix_lens=np.array([prefix_len], dtype=np.int64),
        tree_mask=np.tril(np.ones((q, q), dtype=bool))[None],
        kv_len=prefix_len + q,
        causal=prefix_len == 0,
    )


def additive_mask(prefix_lens, tree_mask, kv_len: int, dtype):
    """The float additive 4D mask ``[B, 1, Q, kv_len]``: 0 where a row may attend, the dtype's minimum
    elsewhere. Every cached column below the row's prefix length is visible; the step's own columns
    follow ``tree_mask``; columns past a request's own rows are hidden.

    Float, never bool or int: a bool or int mask has given silently wrong logits under eager attention.
    """
    prefix_lens = torch.as_tensor(prefix_lens)
    tree_mask = torch.as_tensor(tree_mask, dtype=torch.bool)
    batch, q, _ = tree_mask.shape
    device = tree_mask.device
    cols = torch.arange(kv_len, device=device)  # [L]
    prefix = prefix_lens.to(device)[:, None]  # [B, 1]
    visible = (cols[None, :] < prefix)[:, None, :].expand(batch, q, kv_len).clone()  # [B, Q, L]
    rel = cols[None, :] - prefix  # [B, L] column index within the step's rows
    in_step = (rel >= 0) & (rel < q)
    gathered = torch.gather(tree_mask, 2, rel.clamp(0, q - 1)[:, None, :].expand(batch, q, kv_len))
    visible |= gathered & in_step[:, None, :]
    mask = torch.zeros((batch, 1, q, kv_len), dtype=dtype, device=device)
    return mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)


def check_additive_mask(mask) -> None:
    """Raise TypeError unless ``mask`` is a floating-point tensor (see :func:`additive_mask`)."""
    if not mask.is_floating_point():
        raise TypeError(
            f"attention mask must be a float additive mask (0 / dtype min), got dtype {mask.dtype}: "
            "bool and int masks have given silently wrong logits under eager attention"
        )
