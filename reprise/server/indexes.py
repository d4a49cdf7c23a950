"""The tenants' drafting indexes as the service sees them: loading history (at start-up, and again for a
tenant the memory budget evicted), recording turns, statistics, quarantine of bad records, and the admin
operations (build, compact, corpus).

The indexes live in the proposer (``retrieval.proposer.RepriseProposer``: per tenant, a suffix index of
its past responses and one of its corpus); the encrypted store (privacy) is their source of truth. This
module moves data between the two and joins the index figures (size, memory) with the per-step
accounting (``reprise.server.metering``). A proposer without per-tenant indexes (prompt lookup drafts from the
request alone) has nothing to build: those operations answer FAILED_PRECONDITION saying so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from privacy.errors import IntegrityError, StorageError, UnknownTenantError
from privacy.records import BadRecord
from privacy.tenants import TenantId
from reprise.server.admin import privacy_errors
from reprise.server.index_budget import ResidentIndexes
from retrieval.tenant_history import Trajectory
from serving import errors
from serving.admin import CorpusDocument, CorpusImport, IndexMemory, Progress, ProgressCallback, TenantStats

log = logging.getLogger(__name__)
_CORPUS_BATCH = 256  # documents per sealed corpus part
_RETRY_LOAD_S = 60.0  # a tenant whose history could not be read is tried again after this long


class TenantIndexes:
    """History and corpus indexes of every tenant, kept in step with the store, within the service-wide
    memory budget (``reprise.server.index_budget``).

    A stored record that fails authentication or parsing is quarantined when the tenant loads: skipped,
    left in the store untouched, counted (``quarantined``, the admin figures, the metrics) and named by
    ``reprise index verify``; the index is built from everything else.
    """

    def __init__(self, store: Any, proposer: Any, accounting: Any, metrics: Any = None,
                 tokenize: Callable[[str], list[int]] | None = None, memory_budget_bytes: int = 0) -> None:
        self._store = store
        self._proposer = proposer
        self._accounting = accounting
        self._metrics = metrics
        self._tokenize = tokenize
        self.has_indexes = all(hasattr(proposer, m) for m in ("load_history", "record", "add_corpus", "evict",
                                                               "index_stats"))
        self.resident = ResidentIndexes(memory_budget_bytes)
        self._quarantined: dict[str, tuple[BadRecord, ...]] = {}
        self._load_failed: dict[str, float] = {}  # tenant -> when its history last failed to load
        self._tenant_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        if metrics is not None:
            metrics.index_memory_budget_bytes.set(memory_budget_bytes)

    def _require(self) -> None:
        if not self.has_indexes:
            raise errors.FailedPrecondition(
                f"the drafter in use ({type(self._proposer).__name__}) keeps no per-tenant index")

    def _tenant_lock(self, tenant: str) -> threading.Lock:
        """Serializes a tenant's load with its appends: a turn is in the index exactly once."""
        with self._locks_lock:
            return self._tenant_locks.setdefault(tenant, threading.Lock())

    # ---- start-up, residency and recording -------------------------------------------------------------

    def load_all(self) -> None:
        """Load every tenant's history and corpus from the store (before serving), until the memory
        budget is reached; the others load on first use."""
        if not self.has_indexes:
            return
        t0 = time.perf_counter()
        tenant_ids = self._store.storage.tenant_ids()  # ids only: one damaged tenant record stops no one
        total = loaded = 0
        for tid in tenant_ids:
            if self.resident.full:
                break
            total += self._load_logged(tid)
            loaded += 1
        self._enforce()
        if tenant_ids:
            later = f"; {len(tenant_ids) - loaded} more load on first use (server.index_memory_bytes)" \
                if loaded < len(tenant_ids) else ""
            log.info("loaded the history of %d tenants (%d trajectories) in %.1f s%s", loaded, total,
                     time.perf_counter() - t0, later)

    def _load_logged(self, tenant: str) -> int:
        """``_load``, serving the tenant without history when its store cannot be read (logged)."""
        try:
            return self._load(TenantId(tenant), lambda p: None)
        except UnknownTenantError:
            return 0
        except (IntegrityError, StorageError) as exc:
            log.error("tenant %s: its history cannot be read (%s); serving it without history drafts for "
                      "%.0f s, then trying again", tenant, exc, _RETRY_LOAD_S)
            self._proposer.evict(tenant)
            self.resident.drop(tenant)
            self._load_failed[tenant] = time.monotonic()
            return 0

    def ensure(self, tenant: str) -> None:
        """*Blocking.* Load the tenant's index if it is not in memory (never loaded, or evicted by the
        budget): rebuilt from its encrypted history, then the budget is enforced."""
        if not self.has_indexes or self.resident.touch(tenant):
            return
        failed = self._load_failed.get(tenant)
        if failed is not None and time.monotonic() - failed < _RETRY_LOAD_S:
            return  # its store cannot be read (logged): not again for every request
        with self._tenant_lock(tenant):
            if self.resident.touch(tenant):
                return
            self._load_logged(tenant)
        self._enforce()

    def is_resident(self, tenant: str) -> bool:
        """Whether the tenant's index is in memory now."""
        return tenant in self.resident

    def after_request(self, tenant: str) -> None:
        """A request of the tenant ended (its turn may have grown the index): measure, enforce the budget."""
        if self.has_indexes and self.resident.touch(tenant):
            try:
                self._measure(tenant)
            except KeyError:  # deleted meanwhile
                self.resident.drop(tenant)
            self._enforce()

    def _load(self, tid: Any, progress: ProgressCallback) -> int:
        total = self._store.count_trajectories(tid)
        done = 0
        bad: list[BadRecord] = []

        def trajectories() -> Iterator[Trajectory]:
            nonlocal done
            for rec in self._store.iter_trajectories(tid, on_bad=bad.append):
                t = rec.trajectory
                ids, n = np.asarray(t.token_ids, dtype=np.int32), t.num_prompt_tokens
                yield Trajectory(t.session_id, ids[:n], ids[n:])
                done += 1
                if done % 256 == 0:
                    progress(Progress("history", done, total, "trajectories"))

        num = self._proposer.load_history(tid.value, trajectories())
        progress(Progress("history", done, total, "trajectories"))
        documents = list(self._store.iter_corpus(tid, on_bad=bad.append))
        if documents:
            self._proposer.add_corpus(tid.value, documents)
            progress(Progress("corpus", len(documents), len(documents), "documents"))
        self._set_quarantined(tid.value, bad)
        self._measure(tid.value)
        self._load_failed.pop(tid.value, None)
        return num

    def _set_quarantined(self, tenant: str, bad: list[BadRecord]) -> None:
        for record in bad:
            log.error("tenant %s: quarantined %s (left in the store; `reprise index repair %s` sets it aside)",
                      tenant, record.describe(), tenant)
        if bad and self._metrics is not None:
            for record in bad:
                self._metrics.crypto_failures.labels(kind="trajectory" if record.kind == "trajectory" else "blob").inc()
        if bad:
            self._quarantined[tenant] = tuple(bad)
        else:
            self._quarantined.pop(tenant, None)
        if self._metrics is not None:
            self._metrics.quarantined_records.set(sum(len(b) for b in self._quarantined.values()))

    def quarantined(self, tenant: str) -> tuple[BadRecord, ...]:
        """The records skipped when the tenant's index was last built."""
        return self._quarantined.get(tenant, ())

    def _measure(self, tenant: str) -> None:
        """Record the tenant's index size: it is in memory, most recently used."""
        self.resident.set_size(tenant, self._proposer.index_stats(tenant).memory_bytes)

    def _enforce(self) -> None:
        """Evict least recently used tenants past the budget. Call holding no tenant's lock: each
        eviction takes its victim's, so a reload of the victim that won the race is left alone."""
        for victim in self.resident.take_victims():
            with self._tenant_lock(victim):
                if victim not in self.resident:  # not reloaded meanwhile
                    self._proposer.evict(victim)
            log.info("tenant %s: index evicted (server.index_memory_bytes %d reached); rebuilt from its "
                     "history on next use", victim, self.resident.budget_bytes)
            if self._metrics is not None:
                self._metrics.index_evictions.inc()
        if self._metrics is not None:
            self._metrics.index_memory_bytes.set(self.resident.total_bytes)

    def record(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> None:
        """``AppendTrajectory``: store the turn durably, then let the tenant's index draft from it (an
        index not in memory gets it from the store when it loads)."""
        with self._tenant_lock(tenant):
            with privacy_errors():
                self._store.append_trajectory(TenantId(tenant), session_id, list(token_ids))
            if not self.has_indexes or not self.resident.touch(tenant):
                return
            self._proposer.record(tenant, session_id, np.zeros(0, dtype=np.int32), token_ids)
            self._measure(tenant)
        self._enforce()

    def reload(self, tenant: str) -> None:
        """The tenant's stored history changed underneath (a repair): rebuild its index if it is in memory."""
        self._set_quarantined(tenant, [])
        self._load_failed.pop(tenant, None)
        if not self.has_indexes or not self.is_resident(tenant):
            return
        with self._tenant_lock(tenant):
            self._load_logged(tenant)
        self._enforce()

    def forget(self, tenant: str) -> None:
        """A deleted (or re-imported) tenant: drop its index and its figures (reloaded on next use)."""
        self._accounting.forget(tenant)
        self._quarantined.pop(tenant, None)
        if self.has_indexes:
            with self._tenant_lock(tenant):
                self.resident.drop(tenant)
                self._proposer.evict(tenant)

    # ---- admin operations ----------------------------------------------------------------------------

    def stats(self, tenant: str) -> TenantStats:
        quarantined = len(self.quarantined(tenant))
        if not self.has_indexes or not self.is_resident(tenant):  # never create an index to measure it
            return self._accounting.stats(tenant, index_resident=False, quarantined_records=quarantined)
        h = self._proposer.index_stats(tenant)
        return self._accounting.stats(tenant, index_tokens=h.num_history_tokens, index_sequences=h.num_trajectories,
                                      index_memory_bytes=h.memory_bytes, corpus_tokens=h.num_corpus_tokens,
                                      quarantined_records=quarantined)

    def all_stats(self, tenants: Iterable[str]) -> list[TenantStats]:
        return [self.stats(t) for t in tenants]

    def memory(self) -> IndexMemory:
        """The service-wide figures: the budget, what the resident indexes hold, evictions, quarantine."""
        return IndexMemory(self.resident.budget_bytes, self.resident.total_bytes, self.resident.num_tenants,
                           self.resident.num_evictions, sum(len(b) for b in self._quarantined.values()))

    def build(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        """Rebuild the tenant's indexes from the store (after an import, or to recover); records that
        fail authentication or parsing are skipped and counted in the result's ``quarantined_records``."""
        self._require()
        with self._tenant_lock(tenant):
            self._load(TenantId(tenant), progress)
        self._enforce()
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
        self.ensure(tenant)
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
        self.after_request(tenant)
        return CorpusImport(len(docs), int(sum(len(d) for d in docs)), self.stats(tenant).corpus_tokens)
