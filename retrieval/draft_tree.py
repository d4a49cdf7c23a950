"""The draft tree that crosses from drafters to the verifier (../shared/DESIGN.md, Contracts)."""

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
