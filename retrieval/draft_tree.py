"""The draft tree that crosses from drafters to the verifier (docs/architecture.md, "Contracts")."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class DraftTree:
    """A tree of draft tokens to verify after the last committed token.

    Invariants: ``token_ids``, ``parents`` and ``probs`` have one entry per node; ``parents[i]`` is -1
    (child of the last committed token) or an index ``< i`` (parents precede children); ``probs[i]`` is
    the drafter's confidence that node ``i`` is accepted given its parent is; ``score`` is the expected
    number of accepted tokens; ``source`` names the drafter (or ``"merged"``).
    """

    token_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # [num_nodes] int32
    parents: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # [num_nodes] int32
    probs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)  # [num_nodes] float32
    score: float = 0.0
    source: str = ""
    match_len: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.probs) != n:
            raise ValueError(
                f"DraftTree arrays differ in length: token_ids {n}, parents {len(self.parents)}, "
                f"probs {len(self.probs)}"
            )

    @classmethod
    def empty(cls, source: str = "") -> DraftTree:
        """A tree with no nodes: the step still commits one token."""
        return cls(source=source)

    @classmethod
    def chain(cls, token_ids, probs=None, source: str = "", score: float | None = None) -> DraftTree:
        """A single path: node i is the child of node i-1."""
        ids = np.asarray(token_ids, dtype=np.int32)
        n = len(ids)
        parents = np.arange(-1, n - 1, dtype=np.int32)
        p = np.ones(n, dtype=np.float32) if probs is None else np.asarray(probs, dtype=np.float32)
        if score is None:
            score = float(np.cumprod(p).sum()) if n else 0.0
        return cls(ids, parents, p, float(score), source)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def validate(self) -> None:
        """Check the structural invariants; raise ValueError naming the first bad node."""
        for i, p in enumerate(self.parents.tolist()):
            if not -1 <= p < i:
                raise ValueError(f"DraftTree node {i} has parent {p}: parents must be -1 or precede the node")

    def depths(self) -> np.ndarray:
        """Depth of every node (1 for children of the last committed token)."""
        d = np.zeros(self.num_nodes, dtype=np.int32)
        for i, p in enumerate(self.parents.tolist()):
            d[i] = 1 if p < 0 else d[p] + 1
        return d


def path_probs(tree: DraftTree) -> np.ndarray:
    """Probability that each node is accepted: the product of ``probs`` along its path when ``probs``
    are conditional (the DraftTree contract), or ``probs`` itself when the drafter stored path
    probabilities. Which one is read off ``score`` (expected accepted tokens = the sum of path
    probabilities): the suffix-index drafters store path probabilities, ``DraftTree.chain`` conditional
    ones. [num_nodes] float64."""
    parents = np.asarray(tree.parents, dtype=np.int64)
    probs = np.clip(np.asarray(tree.probs, dtype=np.float64), 0.0, 1.0)
    chained = probs.copy()
    for i in range(len(chained)):  # parents precede children
        if parents[i] >= 0:
            chained[i] *= chained[parents[i]]
    as_given, as_chained = abs(tree.score - probs.sum()), abs(tree.score - chained.sum())
    return probs if as_given + 1e-6 < as_chained else chained


def conditional_probs(tree: DraftTree) -> np.ndarray:
    """Probability that each node is accepted given its parent is. [num_nodes] float64."""
    path = path_probs(tree)
    parents = np.asarray(tree.parents, dtype=np.int64)
    parent_path = np.where(parents >= 0, path[np.maximum(parents, 0)], 1.0)
    return np.divide(path, parent_path, out=np.zeros_like(path), where=parent_path > 0)


def subtree(tree: DraftTree, nodes: np.ndarray) -> DraftTree:
    """The nodes ``nodes`` (sorted, closed under parents) of ``tree`` as a new tree, parents remapped."""
    if len(nodes) == 0:
        return DraftTree.empty(tree.source)
    remap = np.full(len(tree), -1, dtype=np.int64)
    remap[nodes] = np.arange(len(nodes))
    old_parents = np.asarray(tree.parents, dtype=np.int64)[nodes]
    new_parents = np.where(old_parents >= 0, remap[np.maximum(old_parents, 0)], -1)
    if np.any((old_parents >= 0) & (new_parents < 0)):
        raise ValueError("subtree nodes must include every kept node's parent")
    # Conditional probabilities, whatever the input stored: the DraftTree contract.
    probs = conditional_probs(tree)[nodes].astype(np.float32)
    return DraftTree(
        np.asarray(tree.token_ids, dtype=np.int32)[nodes],
        new_parents.astype(np.int32),
        probs,
        float(path_probs(tree)[nodes].sum()),
        tree.source,
        tree.match_len,
    )
