"""The tenants' drafting indexes as the service sees them: loading history at start-up, recording turns,
statistics, and the admin operations (build, compact, corpus).

The indexes live in the proposer (``retrieval.proposer.RepriseProposer``: per tenant, a suffix index of
its past responses and one of its corpus); the encrypted store (privacy) is their source of truth. This
module moves data between the two and joins the index figures (size, memory) with the per-step
accounting (``reprise.server.metering``). A proposer without per-tenant indexes (prompt lookup drafts from the
request alone) has nothing to build: those operations answer FAILED_PRECONDITION saying so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from privacy.errors import IntegrityError
from privacy.tenants import TenantId
from reprise.server.admin import privacy_errors
from retrieval.tenant_history import Trajectory
from serving import errors
from serving.admin import CorpusDocument, CorpusImport, Progress, ProgressCallback, TenantStats

log = logging.getLogger(__name__)
_CORPUS_BATCH = 256  # documents per sealed corpus part


class TenantIndexes:
    """History and corpus indexes of every tenant, kept in step with the store."""

    def __init__(self, store: Any, proposer: Any, accounting: Any, metrics: Any = None,
                 tokenize: Callable[[str], list[int]] | None = None) -> None:
        self._store = store
        self._proposer = proposer
        self._accounting = accounting
        self._metrics = metrics
        self._tokenize = tokenize
        self.has_indexes = all(hasattr(proposer, m) for m in ("load_history", "record", "add_corpus", "evict",
                                                               "index_stats"))

    def _require(self) -> None:
        if not self.has_indexes:
            raise errors.FailedPrecondition(
                f"the drafter in use ({type(self._proposer).__name__}) keeps no per-tenant index")

    # ---- start-up and recording --------------------------------------------------------------------

    def load_all(self) -> None:
        """Load every tenant's history and corpus from the store (before serving)."""
        if not self.has_indexes:
            return

        t0 = time.perf_counter()
        tenants = self._store.list_tenants()
        total = 0
        for t in tenants:
            try:
                total += self._load(t.id, lambda p: None)
            except IntegrityError as exc:  # serve the others; `reprise index build` reports DATA_LOSS
                log.error("tenant %s: history failed its integrity check (%s); serving it without history",
                          t.id.value, exc)
                self._proposer.evict(t.id.value)
                if self._metrics is not None:
                    self._metrics.crypto_failures.labels(kind="trajectory").inc()
        if tenants:
            log.info("loaded the history of %d tenants (%d trajectories) in %.1f s", len(tenants), total,
                     time.perf_counter() - t0)

    def _load(self, tid: Any, progress: ProgressCallback) -> int:
        total = self._store.count_trajectories(tid)
        done = 0

        def trajectories() -> Iterator[Trajectory]:
            nonlocal done
            for rec in self._store.iter_trajectories(tid):
                t = rec.trajectory
                ids, n = np.asarray(t.token_ids, dtype=np.int32), t.num_prompt_tokens
                yield Trajectory(t.session_id, ids[:n], ids[n:])
                done += 1
                if done % 256 == 0:
                    progress(Progress("history", done, total, "trajectories"))

        num = self._proposer.load_history(tid.value, trajectories())
        progress(Progress("history", done, total, "trajectories"))
        documents = list(self._store.iter_corpus(tid))
        if documents:
            self._proposer.add_corpus(tid.value, documents)
            progress(Progress("corpus", len(documents), len(documents), "documents"))
        return num

    def record(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> None:
        """``AppendTrajectory``: store the turn durably, then let the tenant's index draft from it."""
        with privacy_errors():
            self._store.append_trajectory(TenantId(tenant), session_id, list(token_ids))
        if self.has_indexes:
            self._proposer.record(tenant, session_id, np.zeros(0, dtype=np.int32), token_ids)

    def forget(self, tenant: str) -> None:
        """A deleted tenant: drop its index and its figures."""
        self._accounting.forget(tenant)
        if self.has_indexes:
            self._proposer.evict(tenant)

    # ---- admin operations ----------------------------------------------------------------------------

    def stats(self, tenant: str) -> TenantStats:
        if not self.has_indexes:
            return self._accounting.stats(tenant)
        h = self._proposer.index_stats(tenant)
        return self._accounting.stats(tenant, index_tokens=h.num_history_tokens, index_sequences=h.num_trajectories,
                                      index_memory_bytes=h.memory_bytes, corpus_tokens=h.num_corpus_tokens)

    def all_stats(self, tenants: Iterable[str]) -> list[TenantStats]:
        out = [self.stats(t) for t in tenants]
        if self._metrics is not None:
            self._metrics.index_memory_bytes.set(sum(s.index_memory_bytes for s in out))
        return out

    def build(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        """Rebuild the tenant's indexes from the store (after an import, or to recover)."""
        self._require()
        self._load(TenantId(tenant), progress)
        return self.stats(tenant)

    def compact(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        """Rebuild into fresh memory: what the memory budget evicted is gone for good and the index's
        storage is laid out anew (the store keeps every trajectory)."""
        before = self.stats(tenant).index_memory_bytes
        stats = self.build(tenant, progress)
        log.info("compacted the index of tenant %s: %d -> %d bytes", tenant, before, stats.index_memory_bytes)
        return stats

    def add_corpus(self, tenant: str, documents: Iterable[CorpusDocument], replace: bool,
                   progress: ProgressCallback) -> CorpusImport:
        """Store the documents (sealed) and index them; text documents are tokenized here. The whole
        upload is read first: one that breaks off leaves the corpus as it was."""
        self._require()
        tid = TenantId(tenant)
        docs: list[np.ndarray] = []
        for doc in documents:
            if doc.token_ids is not None:
                ids = np.asarray(doc.token_ids, dtype=np.int32)
            elif self._tokenize is not None:
                ids = np.asarray(self._tokenize(doc.text or ""), dtype=np.int32)
            else:
                raise errors.FailedPrecondition("the served model has no tokenizer: send documents as token ids")
            if len(ids):
                docs.append(ids)
            if len(docs) % _CORPUS_BATCH == 0:
                progress(Progress("upload", len(docs), 0, "documents"))
        if replace:
            self._store.delete_corpus(tid)
            self._proposer.add_corpus(tenant, [], replace=True)
        for start in range(0, len(docs), _CORPUS_BATCH):
            part = docs[start:start + _CORPUS_BATCH]
            self._store.add_corpus_documents(tid, part)
            self._proposer.add_corpus(tenant, part)
            progress(Progress("index", start + len(part), len(docs), "documents"))
        return CorpusImport(len(docs), int(sum(len(d) for d in docs)), self.stats(tenant).corpus_tokens)
