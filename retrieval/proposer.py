"""The full Reprise proposer: one calibrated draft tree from the request's own context, the tenant's
history and the tenant's corpus, each also matched with numbers canonicalised.

    proposer = RepriseProposer(DraftingConfig())
    proposer.set_vocabulary(decode, vocab_size)     # optional: enables canonical matching
    session = proposer.begin("acme", "session-7", prompt_ids)
    tree = session.propose(32)                       # DraftTree, <= 32 nodes
    session.commit(verified)                         # retrieval.session.Verified: tokens, accepted nodes
    session.finish(record=True)                      # lead-in + output join acme's history

Scope: a session drafts only from its own request and its tenant's ``TenantHistory``; tenants share
nothing (not even calibration). A session's indexes are kept after ``finish`` (bounded by
``session_cache_bytes``) so that the session's next request, whose prompt usually extends this one's
context, indexes only its new tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from retrieval.config import DraftingConfig
from retrieval.draft_tree import DraftTree
from retrieval.session import Verified
from retrieval.tenant_history import HistoryStats, TenantHistory, Trajectory
from retrieval.vocabulary import identity_classes, no_categories, number_classes, token_categories
from suffix_index import as_tokens
from suffix_index.drafting import DrafterParams, DraftingSession, register_tree_type

SOURCE = "reprise"
register_tree_type(DraftTree, SOURCE)

# Tokens of left context a session's indexes repeat when a new prompt does not extend the old context.
_REBASE_OVERLAP = 64


def _params(c: DraftingConfig) -> DrafterParams:
    return DrafterParams(min_prob=c.min_path_prob, levels=c.levels, max_copy=c.max_copy,
                         canonical_below=c.canonical_below, wide=c.wide_node, skip_below=c.skip_below,
                         skip_min=c.skip_min)


class RepriseSession:
    """Drafting state of one request (see ``retrieval.session.DraftSession``)."""

    __slots__ = (
        "_cap",
        "_chain",
        "_finished",
        "_history",
        "_learn",
        "_live",
        "_monitor",
        "_native",
        "_output",
        "_owner",
        "_prompt",
        "_session_id",
        "_tenant",
    )

    def __init__(self, owner: RepriseProposer, tenant: str, session_id: str, native: DraftingSession,
                 prompt: np.ndarray, history: TenantHistory) -> None:
        self._owner = owner
        self._history = history
        self._monitor = history.monitor
        self._live = history.open_live(prompt)  # the tenant's other running requests draft from this one
        self._tenant = tenant
        self._session_id = session_id
        self._native = native
        self._prompt = prompt
        self._output: list[np.ndarray] = []
        config = owner.settings(tenant)[0]
        self._learn, self._cap = config.learn, config.max_draft_tokens
        self._finished = False
        self._chain: DraftTree | None = None  # the path a chain verifier was sent, when not the whole tree

    def propose(self, budget: int) -> DraftTree:
        """A calibrated draft tree of at most ``budget`` nodes continuing the committed context."""
        if budget > 0:
            budget = self._monitor.budget(min(budget, self._cap))
        self._chain = None
        if budget <= 0:
            return DraftTree.empty(SOURCE)
        return self._native.propose(budget)

    def verify_only(self, chain: DraftTree) -> None:
        """Only ``chain``, one path of the tree just proposed, is verified (``retrieval.chain``): the
        acceptance monitor then weighs that path's expected count, not the tree's, against what was
        accepted. Calibration still learns from the whole tree along the committed tokens."""
        self._chain = chain

    def commit(self, verified: Verified) -> None:
        tokens = as_tokens(verified.token_ids, "token_ids")
        if len(tokens):
            expected, accepted = self._native.commit(tokens, as_tokens(verified.accepted, "accepted"),
                                                     verified.draft_verified, self._learn)
            chain, self._chain = self._chain, None
            if chain is not None and verified.draft_verified:
                expected = chain.score
            if expected > 0:
                self._monitor.observe(expected, accepted)
            self._output.append(tokens)
            if self._live is not None:
                self._history.extend_live(self._live, tokens)

    def finish(self, record: bool = True) -> None:
        """End the request; with ``record`` its lead-in and output join the tenant's history."""
        if self._finished:
            return
        self._finished = True
        if self._live is not None:
            self._history.close_live(self._live)
        output = np.concatenate(self._output) if self._output else np.zeros(0, dtype=np.int32)
        if record and len(output):
            try:
                self._owner.history(self._tenant).record(self._prompt, output, self._session_id)
            except KeyError:  # the tenant was deleted while this request ran: keep nothing
                return
        self._owner._park(self._tenant, self._session_id, self._native)

    @property
    def output_ids(self) -> np.ndarray:
        return np.concatenate(self._output) if self._output else np.zeros(0, dtype=np.int32)


class RepriseProposer:
    """Hands out ``RepriseSession``s over per-tenant ``TenantHistory`` state. Thread-safe."""

    def __init__(self, config: DraftingConfig | None = None) -> None:
        self.config = config if config is not None else DraftingConfig()
        self._params = _params(self.config)
        self._tenant_settings: dict[str, tuple[DraftingConfig, DrafterParams]] = {}
        self._classes = identity_classes()
        self._categories = no_categories()
        self._tenants: dict[str, TenantHistory] = {}
        self._parked: OrderedDict[tuple[str, str], DraftingSession] = OrderedDict()
        self._parked_bytes = 0
        self._deleted: set[str] = set()
        self._lock = threading.Lock()

    # ---- vocabulary ----

    def set_vocabulary(self, decode: Callable[[int], str], vocab_size: int) -> None:
        """Enable canonical matching (number tokens of this vocabulary become class ids) and the fallback's
        token categories.

        Call before the first request; tenants created earlier keep drafting without canonical indexes.
        """
        if self.config.canonical:
            self._classes = number_classes(decode, vocab_size)
        self._categories = token_categories(decode, vocab_size)

    # ---- per-tenant settings ----

    def set_tenant_config(self, tenant: str, config: DraftingConfig | None) -> None:
        """Drafting settings for one tenant (``reprise tune`` finds them), or None for the proposer's
        own. Settings of the drafting itself (budget, pruning, levels, skip cursors, learning) apply to
        the tenant's next request; those that shape its indexes (depth, lead-in, sources, canonical
        indexes, calibration prior, memory budget) apply when its history is next built, so set them
        before the history loads (the service does at start-up)."""
        with self._lock:
            if config is None:
                self._tenant_settings.pop(tenant, None)
            else:
                self._tenant_settings[tenant] = (config, _params(config))

    def tenant_config(self, tenant: str) -> DraftingConfig | None:
        """The tenant's own settings, or None when it drafts with the proposer's."""
        with self._lock:
            own = self._tenant_settings.get(tenant)
            return own[0] if own else None

    def settings(self, tenant: str) -> tuple[DraftingConfig, DrafterParams]:
        """The tenant's drafting settings and the native drafter's parameters derived from them."""
        with self._lock:
            return self._tenant_settings.get(tenant) or (self.config, self._params)

    # ---- requests ----

    def begin(self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray,
              request_id: str = "") -> RepriseSession:
        prompt = as_tokens(prompt_ids, "prompt_ids")
        history = self.history(tenant)
        native = self._unpark(tenant, session_id)
        if native is None:
            config, params = self.settings(tenant)
            native = DraftingSession(config.max_depth, history.calibration, self._classes, params,
                                     config.use_context, history.fallback, self._categories)
            for index, kind, canonical in history.sources():
                native.add_source(index, kind, canonical)
        native.rebase(prompt, _REBASE_OVERLAP)
        return RepriseSession(self, tenant, session_id, native, prompt, history)

    # ---- tenants ----

    def history(self, tenant: str) -> TenantHistory:
        """The tenant's state, created empty on first use. KeyError for a deleted tenant."""
        with self._lock:
            h = self._tenants.get(tenant)
            if h is None:
                if tenant in self._deleted:
                    raise KeyError(f"tenant {tenant!r} was deleted")
                config = (self._tenant_settings.get(tenant) or (self.config,))[0]
                h = self._tenants[tenant] = TenantHistory(config, self._classes)
            return h

    def snapshot(self, tenant: str) -> bytes:
        """The tenant's drafting state as bytes (history, corpus, calibration); see ``restore``."""
        return self.history(tenant).snapshot()

    def restore(self, tenant: str, data: bytes) -> None:
        """Replace the tenant's drafting state with a ``snapshot``; ValueError if ``data`` is not one."""
        state = TenantHistory(self.settings(tenant)[0], self._classes)
        state.restore(data)
        with self._lock:
            if tenant in self._deleted:
                raise KeyError(f"tenant {tenant!r} was deleted")
            self._tenants[tenant] = state
        self._drop_parked(tenant)  # parked sessions hold the replaced indexes

    def delete(self, tenant: str) -> None:
        """The tenant is gone for good: evict its state and refuse to recreate it (in-flight requests
        that finish afterwards record nothing)."""
        with self._lock:
            self._deleted.add(tenant)
        self.evict(tenant)

    def load_history(self, tenant: str, trajectories: Iterable[Trajectory]) -> int:
        """Rebuild a tenant's history from stored trajectories (commit order); returns how many."""
        self.evict(tenant)
        return self.history(tenant).load(trajectories)

    def record(self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray,
               output_ids: Sequence[int] | np.ndarray) -> None:
        """A turn produced elsewhere (``AppendTrajectory``) joins the tenant's history."""
        self.history(tenant).record(prompt_ids, output_ids, session_id)

    def add_corpus(self, tenant: str, documents: Iterable[Sequence[int] | np.ndarray], replace: bool = False) -> int:
        """Add token documents to the tenant's corpus (REST-style datastore); returns how many."""
        count = self.history(tenant).add_documents(documents, replace)
        if replace:
            self._drop_parked(tenant)  # parked sessions hold the replaced corpus
        return count

    def evict(self, tenant: str) -> None:
        """Forget a tenant's in-memory state (deletion, or before a rebuild)."""
        with self._lock:
            self._tenants.pop(tenant, None)
        self._drop_parked(tenant)

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(self._tenants)

    def index_stats(self, tenant: str) -> HistoryStats:
        return self.history(tenant).stats()

    # ---- session index cache ----

    def _drop_parked(self, tenant: str) -> None:
        with self._lock:
            for key in [k for k in self._parked if k[0] == tenant]:
                self._parked_bytes -= self._parked.pop(key).memory_bytes()

    def _park(self, tenant: str, session_id: str, native: DraftingSession) -> None:
        budget = self.config.session_cache_bytes
        if not session_id or budget <= 0:
            return
        size = native.memory_bytes()
        with self._lock:
            if tenant not in self._tenants:
                return  # evicted meanwhile
            old = self._parked.pop((tenant, session_id), None)
            if old is not None:
                self._parked_bytes -= old.memory_bytes()
            if size > budget:
                return
            self._parked[(tenant, session_id)] = native
            self._parked_bytes += size
            while self._parked_bytes > budget:
                _, dropped = self._parked.popitem(last=False)
                self._parked_bytes -= dropped.memory_bytes()

    def _unpark(self, tenant: str, session_id: str) -> DraftingSession | None:
        if not session_id:
            return None
        with self._lock:
            native = self._parked.pop((tenant, session_id), None)
            if native is not None:
                self._parked_bytes -= native.memory_bytes()
            return native
