"""Several replicas of `reprise serve` on one Redis (or Redis Cluster): shared tenant history through
Redis Streams, lazy index loading from sealed snapshots, deletion and key rotation propagated, a memory
budget with LRU eviction of whole tenants. See docs/cluster.md.

Modules: ``config`` (``ClusterConfig``, the ``[cluster]`` settings), ``node`` (``ClusterNode``: what
``reprise.service`` wires in), ``replica`` (held tenants, catching up, eviction, deletion), ``loading`` (snapshot, rebuild, stream
application), ``upkeep``
(feed listener, snapshots, resync), ``writer`` (retried, announced appends), ``indexes`` and
``residency`` (the service's indexes and the data plane's tenant residency on a replica), ``auth`` (credentials through a
store outage), ``launch`` (a replica process with a tiny model, for tests and ``reprise bench cluster``).
"""

from reprise.config import ClusterConfig

__all__ = ["ClusterConfig"]
