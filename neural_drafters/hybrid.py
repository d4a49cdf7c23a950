"""The hybrid proposer: retrieval first, a neural head and hidden-state reuse when retrieval is unsure.

    proposer = HybridProposer(make_proposer("reprise"), neural=NeuralProposer(drafter),
                              reuse=ReuseProposer(memory), settings=HybridSettings(threshold=2.0))

Every step the retrieval session drafts first. When its score (expected accepted tokens) reaches
``threshold`` its tree is used as is (SuffixDecoding's hybrid rule, arXiv 2411.04975 App. B.1: the
neural drafter is not even run). Below it:

* ``merge`` (default): one tree within the budget, merged as a trie (equal paths share nodes): the
  retrieval tree and the reuse continuation, higher score first, within ``budget - reserve`` nodes,
  then the neural tree's best nodes up to the budget;
* ``switch``: the reuse continuation and the neural tree only.

The neural and reuse parts need the target's hidden states: the engine hands the prompt's to sessions
that have ``observe_hidden`` and each step's in ``Verified.hidden_states`` (reprise/engine/engine.py). Without them (canonical replay, a wrapper that does not
forward them, a missing or failing head) the hybrid degrades to retrieval alone, with one logged warning.
The threshold is ``settings.threshold``, or a tenant's own ``DraftingConfig.hybrid_threshold`` when
its retrieval proposer holds settings for the tenant (``reprise tune --hybrid`` writes them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrieval.draft_tree import DraftTree, conditional_probs, path_probs
from retrieval.session import DraftSession, Proposer, Verified

log = logging.getLogger(__name__)

MODES = ("merge", "switch")
DEFAULT_THRESHOLD = 2.0


@dataclass(frozen=True, slots=True)
class NeuralDraftTree(DraftTree):
    """A neural draft whose nodes were *sampled*: ``q`` [T, V] holds the distribution each node was drawn
    from, and the verifier uses it (multi-candidate rejection, ``q_mode``). Deterministic top-k trees are
    plain ``DraftTree``s (q one-hot; the per-node target rule is exact for them)."""

    q: Any = None  # torch.Tensor [T, V]
    q_mode: str = "without_replacement"


@dataclass(frozen=True, slots=True)
class HybridSettings:
    threshold: float = DEFAULT_THRESHOLD
    mode: str = "merge"
    reserve: int = 8  # nodes kept for reuse + neural drafts in merge mode

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown hybrid mode {self.mode!r}; use one of {MODES}")
        if not self.threshold >= 0:
            raise ValueError(f"hybrid threshold must be >= 0, got {self.threshold}")
        if self.reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {self.reserve}")


# ---- adapters: neural_drafters' per-request drafters as DraftSessions ------------------------------
class _Warned:
    """Logs a drafter's failure once per proposer, not once per step."""

    def __init__(self) -> None:
        self.warned = False

    def warn(self, message: str, *args: Any) -> None:
        if not self.warned:
            self.warned = True
            log.warning(message, *args)


class NeuralProposer:
    """``Proposer`` over a trained head (``neural_drafters.drafting.HeadDrafter``)."""

    wants_hidden_states = True

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        self._warn = _Warned()

    def begin(self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray,
              request_id: str = "") -> NeuralSession:
        return NeuralSession(self, self.drafter.start([int(t) for t in prompt_ids]))


class NeuralSession:
    """Drafts with the head; an exception disables the head for this request (empty drafts)."""

    def __init__(self, owner: NeuralProposer, request: Any) -> None:
        self.owner, self.request, self.failed = owner, request, False

    @property
    def ready(self) -> bool:
        return not self.failed and self.request.ready

    def observe_hidden(self, states: Any) -> None:
        if not self.failed:
            self.request.observe_hidden(states)

    def propose(self, budget: int) -> DraftTree:
        if self.failed:
            return DraftTree.empty("neural")
        try:
            draft = self.request.propose(budget)
        except Exception as exc:  # noqa: BLE001 - a failing drafter means an empty draft, never a failed request
            self.failed = True
            self.owner._warn.warn("neural drafter failed (%s: %s); drafting without it", type(exc).__name__, exc)
            return DraftTree.empty("neural")
        if not len(draft):
            return DraftTree.empty("neural")
        if draft.q is not None:
            return NeuralDraftTree(draft.token_ids, draft.parents, draft.probs, draft.score, "neural",
                                   q=draft.q, q_mode=draft.q_mode)
        return DraftTree(draft.token_ids, draft.parents, draft.probs, draft.score, "neural")

    def commit(self, verified: Verified) -> None:
        if verified.hidden_states is not None:
            self.observe_hidden(verified.hidden_states)
        self.request.commit(verified.token_ids)

    def finish(self, record: bool = True) -> None:
        pass


SegmentSink = Callable[[str, str, Any], None]  # (tenant, session_id, neural_drafters.reuse.Segment)


class ReuseProposer:
    """``Proposer`` over hidden-state keyed reuse (``neural_drafters.reuse.HiddenStateMemory``).

    ``on_segment`` receives each recorded request's projected vectors, to persist them encrypted next
    to the tenant's trajectories (reprise/server/hidden_store.py)."""

    wants_hidden_states = True

    def __init__(self, memory: Any, on_segment: SegmentSink | None = None) -> None:
        self.memory = memory
        self.on_segment = on_segment

    def begin(self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray,
              request_id: str = "") -> ReuseSession:
        return ReuseSession(self, tenant, session_id, self.memory.start(tenant, [int(t) for t in prompt_ids]))


class ReuseSession:
    def __init__(self, owner: ReuseProposer, tenant: str, session_id: str, request: Any) -> None:
        self.owner, self.tenant, self.session_id, self.request = owner, tenant, session_id, request

    def observe_hidden(self, states: Any) -> None:
        self.request.observe_hidden(_numpy(states))

    def propose(self, budget: int) -> DraftTree:
        draft = self.request.propose(budget)
        if not len(draft):
            return DraftTree.empty("reuse")
        probs = np.full(len(draft), max(0.05, draft.similarity), np.float32)
        return DraftTree.chain(draft.token_ids, probs=probs, source="reuse")

    def commit(self, verified: Verified) -> None:
        if verified.hidden_states is not None:
            self.observe_hidden(verified.hidden_states)
        self.request.commit(verified.token_ids)

    def finish(self, record: bool = True) -> None:
        segment = self.request.finish(record)
        if segment is not None and self.owner.on_segment is not None:
            try:
                self.owner.on_segment(self.tenant, self.session_id, segment)
            except Exception:  # persisting is best effort: history is rebuildable
                log.exception("could not persist the hidden-state segment of tenant %s", self.tenant)


def _numpy(states: Any) -> np.ndarray:
    if hasattr(states, "detach"):
        return states.detach().float().cpu().numpy()
    return np.asarray(states, np.float32)


# ---- the hybrid -----------------------------------------------------------------------------------
class HybridProposer:
    """Retrieval, then reuse and neural drafts below ``settings.threshold`` (see the module doc)."""

    def __init__(self, retrieval: Proposer, neural: NeuralProposer | None = None,
                 reuse: ReuseProposer | None = None, settings: HybridSettings | None = None) -> None:
        self.retrieval = retrieval
        self.neural = neural
        self.reuse = reuse
        self.settings = settings or HybridSettings()
        self._warn = _Warned()

    @property
    def wants_hidden_states(self) -> bool:
        return self.neural is not None or self.reuse is not None

    def begin(self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray,
              request_id: str = "") -> HybridSession:
        parts = [self.retrieval.begin(tenant, session_id, prompt_ids, request_id)]
        reuse = self.reuse.begin(tenant, session_id, prompt_ids, request_id) if self.reuse else None
        neural = self.neural.begin(tenant, session_id, prompt_ids, request_id) if self.neural else None
        own = getattr(self.retrieval, "tenant_config", None)
        config = own(tenant) if own is not None else None
        threshold = config.hybrid_threshold if config is not None else self.settings.threshold
        return HybridSession(self, parts[0], reuse, neural, threshold)

    def __getattr__(self, name: str) -> Any:  # index operations (load_history, stats) go to retrieval
        if name in ("retrieval", "neural", "reuse", "settings", "_warn"):
            raise AttributeError(name)
        return getattr(self.retrieval, name)


class HybridSession:
    """One request's parts; remembers which part's nodes each step's tree holds, so that every part is
    told which of its own nodes the verifier accepted (never re-walked)."""

    def __init__(self, owner: HybridProposer, retrieval: DraftSession, reuse: ReuseSession | None,
                 neural: NeuralSession | None, threshold: float | None = None) -> None:
        self.owner, self.retrieval, self.reuse, self.neural = owner, retrieval, reuse, neural
        self.threshold = owner.settings.threshold if threshold is None else threshold
        self._hidden_seen = False
        self.steps_by_source: dict[str, int] = {}
        self._origins: list[tuple[Any, np.ndarray]] = []  # (part, its node -> node of the tree proposed)

    def observe_hidden(self, states: Any) -> None:
        """The prompt's hidden states (the engine's prefill)."""
        self._hidden_seen = True
        states = _cpu(states)
        for part in (self.reuse, self.neural):
            if part is not None:
                part.observe_hidden(states)

    def propose(self, budget: int) -> DraftTree:
        s = self.owner.settings
        tree = self.retrieval.propose(budget)
        if tree.score >= self.threshold or budget <= 0:
            return self._use(tree, [(self.retrieval, tree)])
        if not self._hidden_seen:
            if self.reuse is not None or self.neural is not None:
                self.owner._warn.warn("hybrid drafter receives no hidden states: drafting by retrieval alone")
            return self._use(tree, [(self.retrieval, tree)])
        reuse = self.reuse.propose(budget) if self.reuse is not None else DraftTree.empty()
        neural = self.neural.propose(budget) if self.neural is not None else DraftTree.empty()
        if s.mode == "switch":
            picked = [(p, t) for p, t in ((self.reuse, reuse), (self.neural, neural)) if len(t)]
            if len(picked) == 1:
                return self._use(picked[0][1], picked)  # a sampled neural tree keeps its q
            if not picked:
                return self._use(tree, [(self.retrieval, tree)])
            return self._merged(picked, budget)
        # merge: the copy drafts (retrieval, reuse) by expected accepted tokens, then the head's best nodes
        # in the nodes kept for it (``reserve``); equal paths share nodes, so agreeing drafts cost nothing.
        copies = sorted(((p, t) for p, t in ((self.retrieval, tree), (self.reuse, reuse)) if len(t)),
                        key=lambda pt: -pt[1].score)
        if not len(neural):
            return self._merged(copies, budget) if copies else self._use(tree, [(self.retrieval, tree)])
        if not copies:
            return self._use(neural, [(self.neural, neural)])
        reserve = min(s.reserve, len(neural), budget // 2)
        first_origins: list[np.ndarray] = []
        first = merge_trees([t for _, t in copies], budget - reserve, first_origins)
        second_origins: list[np.ndarray] = []
        merged = merge_trees([first, neural], budget, second_origins)
        to_merged = second_origins[0]
        parts = [(p, _compose(o, to_merged)) for (p, _), o in zip(copies, first_origins)]
        parts.append((self.neural, second_origins[1]))
        self._origins = parts
        return self._count(merged)

    def _use(self, tree: DraftTree, parts: list[tuple[Any, DraftTree]]) -> DraftTree:
        """``tree`` is one part's own tree: its nodes are that part's."""
        part = next(p for p, t in parts if t is tree)
        self._origins = [(part, np.arange(len(tree), dtype=np.int32))]
        return self._count(tree)

    def _merged(self, parts: list[tuple[Any, DraftTree]], budget: int) -> DraftTree:
        origins: list[np.ndarray] = []
        merged = merge_trees([t for _, t in parts], budget, origins)
        self._origins = [(p, o) for (p, _), o in zip(parts, origins)]
        return self._count(merged)

    def _count(self, tree: DraftTree) -> DraftTree:
        source = tree.source or "none"
        self.steps_by_source[source] = self.steps_by_source.get(source, 0) + 1
        return tree

    def commit(self, verified: Verified) -> None:
        hidden = None if verified.hidden_states is None else _cpu(verified.hidden_states)
        if hidden is not None:
            self._hidden_seen = True
        mapped = {part: origin for part, origin in self._origins} if verified.draft_verified else {}
        self._origins = []
        for part in (self.retrieval, self.reuse, self.neural):
            if part is None:
                continue
            origin = mapped.get(part)
            if origin is None:
                part.commit(Verified(verified.token_ids, hidden_states=hidden))
            else:
                part.commit(Verified(verified.token_ids, _accepted_in(origin, verified.accepted), True, hidden))

    def finish(self, record: bool = True) -> None:
        for part in (self.retrieval, self.reuse, self.neural):
            if part is not None:
                part.finish(record)


def _cpu(states: Any) -> Any:
    return states.detach().float().cpu() if hasattr(states, "detach") else states


def _compose(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Node maps ``a -> b`` then ``b -> c`` as ``a -> c`` (-1 stays -1)."""
    return np.where(first >= 0, second[np.maximum(first, 0)], -1).astype(np.int32)


def _accepted_in(origin: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """The accepted path of the proposed tree, as one part's nodes (``origin``: part node -> proposed
    node, -1 when dropped): the part's nodes on the path, root to leaf, as far as the part drafted it."""
    depth_of = {int(node): depth for depth, node in enumerate(accepted.tolist())}
    at_depth: dict[int, int] = {}
    for node, target in enumerate(origin.tolist()):
        depth = depth_of.get(target)
        if depth is not None and depth not in at_depth:
            at_depth[depth] = node
    path: list[int] = []
    while len(path) in at_depth:
        path.append(at_depth[len(path)])
    return np.asarray(path, dtype=np.int32)


# ---- tree surgery ---------------------------------------------------------------------------------
# Trees arrive with conditional probabilities (the DraftTree contract) or path probabilities (the suffix
# index stores those); retrieval.draft_tree.path_probs tells them apart by their score. Merged trees are conditional.
def merge_trees(trees: Sequence[DraftTree], budget: int, origins: list[np.ndarray] | None = None) -> DraftTree:
    """Merge trees as a trie (equal root paths share a node, keeping the higher probability) in priority
    order, each best node first, stopping at ``budget`` nodes. Sampled-q trees lose their q (a
    merged node was not drawn from it), which keeps verification exact under the per-node target rule.
    ``origins``, when given, receives one array per input tree: its node -> the merged node (-1: cut)."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    index: dict[tuple[int, int], int] = {}
    sources: list[str] = []
    for tree in trees:
        if not len(tree):
            if origins is not None:
                origins.append(np.zeros(0, dtype=np.int32))
            continue
        # Best nodes first (path probability, ties in tree order: parents still precede children), so
        # that a budget cut keeps each tree's likeliest nodes.
        order = np.lexsort((np.arange(len(tree)), -path_probs(tree))).tolist()
        ids, pars, conds = (np.asarray(tree.token_ids).tolist(), np.asarray(tree.parents).tolist(),
                            conditional_probs(tree).tolist())
        mapped: dict[int, int] = {}
        for i in order:
            tok, par, prob = ids[i], pars[i], conds[i]
            parent = -1 if par < 0 else mapped[par]
            if parent == -2:  # the parent did not fit
                mapped[i] = -2
                continue
            node = index.get((parent, tok))
            if node is None:
                if len(tokens) >= budget:
                    mapped[i] = -2
                    continue
                node = index[(parent, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                probs.append(prob)
                if tree.source and tree.source not in sources:
                    sources.append(tree.source)
            else:
                probs[node] = max(probs[node], prob)
            mapped[i] = node
        if origins is not None:
            origins.append(np.asarray([max(mapped[i], -1) for i in range(len(tree))], dtype=np.int32))
    cond = np.asarray(probs, np.float64)
    path = cond.copy()
    for i, p in enumerate(parents):
        if p >= 0:
            path[i] *= path[p]
    return DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32), cond.astype(np.float32),
                     float(path.sum()), "+".join(sources), trees[0].match_len if trees else 0)
