"""One path per step, for verifiers that check chains (vLLM's rejection sampler), not trees.

A chain verifier accepts the longest prefix of a single draft path. From a calibrated draft tree
(``DraftTree.probs[i]`` = the chance node ``i`` is right given its parent is) the path to send is the
one with the most expected accepted tokens: for a path ``n_1 .. n_d`` that is the sum of its nodes'
path probabilities (the chance that the root path up to the node is accepted), which parents-before-
children order computes in one pass.

A tree of ``budget`` nodes spends nodes on branches a chain cannot use, so a chain session asks the
drafter for a wider tree (``tree_factor`` x the chain's length) and keeps its best path: the drafter's
best-first growth then reaches deeper along the likely path. Measured on agent traces (docs/replay.md,
"chain drafting"), this is what keeps a chain close to the tree's tau.

    proposer = ChainProposer(RepriseProposer(config))
    session = proposer.begin(tenant, session_id, prompt_ids)
    chain = session.propose(32)            # a DraftTree that is a chain of <= 32 nodes
    session.commit(Verified(token_ids, accepted_chain_nodes, draft_verified=True))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from retrieval.draft_tree import DraftTree
from retrieval.session import Verified

DEFAULT_TREE_FACTOR = 2


def best_path(tree: DraftTree, max_len: int) -> DraftTree:
    """The root path of ``tree``, at most ``max_len`` nodes, with the most expected accepted tokens.

    The chain keeps each node's ``probs`` entry as the tree had it (path probabilities stay path
    probabilities); its score is the path's expected accepted count. An empty tree or ``max_len`` <= 0
    gives an empty tree (same source).
    """
    return best_path_nodes(tree, max_len)[0]


def best_path_nodes(tree: DraftTree, max_len: int) -> tuple[DraftTree, np.ndarray]:
    """``best_path`` and the tree's node index of each of its nodes ([len(chain)] int64)."""
    n = len(tree)
    if n == 0 or max_len <= 0:
        return DraftTree.empty(tree.source), np.zeros(0, dtype=np.int64)
    parents = tree.parents
    if n <= max_len and bool(np.all(parents == np.arange(-1, n - 1, dtype=parents.dtype))):
        return tree, np.arange(n, dtype=np.int64)  # already a chain within the limit
    value, _ = _path_values(tree, max_len)
    idx = _root_path(parents, int(np.argmax(value)))
    chain_parents = np.arange(-1, len(idx) - 1, dtype=np.int32)
    chain = DraftTree(tree.token_ids[idx], chain_parents, tree.probs[idx], float(value[idx[-1]]), tree.source,
                      tree.match_len)
    return chain, idx


def best_path_per_root(tree: DraftTree, max_len: int) -> list[np.ndarray]:
    """For each root of ``tree``, the node indices of its best path (as ``best_path`` chooses among the
    paths under that root), best root first: what a chain verifier could be sent had the first token been
    chosen otherwise (``reprise replay --chain --headroom`` measures what that would win)."""
    return root_paths(tree, max_len)[0]


def root_paths(tree: DraftTree, max_len: int) -> tuple[list[np.ndarray], np.ndarray]:
    """``best_path_per_root`` and each path's expected accepted tokens ([num_roots] float64, descending):
    what a re-ranking of the first token trades against (``reprise.backends.vllm.first_token``)."""
    if len(tree) == 0 or max_len <= 0:
        return [], np.zeros(0)
    value, root = _path_values(tree, max_len)
    best: dict[int, int] = {}  # root -> its node with the highest value
    for i, r in enumerate(root.tolist()):
        if value[i] >= 0 and (r not in best or value[i] > value[best[r]]):
            best[r] = i
    leaves = sorted(best.values(), key=lambda i: (-value[i], i))  # first: best_path's (argmax: lowest index)
    return [_root_path(tree.parents, leaf) for leaf in leaves], value[leaves]


def _path_values(tree: DraftTree, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Each node's expected accepted tokens if the chain sent were its root path ([num_nodes] float64;
    -1 for nodes deeper than ``max_len``), and the root each node hangs from ([num_nodes] int64)."""
    n = len(tree)
    path_probs = _path_probs(tree)  # [num_nodes] chance the whole root path to the node is accepted
    value = np.empty(n)
    depth = np.empty(n, dtype=np.int64)
    root = np.empty(n, dtype=np.int64)
    for i, p in enumerate(tree.parents.tolist()):  # parents precede children
        if p < 0:
            value[i], depth[i], root[i] = path_probs[i], 1, i
        else:
            value[i] = value[p] + path_probs[i]
            depth[i] = depth[p] + 1
            root[i] = root[p]
    value[depth > max_len] = -1.0
    return value, root


def _root_path(parents: np.ndarray, node: int) -> np.ndarray:
    """The node indices from the root down to ``node`` ([depth] int64)."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    path.reverse()
    return np.asarray(path, dtype=np.int64)


def _path_probs(tree: DraftTree) -> np.ndarray:
    """Each node's probability that its whole root path is accepted. [num_nodes] float64.

    ``probs`` hold either that already (the suffix-index drafters: a node's probability is its parent's
    times its own estimate) or the conditional probability of the DraftTree contract (``DraftTree.chain``);
    which one is read off ``score``, the expected accepted count, i.e. the sum of the path probabilities.
    """
    probs = np.clip(tree.probs.astype(np.float64), 0.0, 1.0)
    chained = probs.copy()
    for i, p in enumerate(tree.parents.tolist()):  # parents precede children
        if p >= 0:
            chained[i] *= chained[p]
    return probs if abs(tree.score - probs.sum()) + 1e-6 < abs(tree.score - chained.sum()) else chained


class ChainSession:
    """A drafting session whose proposals are single paths (see the module docstring)."""

    __slots__ = ("_factor", "_inner", "_nodes", "tree")

    def __init__(self, inner: Any, tree_factor: int) -> None:
        self._inner = inner
        self._factor = tree_factor
        self._nodes: np.ndarray | None = np.zeros(0, dtype=np.int64)  # the tree node of each node of the last chain (None: send_other)
        self.tree = DraftTree.empty()  # the tree the last chain was taken from

    def propose(self, budget: int) -> DraftTree:
        """The best path, at most ``budget`` tokens, of a tree of ``tree_factor * budget`` nodes."""
        if budget <= 0:
            self._nodes = np.zeros(0, dtype=np.int64)
            self.tree = DraftTree.empty()
            return self.tree
        self.tree = self._inner.propose(budget * self._factor)
        chain, self._nodes = best_path_nodes(self.tree, budget)
        verify_only = getattr(self._inner, "verify_only", None)
        if verify_only is not None:  # its acceptance monitor must judge the chain, not the tree
            verify_only(chain)
        return chain

    def send(self, nodes: np.ndarray) -> DraftTree:
        """Send another root path of the last proposed ``tree`` instead of its best one (``nodes``: tree
        node indices from a root down, e.g. one of ``root_paths``); returns it as a chain."""
        idx = np.asarray(nodes, dtype=np.int64)
        tree = self.tree
        probs = tree.probs[idx]
        chain = DraftTree(tree.token_ids[idx], np.arange(-1, len(idx) - 1, dtype=np.int32), probs,
                          float(_path_probs(tree)[idx].sum()), tree.source, tree.match_len)
        self._nodes = idx
        verify_only = getattr(self._inner, "verify_only", None)
        if verify_only is not None:
            verify_only(chain)
        return chain

    def send_other(self, chain: DraftTree) -> DraftTree:
        """Send ``chain``, which is no path of the last proposed ``tree`` (another drafter's, e.g. a neural
        fallback's): at commit the inner session is told that none of its tree was verified."""
        self._nodes = None
        return chain

    def commit(self, verified: Verified) -> None:
        """``verified.accepted`` names nodes of the chain; the inner session is told its tree's nodes."""
        if self._nodes is None:  # the chain was another drafter's (``send_other``)
            self._nodes = np.zeros(0, dtype=np.int64)
            self._inner.commit(replace(verified, accepted=np.zeros(0, dtype=np.int32), draft_verified=False))
            return
        accepted = self._nodes[np.asarray(verified.accepted, dtype=np.int64)].astype(np.int32)
        self._inner.commit(replace(verified, accepted=accepted))

    def finish(self, record: bool = True) -> None:
        self._inner.finish(record=record)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ChainProposer:
    """Wraps a ``Proposer``: every session proposes its best path instead of a tree."""

    def __init__(self, inner: Any, tree_factor: int = DEFAULT_TREE_FACTOR) -> None:
        if tree_factor < 1:
            raise ValueError(f"tree_factor must be >= 1, got {tree_factor}")
        self.inner = inner
        self.tree_factor = tree_factor

    def begin(self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray,
              request_id: str = "") -> ChainSession:
        return ChainSession(self.inner.begin(tenant, session_id, prompt_ids, request_id), self.tree_factor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
