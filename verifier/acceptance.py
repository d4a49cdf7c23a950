"""Which draft nodes to accept, given the target's outputs at every row of a step.

Two rules, both exact:

* **Per-node targets** (greedy, and sampling over deterministic drafts: suffix, corpus, exact-key, top-k
  neural trees, where q is one-hot). Every row gets one target token up front: its argmax (greedy) or
  one independent draw from its processed distribution. Walk from the root while some child's token
  equals the current row's target; emit the target of the last row reached as the bonus token. For
  sampling this is exactly the target distribution (the walk only ever uses the draws of the rows it
  visits, each a fresh draw from that row's p) and optimal for a fixed tree (acceptance at a row is the
  p-mass of its children). Same rule as EAGLE with q = 1 and HF prompt lookup with sampling.
* **Drafts sampled with known q** (SpecInfer, arXiv 2305.09781, multi-candidate speculative sampling;
  Sequoia, arXiv 2402.12374, its without-replacement variant). ``q[i]`` is the draft distribution
  node i was drawn from, i.e. its parent's; all children of one parent carry the same row. At a row
  with children x_1..x_k: accept x_j with probability min(1, p(x_j) / q(x_j)); on rejection
  p <- norm(max(0, p - q)) and, without replacement, q <- norm(q with x_j removed). If every child is
  rejected, emit a draw from the final residual p.
"""

from __future__ import annotations

import numpy as np
import torch

from verifier.tree import TreeLayout

Q_MODES = ("iid", "without_replacement")


def accept_by_targets(layout: TreeLayout, targets: np.ndarray) -> tuple[np.ndarray, int]:
    """Walk rule over per-row target tokens ``targets[1+T]``: (accepted node indices, bonus token).

    Vectorised: node i matches when its token equals its parent row's target; it is reachable when it
    and all its ancestors match; the accepted path ends at the deepest reachable node.
    """
    if layout.num_nodes == 0:
        return np.zeros(0, dtype=np.int32), int(targets[0])
    matches = layout.token_ids == targets[layout.parent_rows[1:]]  # [T]
    anc = layout.ancestors[1:, 1:]  # [T, T] among nodes
    reachable = ~(anc & ~matches[None, :]).any(axis=1)
    if not reachable.any():
        return np.zeros(0, dtype=np.int32), int(targets[0])
    depth = np.where(reachable, layout.depths[1:], 0)
    last = int(np.argmax(depth))  # deepest reachable node (first one on ties: duplicate siblings)
    path = np.nonzero(anc[last])[0].astype(np.int32)  # parents precede children: already root-to-leaf
    return path, int(targets[last + 1])


def accept_with_q(
    layout: TreeLayout,
    probs: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator,
    mode: str = "iid",
) -> tuple[np.ndarray, int]:
    """Multi-candidate rejection sampling over a tree of sampled drafts.

    ``probs`` [1+T, V] are the target's processed distributions at every row; ``q`` [T, V] the draft
    distribution of every node (its parent's). Returns (accepted node indices, emitted token).
    """
    if mode not in Q_MODES:
        raise ValueError(f"unknown draft q mode {mode!r}; use one of {Q_MODES}")
    children: dict[int, list[int]] = {}
    for node, parent_row in enumerate(layout.parent_rows[1:].tolist()):
        children.setdefault(parent_row, []).append(node)
    path: list[int] = []
    row = 0
    while True:
        p = probs[row].double()
        kids = children.get(row, [])
        if kids:
            qq = q[kids[0]].double().clone()  # without replacement: the shared parent q, shrinking
            uniforms = torch.rand(
                len(kids), generator=generator, device=p.device, dtype=torch.float64
            ).tolist()
            for node, u in zip(kids, uniforms):
                x = int(layout.token_ids[node])
                if mode == "iid":
                    qq = q[node].double()  # each child drawn independently from its own q (SpecInfer)
                qx = float(qq[x])
                if qx <= 0.0:
                    raise ValueError(f"draft node {node}: q gives its own token {x} zero probability")
                if u < min(1.0, float(p[x]) / qx):
                    path.append(node)
                    row = node + 1
                    break
                residual = (p - qq).clamp_min(0.0)
                total = float(residual.sum())
                if total > 0.0:  # total == 0 only when p == q, where rejection has probability 0
                    p = residual / total
                if mode == "without_replacement":
                    qq[x] = 0.0
                    mass = float(qq.sum())
                    if mass > 0.0:
                        qq = qq / mass
            else:
                return np.asarray(path, dtype=np.int32), _draw(p, generator)
            continue
        return np.asarray(path, dtype=np.int32), _draw(p, generator)


def _draw(p: torch.Tensor, generator: torch.Generator) -> int:
    cdf = p.cumsum(0)
    u = torch.rand(1, generator=generator, device=p.device, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1:], right=True).clamp_max(len(p) - 1))
