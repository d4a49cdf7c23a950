"""How many draft nodes a step should verify: as many as expected acceptance pays for.

Cost model: by default the engine's own fit of step time by rows, measured on the host it runs on
(``StepCostFit``, reprise/engine/step_cost.py). A fixed ``CostModel`` is the alternative: ``reprise
tune``'s line (a step with ``d`` draft tokens costs ``a + b * d``; plain decoding costs ``a`` per
token), or a table of points (``CostModel.points``), used in preference to the line when given, since
on CPU the first draft tokens cost more than the line says (GEMV turns into GEMM).

Expected acceptance: node i's path probability is the product of its (calibrated) ``probs`` along its
ancestors; verifying the ``n`` nodes of highest path probability commits ``1 + sum(path probs)``
tokens in expectation. The policy keeps the ``n`` that maximises tokens per unit of cost, ``n = 0``
(a plain decoding step) included. In a batch of ``B`` requests the step's cost is shared. On vLLM each
request is laid out on its own rows, so each weighs its draft against its share of a step in which
every request drafts as much (``DraftBudget.share``) and larger batches verify fewer, surer draft
tokens. The own engine pads every request to the batch's widest draft, so there one width is chosen
for the whole batch (``DraftBudget.select_batch``). ``probs`` come from the drafter and can be
miscalibrated (prompt lookup says 1.0 for every node), so each request scales them by a running ratio
of the levels its drafts actually passed to the levels they were predicted to pass (``AcceptanceTracker``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from reprise.engine.step_cost import FALLBACK_POINTS, StepCostFit
from retrieval.draft_tree import DraftTree, conditional_probs, subtree
from retrieval.policy import DRAFT_TOKEN_COST

_NO_NODES = np.zeros(0, dtype=np.int32)

# A fixed cost line's default: a plain step is 1, a draft token adds DRAFT_TOKEN_COST (the one default of
# `reprise tune` and `reprise replay`'s estimate too; docs/verifier.md says where it was measured).
DEFAULT_A = 1.0
DEFAULT_B = DRAFT_TOKEN_COST
DEFAULT_POINTS = FALLBACK_POINTS


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step cost by number of draft tokens: ``points`` (draft tokens -> cost) if given, else ``a + b*d``."""

    a: float = DEFAULT_A
    b: float = DEFAULT_B
    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.a > 0 or self.b < 0:
            raise ValueError(f"cost model needs a > 0 and b >= 0, got a={self.a}, b={self.b}")
        if any(c <= 0 for _, c in self.points):
            raise ValueError(f"cost model points must be positive, got {self.points}")

    def cost(self, num_draft: np.ndarray, batch: int = 1) -> np.ndarray:
        """Cost of steps with ``num_draft`` draft tokens (vectorised; a fixed model is one batch size's,
        so ``batch`` does not change it)."""
        d = np.asarray(num_draft, dtype=np.float64)
        if self.points:
            xs, ys = zip(*sorted(self.points))
            inside = np.interp(d, xs, ys)
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else self.b
            return np.where(d > xs[-1], ys[-1] + slope * (d - xs[-1]), inside)
        return self.a + self.b * d


@dataclass(slots=True)
class AcceptanceTracker:
    """Running calibration of one request's draft probabilities: the ratio of draft levels passed to
    levels predicted, over recent steps (counts decay by ``decay`` per step, so a request that starts
    copying after a poor start is trusted again within a few steps). Pseudo-counts start it at 1."""

    passed: float = 1.0
    predicted: float = 1.0
    decay: float = 0.8

    @property
    def scale(self) -> float:
        return self.passed / self.predicted

    def update(self, tree: DraftTree, accepted: np.ndarray) -> None:
        """Count the levels the walk attempted: each accepted node passed one; the level after the last
        accepted node was attempted too when it had children. Predicted: the children's prob mass."""
        if len(tree) == 0:
            return
        parents = np.asarray(tree.parents)
        probs = conditional_probs(tree)
        self.passed *= self.decay
        self.predicted *= self.decay
        at = -1
        for node in list(accepted) + [None]:
            kids = parents == at
            if not kids.any():
                break
            self.predicted += min(1.0, float(probs[kids].sum()))
            if node is None:
                break
            self.passed += 1.0
            at = int(node)


@dataclass(frozen=True, slots=True)
class DraftBudget:
    """The per-step policy: cap, cost model, and whether to adapt to expected acceptance. The default
    cost model is a fresh ``StepCostFit``: the engine that runs this budget calibrates and refits it."""

    max_draft_tokens: int = 32
    cost_model: CostModel | StepCostFit = field(default_factory=StepCostFit)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")

    def ranked(self, tree: DraftTree, max_nodes: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """``tree``'s nodes in the order worth verifying and what each prefix of that order is worth:
        at most ``max_nodes`` node indices by path probability (ties: tree order, so every parent comes
        before its children), and ``gain[n]``, the tokens a step verifying the first ``n`` commits in
        expectation (``1 + sum`` of their path probabilities; ``gain[0]`` is a plain step's 1)."""
        n = len(tree)
        if n == 0 or max_nodes <= 0:
            return _NO_NODES, np.ones(1)
        parents = np.asarray(tree.parents, dtype=np.int64)
        path = np.clip(conditional_probs(tree) * scale, 0.0, 1.0)
        for i in range(n):  # parents precede children
            if parents[i] >= 0:
                path[i] *= path[parents[i]]
        order = np.lexsort((np.arange(n), -path))[: min(n, max_nodes)]
        return order, 1.0 + np.concatenate(([0.0], np.cumsum(path[order])))

    def select(self, tree: DraftTree, max_nodes: int, scale: float = 1.0, batch_size: int = 1) -> np.ndarray:
        """The nodes worth verifying, as sorted indices into ``tree``: at most ``max_nodes`` nodes of
        highest path probability, cut to the size that maximises expected tokens per unit of cost.
        Parents always come along (the indices are closed under parents).

        ``batch_size``: requests verified in the same step, each laid out on its own rows (vLLM's
        flattened batch). Their plain rows share the step's base cost, so each draft token costs
        relatively more as the batch grows (ArcticInference #185, vLLM #16258): a request's share of a
        step in which every one of the ``B`` requests verifies ``d`` draft tokens is
        ``cost(B * (1 + d) - 1) / B`` (the cost table is by rows beyond the first). A batch padded to
        its widest draft (the own engine's) is cut by ``select_batch`` instead."""
        order, gain = self.ranked(tree, max_nodes, scale)
        keep = len(order)
        if self.adaptive and keep:
            keep = int(np.argmax(gain / self.share(np.arange(keep + 1), batch_size)))
        return np.sort(order[:keep]).astype(np.int32)

    def select_batch(self, trees: Sequence[DraftTree], max_nodes: Sequence[int],
                     scales: Sequence[float]) -> list[np.ndarray]:  # fmt: skip
        """Each request's nodes worth verifying when the batch's requests are padded to one width (the
        own engine's runner: ``B`` requests of ``1 + w`` rows cost ``cost(B * (1 + w) - 1)`` however
        few nodes each fills). The width is chosen for the batch: the ``w`` that maximises the tokens
        every request commits in expectation, each verifying its best ``w`` nodes (or all it has), per
        unit of the step's cost. One request alone is ``select``'s cut; a request's wide tree no longer
        makes the whole batch pay for rows the others leave empty."""
        ranked = [self.ranked(t, m, s) for t, m, s in zip(trees, max_nodes, scales)]
        widest = max((len(order) for order, _ in ranked), default=0)
        width = widest
        if self.adaptive and widest:
            widths = np.arange(widest + 1)
            tokens = sum(gain[np.minimum(widths, len(gain) - 1)] for _, gain in ranked)
            width = int(np.argmax(tokens / self.cost_model.cost(len(ranked) * (1.0 + widths) - 1.0, len(ranked))))
        return [np.sort(order[:width]).astype(np.int32) for order, _ in ranked]

    def choose(self, tree: DraftTree, max_nodes: int, scale: float = 1.0, batch_size: int = 1) -> DraftTree:
        """The subtree of the nodes ``select`` keeps (``tree`` itself when it keeps them all)."""
        keep = self.select(tree, max_nodes, scale, batch_size)
        return tree if len(keep) == len(tree) else subtree(tree, keep)

    def share(self, num_draft: np.ndarray, batch_size: int = 1) -> np.ndarray:
        """One request's share of a step's cost when each of ``batch_size`` requests verifies
        ``num_draft`` draft tokens (vectorised; ``batch_size`` 1 is the cost model itself)."""
        b = max(1, int(batch_size))
        d = np.asarray(num_draft, dtype=np.float64)
        return self.cost_model.cost(b * (1.0 + d) - 1.0, b) / b
