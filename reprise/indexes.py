"""The tenants' drafting indexes as the service sees them: loading history at start-up, recording
turns, statistics, and the admin operations (build, compact, corpus).

The index itself lives in the proposer (retrieval/); this module moves data between it and the
encrypted store, and joins its figures (index size, memory) with the per-step accounting
(``reprise.metered``). A proposer that keeps no per-tenant index (prompt lookup drafts from the request
alone) has nothing to build: those operations answer FAILED_PRECONDITION saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from grpc_api import errors
from grpc_api.backend import CorpusDocument, CorpusImport, ProgressCallback, TenantStats

log = logging.getLogger(__name__)


class TenantIndexes:
    def __init__(self, store: Any, proposer: Any, accounting: Any, metrics: Any = None) -> None:
        self._store = store
        self._proposer = proposer
        self._accounting = accounting
        self._metrics = metrics

    def _needs(self, method: str) -> Any:
        fn = getattr(self._proposer, method, None)
        if fn is None:
            raise errors.FailedPrecondition(
                f"the drafter in use ({type(self._proposer).__name__}) keeps no per-tenant index")
        return fn

    def load_all(self) -> None:
        """At start-up: nothing to load for a proposer without history; see ``build``."""

    def record(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> None:
        """``AppendTrajectory``: store the turn durably, then let the tenant's index draft from it."""
        from privacy.tenants import TenantId
        from reprise.admin import privacy_errors

        with privacy_errors():
            self._store.append_trajectory(TenantId(tenant), session_id, list(token_ids))

    def stats(self, tenant: str) -> TenantStats:
        return self._accounting.stats(tenant)

    def build(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        self._needs("load_history")
        return self.stats(tenant)

    def compact(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        self._needs("compact")
        return self.stats(tenant)

    def add_corpus(self, tenant: str, documents: Iterable[CorpusDocument], replace: bool,
                   progress: ProgressCallback) -> CorpusImport:
        self._needs("add_corpus")
        raise errors.FailedPrecondition("corpus drafting is not available")

    def forget(self, tenant: str) -> None:
        self._accounting.forget(tenant)
