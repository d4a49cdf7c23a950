"""Per-step drafting figures, per tenant and in Prometheus, without touching the decode loop.

The engine's public seams are enough: every request's drafting session is wrapped (``MeteredProposer``)
and the draft budget is wrapped (``MeteredBudget``). On the engine thread a step runs
``session.propose`` -> ``budget.choose`` (the tree actually verified) -> verify -> ``session.commit``
(accepted draft tokens, then the bonus token). Walking the verified tree along the committed tokens
gives the accepted count exactly: the bonus token never matches a child of the last accepted node
(acceptance would have taken it). A stop condition that cuts the committed tokens only lowers it.

The wrapper also turns speculation off for requests that ask so (``SpeculationMode.OFF``): their
sessions propose nothing, and the step commits one token, exactly as plain decoding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpc_api.backend import TenantStats
from retrieval.draft_tree import DraftTree

MAX_POSITIONS = 64


@dataclass
class _Counts:
    num_requests: int = 0
    num_steps: int = 0
    num_drafted_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_beyond: list[int] = field(default_factory=lambda: [0] * MAX_POSITIONS)  # [i]: steps accepting > i
    drafter_steps: dict[str, int] = field(default_factory=dict)


class TenantAccounting:
    """Cumulative drafting figures per tenant since start-up (engine thread writes, others read)."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}
        self._lock = threading.Lock()

    def record_step(self, tenant: str, num_draft: int, num_accepted: int, source: str) -> None:
        with self._lock:
            c = self._counts.setdefault(tenant, _Counts())
            c.num_steps += 1
            if num_draft:
                c.num_drafted_steps += 1
                c.num_draft_tokens += num_draft
                c.num_accepted_tokens += num_accepted
                for i in range(min(num_accepted, MAX_POSITIONS)):
                    c.accepted_beyond[i] += 1
                name = source or "unknown"
                c.drafter_steps[name] = c.drafter_steps.get(name, 0) + 1

    def record_request(self, tenant: str) -> None:
        with self._lock:
            self._counts.setdefault(tenant, _Counts()).num_requests += 1

    def forget(self, tenant: str) -> None:
        with self._lock:
            self._counts.pop(tenant, None)

    def stats(self, tenant: str, **index_figures: int) -> TenantStats:
        """The tenant's figures; ``index_figures`` (index_tokens, ...) come from its index."""
        with self._lock:
            c = self._counts.get(tenant) or _Counts()
            last = max((i + 1 for i, n in enumerate(c.accepted_beyond) if n), default=0)
            by_pos = tuple(n / c.num_drafted_steps for n in c.accepted_beyond[:last]) if c.num_drafted_steps else ()
            return TenantStats(
                tenant_id=tenant, num_requests=c.num_requests, num_steps=c.num_steps,
                num_drafted_steps=c.num_drafted_steps, num_draft_tokens=c.num_draft_tokens,
                num_accepted_tokens=c.num_accepted_tokens, acceptance_by_position=by_pos,
                drafter_steps=dict(c.drafter_steps), **index_figures)


def accepted_along(tree: DraftTree, committed: Sequence[int] | np.ndarray) -> int:
    """How many of ``committed`` follow a root path of ``tree`` (the accepted draft tokens)."""
    if not len(tree) or not len(committed):
        return 0
    ids, parents = tree.token_ids, tree.parents
    node, k = -1, 0
    for tok in committed:
        hit = np.flatnonzero((parents == node) & (ids == tok))
        if not len(hit):
            break
        node, k = int(hit[0]), k + 1
    return k


class MeteredBudget:
    """Wraps the engine's ``DraftBudget``: remembers the tree each session will have verified."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.current: MeteredSession | None = None  # set by the session proposing right now

    @property
    def max_draft_tokens(self) -> int:
        return self.inner.max_draft_tokens

    def choose(self, tree: DraftTree, max_nodes: int, scale: float = 1.0, batch_size: int = 1) -> DraftTree:
        chosen = self.inner.choose(tree, max_nodes, scale, batch_size)
        if self.current is not None:
            self.current.verified = chosen
            self.current = None
        return chosen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class MeteredSession:
    def __init__(self, owner: MeteredProposer, inner: Any, tenant: str, speculate: bool) -> None:
        self._owner = owner
        self._inner = inner
        self._tenant = tenant
        self._speculate = speculate
        self.verified: DraftTree = DraftTree.empty()
        self._source = ""

    def propose(self, budget: int) -> DraftTree:
        owner = self._owner
        if not self._speculate:
            self.verified = DraftTree.empty()
            owner.budget.current = None
            return DraftTree.empty("off")
        t0 = time.perf_counter()
        tree = self._inner.propose(budget)
        owner.lookup_seconds = time.perf_counter() - t0
        owner.match_len = int(getattr(tree, "match_len", 0))
        self._source = tree.source
        self.verified = DraftTree.empty()  # until the budget says which part is verified
        owner.budget.current = self
        return tree

    def observe_hidden(self, states: Any) -> None:
        """The target's hidden states, for a session that drafts from them (neural drafters)."""
        observe = getattr(self._inner, "observe_hidden", None)
        if observe is not None:
            observe(states)

    def commit(self, token_ids: Sequence[int] | np.ndarray) -> None:
        tree = self.verified
        accepted = accepted_along(tree, token_ids)
        owner = self._owner
        owner.accounting.record_step(self._tenant, len(tree), accepted, self._source)
        if owner.metrics is not None:
            owner.metrics.observe_step(len(tree), accepted, None if not self._speculate else owner.lookup_seconds,
                                       owner.match_len if self._speculate else None, skipped=not self._speculate)
        self.verified = DraftTree.empty()
        self._inner.commit(token_ids)

    def finish(self, record: bool = True) -> None:
        self._owner.accounting.record_request(self._tenant)
        self._inner.finish(record=record)


class MeteredProposer:
    """Wraps a ``Proposer``: meters every session, and honours per-request speculation off."""

    def __init__(self, inner: Any, budget: MeteredBudget, accounting: TenantAccounting, metrics: Any = None) -> None:
        self.inner = inner
        self.budget = budget
        self.accounting = accounting
        self.metrics = metrics
        self.lookup_seconds = 0.0
        self.match_len = 0
        self._no_speculation: set[str] = set()
        self._lock = threading.Lock()

    def disable_speculation(self, request_id: str) -> None:
        """Call before submitting ``request_id``: its session will propose nothing."""
        with self._lock:
            self._no_speculation.add(request_id)

    def forget_request(self, request_id: str) -> None:
        """Drop a request's flag (it ended before its session began, e.g. cancelled in the queue)."""
        with self._lock:
            self._no_speculation.discard(request_id)

    def begin(self, tenant: str, session_id: str, prompt_ids: Any, request_id: str = "") -> MeteredSession:
        with self._lock:
            speculate = request_id not in self._no_speculation
            self._no_speculation.discard(request_id)
        inner = self.inner.begin(tenant, session_id, prompt_ids, request_id)
        return MeteredSession(self, inner, tenant, speculate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
