"""``TenantIndexes`` on a replica: indexes load on first use and change only through the stream.

The admin plane and ``AppendTrajectory`` reach the indexes through this class (``reprise.server.indexes``).
Differences from the single-process version: nothing is loaded at start-up (a tenant loads when a
request needs it); an appended turn enters the index from the stream once the append returns
(read-your-writes on this replica, the others follow through the feed); figures of a tenant this
replica does not hold report an empty index instead of creating one; a rebuild seals a fresh snapshot;
a corpus change seals one and tells the other replicas to reload.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from privacy.changefeed import KIND_RELOAD, tenant_state
from privacy.errors import StorageError
from privacy.tenants import TenantId
from reprise.server.admin import privacy_errors
from reprise.server.indexes import TenantIndexes
from serving import errors
from serving.admin import CorpusDocument, CorpusImport, IndexMemory, Progress, ProgressCallback, TenantStats

log = logging.getLogger(__name__)


class ReplicatedIndexes(TenantIndexes):
    """The tenants' indexes of one replica among several (see the module docstring)."""

    def __init__(self, store: Any, proposer: Any, accounting: Any, replica: Any, metrics: Any = None,
                 tokenize: Any = None) -> None:
        super().__init__(store, proposer, accounting, metrics, tokenize)
        self.replica = replica

    def load_all(self) -> None:
        log.info("replica %s: tenants' indexes load on first use (snapshot + stream tail)", self.replica.name)

    def record(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> None:
        """``AppendTrajectory``: append durably (announced to every replica), then apply it here."""
        self.replica.note_write(tenant)
        with privacy_errors():
            ref = self._store.append_trajectory(TenantId(tenant), session_id, list(token_ids))
        self.replica.after_append(tenant, ref.cursor)

    def forget(self, tenant: str) -> None:
        """A deleted tenant (its index, figures and keys go), or an imported one (reload on next use)."""
        self._accounting.forget(tenant)
        try:
            state = tenant_state(self._store, TenantId(tenant))
        except StorageError:
            state = "unknown"
        if state == "active":
            self.replica.evict(tenant)
            self._announce_reload(tenant)
        else:
            self.replica.tenant_deleted(tenant)

    def ensure(self, tenant: str) -> None:
        """Load the tenant unless this replica holds it (the replica's loader and budget)."""
        self.replica.ensure(tenant, None)

    def is_resident(self, tenant: str) -> bool:
        return bool(self.replica.is_held(tenant))

    def reload(self, tenant: str) -> None:
        """The tenant's stored history changed (a repair): every replica reloads it."""
        self.replica.evict(tenant)
        self._announce_reload(tenant)

    def _announce_reload(self, tenant: str) -> None:
        try:
            self.replica.feed.publish(KIND_RELOAD, TenantId(tenant), "", self.replica.name)
        except StorageError as exc:  # the change is stored; other replicas see it when they reload
            log.error("tenant %s: could not tell the other replicas to reload it (%s)", tenant, exc)

    def memory(self) -> IndexMemory:
        """This replica's figures against ``cluster.index_memory_bytes``."""
        sizes = self.replica.memory_bytes()
        return IndexMemory(self.replica.config.index_memory_bytes, sum(sizes.values()), len(sizes),
                           self.replica.num_evictions, 0)

    def build(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        """Rebuild from the whole stream (not the snapshot), then seal a fresh snapshot."""
        self._require()
        self.replica.evict(tenant)
        progress(Progress("history", 0, 0, "trajectories"))
        if not self.replica.ensure(tenant, None, rebuild=True):
            raise errors.Unavailable(f"could not load tenant {tenant}'s history: {self.replica.load_error(tenant)}")
        self.replica.seal_snapshot(tenant)
        stats = self.stats(tenant)
        progress(Progress("history", stats.index_sequences, stats.index_sequences, "trajectories"))
        return stats

    def add_corpus(self, tenant: str, documents: Iterable[CorpusDocument], replace: bool,
                   progress: ProgressCallback) -> CorpusImport:
        """Store and index the documents here, seal a snapshot with them, and have the other replicas
        reload the tenant."""
        self._require()
        self.replica.ensure(tenant, None)
        with self.replica.pinned(tenant), self.replica.locked(tenant):
            result = super().add_corpus(tenant, documents, replace, progress)
        self.replica.seal_snapshot(tenant)
        self._announce_reload(tenant)
        return result
