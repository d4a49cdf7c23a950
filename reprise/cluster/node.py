"""Everything a replica adds to ``reprise serve``, built from ``[cluster]`` and wired by
``reprise.service.Service`` when ``cluster.enabled`` is set:

    node = ClusterNode(config.cluster, store, proposer, metrics)
    auth = node.authenticator()                    # verdicts survive a store outage
    indexes = node.indexes(accounting, tokenize)   # lazy loads, appends via the stream
    writer = node.writer                           # history sink: retried, announced appends
    residency = node.residency()                   # requests wait for their tenant's index

Either engine decodes (``model.engine``): the proposer is the own engine's, or the proxy of the one in
vLLM's worker (``reprise.backends.vllm.tenants.WorkerTenants``); the replica's loader, catch-up and
eviction are the same code for both. The engine leaves recording finished turns to the stream.
    node.start(); ...; node.stop()                 # feed listener + upkeep threads
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Counter, Histogram

from privacy.changefeed import KIND_DELETE, KIND_KEYS, open_feed
from privacy.errors import StorageError
from reprise.cluster.auth import ResilientAuthenticator
from reprise.cluster.indexes import ReplicatedIndexes
from reprise.cluster.replica import Replica
from reprise.cluster.residency import ReplicaResidency
from reprise.cluster.upkeep import FeedListener, Upkeep
from reprise.cluster.writer import ReplicaWriter
from reprise.config import ClusterConfig

log = logging.getLogger(__name__)


class ClusterMetrics:
    """Replication metrics in the service's registry (no tenant ids in labels)."""

    def __init__(self, service_metrics: Any) -> None:
        r = service_metrics.registry
        lag_buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
        self.lag_seconds = Histogram("reprise_replication_lag_seconds",
                                     "Commit on any replica to applied in this replica's index", buckets=lag_buckets,
                                     registry=r)
        self.applied = Counter("reprise_replication_applied_trajectories", "Trajectories applied from the streams",
                               registry=r)
        self.loads = Counter("reprise_index_loads", "Tenant indexes loaded, by source", ["source"], registry=r)
        self.load_seconds = Histogram("reprise_index_load_seconds", "Time to load a tenant's index",
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.snapshots = Counter("reprise_index_snapshots", "Index snapshots sealed by this replica", registry=r)
        self.snapshot_bytes = Histogram("reprise_index_snapshot_bytes", "Size of sealed index snapshots",
                                        buckets=tuple(4.0 ** k * 1024 for k in range(12)), registry=r)
        self.write_retries = Counter("reprise_history_write_retries", "History appends retried (store unreachable)",
                                     registry=r)
        self.writes_dropped = Counter("reprise_history_writes_dropped", "Trajectories that could not be stored",
                                      registry=r)
        self.evictions = service_metrics.index_evictions
        self.crypto_failures = service_metrics.crypto_failures


class ClusterNode:
    """The replica's parts, built once at start-up."""

    def __init__(self, config: ClusterConfig, store: Any, proposer: Any, metrics: Any = None) -> None:
        self.config = config
        self.store = store
        self.metrics = ClusterMetrics(metrics) if metrics is not None else None
        self.feed = open_feed(store, config.feed_max_len)
        self.replica = Replica(store, proposer, config, self.feed, self.metrics)
        self.listener = FeedListener(self.replica, self.feed)
        self.upkeep = Upkeep(self.replica, config.snapshot_check_s, config.resync_interval_s)
        self.writer = ReplicaWriter(store, self.replica, config.max_pending_writes, metrics=self.metrics)
        self._auth: Any = None
        store.add_deletion_hook(self._deleted_here)
        store.add_key_hook(self._keys_here)

    def _deleted_here(self, tenant: Any) -> None:
        """Store deletion hook (keys destroyed, records not yet purged): tell every replica."""
        try:
            self.feed.publish(KIND_DELETE, tenant, "", self.replica.name)
        except StorageError as exc:  # the others notice at their resync
            log.error("tenant %s: could not announce its deletion (%s)", tenant.value, exc)
        self.replica.tenant_deleted(tenant.value)

    def _keys_here(self, tenant: Any) -> None:
        """Store key hook: this replica rotated the tenant's API keys or started a new data key
        version; the others drop their cached keys and credentials verdicts."""
        try:
            self.feed.publish(KIND_KEYS, tenant, "", self.replica.name)
        except StorageError as exc:
            log.error("tenant %s: could not announce its key rotation (%s)", tenant.value, exc)
        if self._auth is not None:
            self._auth.forget_tenant(tenant.value)

    def set_proposer(self, proposer: Any) -> None:
        """The proposer (built after the authenticator, which start-up needs first)."""
        self.replica.set_proposer(proposer)

    def authenticator(self) -> Any:
        self._auth = ResilientAuthenticator(self.store)
        self.replica.on_tenant_gone(self._auth.forget_tenant)
        self.replica.on_keys_changed(self._auth.forget_tenant)
        return self._auth

    def indexes(self, accounting: Any, metrics: Any = None, tokenize: Any = None) -> Any:
        self.replica.on_tenant_gone(accounting.forget)
        return ReplicatedIndexes(self.store, self.replica.proposer, accounting, self.replica, metrics, tokenize)

    def residency(self) -> ReplicaResidency:
        return ReplicaResidency(self.replica, self.config.load_wait_s)

    def start(self) -> None:
        self.listener.start()
        self.upkeep.start()
        log.info("replica %s: following the change feed from %s", self.replica.name, self.listener.after)

    def stop(self, wait: bool = True) -> None:
        """Stop the threads (the writer is closed with the engine, before this); without ``wait`` only
        tell them to (stop several nodes at once, then ``stop()`` each)."""
        self.listener.stop(wait)
        self.upkeep.stop(wait)
        if wait:
            self.replica.close()
