"""Settings of a replica among several on one Redis (``[cluster]`` in reprise.toml, ``REPRISE_CLUSTER_*``)."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field

_REPLICA_RE = re.compile(r"^[A-Za-z0-9_.:-]{0,64}$")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Replication of tenants' indexes between replicas through Redis Streams (docs/cluster.md)."""

    enabled: bool = field(default=False, metadata=_help(
        "share tenants' history with the other replicas on this Redis (needs store.backend = redis): "
        "indexes load lazily (snapshot + stream tail) and follow every replica's writes"))
    replica_id: str = field(default="", metadata=_help(
        "this replica's name in the change feed and leases (default <hostname>-<pid>)"))
    index_memory_bytes: int = field(default=0, metadata=_help(
        "memory for in-memory tenant indexes on this replica; beyond it the least recently used tenants "
        "are evicted whole and reloaded from Redis on demand (0 = no limit)"))
    snapshot_every: int = field(default=256, metadata=_help(
        "re-seal a tenant's index snapshot once this many trajectories were applied after it"))
    snapshot_check_s: float = field(default=2.0, metadata=_help(
        "how often the background compactor looks for tenants whose snapshot is due"))
    resync_interval_s: float = field(default=10.0, metadata=_help(
        "how often every held tenant's stream is read directly (catches events the feed lost, deletions "
        "made outside the service)"))
    load_wait_s: float = field(default=2.0, metadata=_help(
        "how long a request waits for its tenant's index to load; past it the request runs without "
        "history drafts while the load finishes in the background"))
    feed_max_len: int = field(default=100_000, metadata=_help("events kept in the change feed (approximate)"))
    max_pending_writes: int = field(default=10_000, metadata=_help(
        "finished requests' trajectories held for writing while Redis is unreachable; more are dropped "
        "and counted"))

    def __post_init__(self) -> None:
        if not _REPLICA_RE.match(self.replica_id):
            raise ValueError(f"cluster.replica_id must be at most 64 letters, digits or '_.:-', "
                             f"got {self.replica_id!r}")
        if self.index_memory_bytes < 0:
            raise ValueError(f"cluster.index_memory_bytes must be >= 0, got {self.index_memory_bytes}")
        if self.snapshot_every < 1:
            raise ValueError(f"cluster.snapshot_every must be >= 1, got {self.snapshot_every}")
        for name in ("snapshot_check_s", "resync_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster.{name} must be > 0, got {getattr(self, name)}")
        if self.load_wait_s < 0:
            raise ValueError(f"cluster.load_wait_s must be >= 0, got {self.load_wait_s}")
        if self.feed_max_len < 100:
            raise ValueError(f"cluster.feed_max_len must be >= 100, got {self.feed_max_len}")
        if self.max_pending_writes < 1:
            raise ValueError(f"cluster.max_pending_writes must be >= 1, got {self.max_pending_writes}")

    @property
    def name(self) -> str:
        """``replica_id``, or ``<hostname>-<pid>``."""
        return self.replica_id or f"{socket.gethostname()[:40]}-{os.getpid()}"
