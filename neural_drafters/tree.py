"""Draft trees from a head's next-token distributions.

* ``topk_tree``: EAGLE-2's dynamic expansion (Li et al., arXiv 2406.16858). Depth 1 takes the root's
  top-k tokens; at every further depth the ``top_k`` candidates of highest cumulative log-probability among
  the ones just added are expanded (one head pass for all of them), each adding its own top-k children
  as candidates; finally the ``budget`` candidates of highest cumulative log-probability are kept (a
  parent always outranks its children, so the kept set is a tree). Deterministic: q is one-hot, and the
  verifier's per-node target rule keeps sampling exact.
* ``sampled_tree``: for sampling requests. The root's children are drawn without replacement from the
  draft distribution; each continues as a chain, one draw per depth. The shape never depends on a node's
  own value, so the verifier's multi-candidate rejection with the recorded q rows is exact (SpecInfer,
  arXiv 2305.09781; Sequoia's without-replacement variant, arXiv 2402.12374).

``expand(nodes, parents, tokens, depth)`` is the head: for candidate ids ``nodes`` (whose candidate
parents are ``parents``, -1 for the root, and whose draft-vocabulary tokens are ``tokens``, all at
``depth``) it returns log-probabilities ``[len(nodes), Vd]`` of their children.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

Expand = Callable[[list[int], list[int], list[int], int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class CandidateTree:
    """A draft in the head's own terms: draft-vocabulary ``tokens``, ``parents`` (-1 = child of the last
    committed token; parents first), conditional log-probabilities ``logq``, and for sampled trees the
    draft-vocabulary distribution each node was drawn from (``q`` [T, Vd], else None)."""

    tokens: np.ndarray  # [T] int64
    parents: np.ndarray  # [T] int32
    logq: np.ndarray  # [T] float32
    q: torch.Tensor | None = None  # [T, Vd]

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = CandidateTree(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32))


def topk_tree(root_logp: torch.Tensor, expand: Expand, *, top_k: int, depth: int, budget: int) -> CandidateTree:
    """EAGLE-2 dynamic tree of at most ``budget`` nodes and ``depth`` levels (see the module doc)."""
    if budget <= 0 or depth <= 0:
        return EMPTY
    k = min(top_k, root_logp.shape[-1])
    logq, tok = root_logp.float().topk(k)
    cand_tok = tok.tolist()
    cand_parent = [-1] * k
    cand_logq = logq.tolist()
    cand_cum = list(cand_logq)
    cand_depth = [1] * k
    frontier = list(range(k))
    for d in range(2, depth + 1):
        logp = expand(frontier, [cand_parent[i] for i in frontier], [cand_tok[i] for i in frontier], d - 1)
        lq, tk = logp.float().topk(k, dim=-1)  # [F, k]
        cum = torch.tensor([cand_cum[i] for i in frontier])[:, None] + lq  # [F, k]
        start = len(cand_tok)
        rows = torch.arange(len(frontier))[:, None].expand(-1, k)
        for r, t, q, c in zip(rows.flatten().tolist(), tk.flatten().tolist(), lq.flatten().tolist(),
                              cum.flatten().tolist()):
            cand_tok.append(t)
            cand_parent.append(frontier[r])
            cand_logq.append(q)
            cand_cum.append(c)
            cand_depth.append(d)
        best = cum.flatten().topk(min(k, cum.numel())).indices.tolist()
        frontier = [start + i for i in sorted(best)]
    n = len(cand_tok)
    # Rank by cumulative log-prob, ties to the shallower node then the earlier one: parents first.
    order = sorted(range(n), key=lambda i: (-cand_cum[i], cand_depth[i], i))[:budget]
    return _subset(order, cand_tok, cand_parent, cand_logq)


def sampled_tree(root_logp: torch.Tensor, expand: Expand, *, width: int, depth: int, budget: int,
                 temperature: float, generator: torch.Generator) -> CandidateTree:
    """``width`` chains whose first tokens are drawn without replacement, then one draw per depth."""
    if budget <= 0 or depth <= 0 or width <= 0:
        return EMPTY
    if not temperature > 0:
        raise ValueError(f"draft temperature must be > 0, got {temperature}")
    width = min(width, budget, root_logp.shape[-1])
    depth = min(depth, budget // width)
    q_root = torch.softmax(root_logp.float() / temperature, -1)
    first = torch.multinomial(q_root, width, replacement=False, generator=generator).tolist()
    tokens, parents, qs = list(first), [-1] * width, [q_root] * width
    ends = list(range(width))
    for d in range(2, depth + 1):
        logp = expand(ends, [parents[i] for i in ends], [tokens[i] for i in ends], d - 1)
        q = torch.softmax(logp.float() / temperature, -1)  # [width, Vd]
        draws = torch.multinomial(q, 1, generator=generator)[:, 0].tolist()
        new_ends = []
        for row, (end, t) in enumerate(zip(ends, draws)):
            tokens.append(t)
            parents.append(end)
            qs.append(q[row])
            new_ends.append(len(tokens) - 1)
        ends = new_ends
    q_rows = torch.stack(qs)  # [T, Vd]
    idx = torch.tensor(tokens)
    logq = q_rows[torch.arange(len(tokens)), idx].clamp_min(1e-30).log()
    # Chains were grown depth by depth: reorder parents-first is already true; keep the draw order.
    return CandidateTree(idx.numpy().astype(np.int64), np.asarray(parents, np.int32), logq.numpy().astype(np.float32),
                         q_rows)


def _subset(order: list[int], tok: list[int], parent: list[int], logq: list[float]) -> CandidateTree:
    remap = {old: new for new, old in enumerate(order)}
    parents = []
    for old in order:
        p = parent[old]
        assert p < 0 or p in remap, "a kept node's parent must be kept"  # invariant of the ranking
        parents.append(-1 if p < 0 else remap[p])
    return CandidateTree(
        np.asarray([tok[i] for i in order], np.int64),
        np.asarray(parents, np.int32),
        np.asarray([logq[i] for i in order], np.float32),
    )
