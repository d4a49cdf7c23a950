"""Loading a tenant's index on a replica: from its sealed snapshot, or from the whole stream, and
applying the stream after a cursor. Callers hold the tenant's ``Held.lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from privacy.errors import IntegrityError
from privacy.tenants import TenantId

log = logging.getLogger(__name__)
SNAPSHOT_NAME = "cluster"


class Held:
    """A tenant this replica holds (or is loading). ``lock`` orders everything that changes its index."""

    __slots__ = ("cursor", "done", "load_error", "loaded", "lock", "pins", "since_snapshot", "source")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.done = threading.Event()   # set when the load finished (or failed)
        self.loaded = False
        self.load_error: str | None = None
        self.cursor = ""                # stream id of the last applied trajectory ("" = none)
        self.since_snapshot = 0         # trajectories applied after the snapshot this replica knows of
        self.pins = 0                   # requests in flight: never evicted while > 0
        self.source = ""                # "snapshot" or "rebuild"


def restore_snapshot(store: Any, proposer: Any, tenant: str, held: Held) -> str:
    """Restore the tenant's sealed snapshot and set ``held.cursor`` to the stream position it covers;
    returns ``"snapshot"``, or ``""`` when there is none or it is unusable (the stream has everything)."""
    try:
        snap = store.get_snapshot(TenantId(tenant), SNAPSHOT_NAME)
    except IntegrityError as exc:
        log.error("tenant %s: its index snapshot failed its integrity check (%s); rebuilding", tenant, exc)
        return ""
    if snap is None:
        return ""
    try:
        proposer.restore(tenant, snap.data)
    except ValueError as exc:  # another version's format, or damaged
        log.warning("tenant %s: its index snapshot is unusable (%s); rebuilding", tenant, exc)
        return ""
    held.cursor = snap.cursor
    _check_corpus(store, proposer, tenant)
    return "snapshot"


def _check_corpus(store: Any, proposer: Any, tenant: str) -> None:
    """A snapshot sealed while the corpus changed elsewhere may hold another corpus: the store decides."""
    tid = TenantId(tenant)
    stored = sum(c.num_documents for c in store.list_corpora(tid) if c.name == "default")
    if proposer.index_stats(tenant).num_corpus_documents != stored and hasattr(proposer, "add_corpus"):
        log.info("tenant %s: its snapshot's corpus is not the stored one; reloading the corpus", tenant)
        proposer.add_corpus(tenant, list(store.iter_corpus(tid)), replace=True)


def start_rebuild(store: Any, proposer: Any, tenant: str, held: Held) -> None:
    """Start the tenant's index from nothing but its corpus; ``apply_stream`` then reads every turn."""
    proposer.evict(tenant)
    held.cursor = ""
    held.since_snapshot = 0
    documents = list(store.iter_corpus(TenantId(tenant)))
    if documents and hasattr(proposer, "add_corpus"):
        proposer.add_corpus(tenant, documents)


def apply_stream(store: Any, proposer: Any, tenant: str, held: Held, metrics: Any = None, lag: bool = False) -> int:
    """Apply the tenant's stream after ``held.cursor``, in order, moving the cursor; returns how many.
    A record that fails its integrity check is skipped (counted), never applied. With ``lag`` each
    record's delay since its commit is observed (Redis's clock in the stream id against ours)."""
    tid, n = TenantId(tenant), 0
    while True:
        try:
            for rec in store.iter_trajectories(tid, after=held.cursor or None, batch_size=256):
                t = rec.trajectory
                ids, k = np.asarray(t.token_ids, dtype=np.int32), t.num_prompt_tokens
                proposer.record(tenant, t.session_id, ids[:k], ids[k:])
                held.cursor = rec.cursor
                n += 1
                if lag and metrics is not None:
                    metrics.lag_seconds.observe(max(0.0, time.time() - int(rec.cursor.split("-")[0]) / 1000))
            return n
        except IntegrityError as exc:
            bad = store.storage.traj_scan(tenant, held.cursor or None, 1)
            log.error("tenant %s: skipped a trajectory that failed its integrity check (%s)", tenant, exc)
            if metrics is not None:
                metrics.crypto_failures.labels(kind="trajectory").inc()
            if not bad:
                return n
            held.cursor = bad[0].cursor
