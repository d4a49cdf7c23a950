"""Hidden-state reuse vectors as tenant history: sealed in the encrypted store, restored with it.

A finished request's projected vectors (``neural_drafters.reuse.Segment``) are stored with
``HistoryStore.put_hidden_states`` under a key derived from the trajectory they belong to (its session id
and tokens), so they are encrypted with the tenant's data key, listed and shredded with the tenant, and
never readable by another tenant. ``restore`` walks the tenant's trajectories (which hold the tokens the
continuations are copied from) and attaches the vectors stored for each.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from neural_drafters.hybrid import HybridProposer, ReuseProposer
from privacy.tenants import TenantId

log = logging.getLogger(__name__)

KEY_PREFIX = "reuse/v1/"


def segment_key(session_id: str, token_ids: Any) -> str:
    """The hidden-state key of a trajectory: a digest of its session id and tokens."""
    digest = hashlib.sha256()
    digest.update(session_id.encode())
    digest.update(b"\0")
    digest.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return KEY_PREFIX + digest.hexdigest()[:40]


class HiddenStatePersistence:
    """Writes segments to, and restores a tenant's memory from, a ``privacy.HistoryStore``."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def save(self, tenant: str, session_id: str, segment: Any) -> str:
        """Seal one segment (call it off the engine thread); returns its key."""
        key = segment_key(session_id, segment.tokens)
        self.store.put_hidden_states(TenantId(tenant), key, segment.positions, segment.vectors)
        return key

    def restore(self, tenant: str, memory: Any) -> int:
        """Add every stored segment of ``tenant`` to ``memory`` (oldest first); returns how many."""
        tid = TenantId(tenant)
        restored = 0
        for record in self.store.iter_trajectories(tid, on_bad=lambda bad: None):  # counted by the index load
            t = record.trajectory
            got = self.store.get_hidden_states(tid, segment_key(t.session_id, t.token_ids))
            if got is None:
                continue
            positions, vectors = got
            if len(positions) and int(positions.max()) >= len(t.token_ids):
                log.warning("tenant %s: hidden states of a trajectory point past its end; skipped", tenant)
                continue
            memory.add_segment(tenant, t.token_ids, positions, vectors)
            restored += 1
        return restored


class ReuseWiring:
    """A service's hidden-state reuse tied to its store: every recorded request's segment is sealed off
    the engine thread (one worker, in order), the memory is refilled from the store at start-up, and a
    deleted tenant's memory is dropped."""

    def __init__(self, reuse: Any, store: Any) -> None:
        self.reuse = reuse
        self.persistence = HiddenStatePersistence(store)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reprise-reuse")
        reuse.on_segment = self._submit

    @staticmethod
    def find(proposer: Any) -> Any:
        """The ``ReuseProposer`` inside ``proposer`` (itself, or a hybrid's part), or None."""
        if isinstance(proposer, ReuseProposer):
            return proposer
        if isinstance(proposer, HybridProposer):
            return proposer.reuse
        return None

    def _submit(self, tenant: str, session_id: str, segment: Any) -> None:
        self._pool.submit(self._save, tenant, session_id, segment)

    def _save(self, tenant: str, session_id: str, segment: Any) -> None:
        try:
            self.persistence.save(tenant, session_id, segment)
        except Exception as exc:  # noqa: BLE001 - a lost segment only costs drafting after a restart
            log.warning("tenant %s: hidden-state vectors not stored (%s)", tenant, exc)

    def restore_all(self, tenants: Any) -> int:
        """Refill the memory with every tenant's stored segments; returns how many."""
        restored = 0
        for t in tenants:
            try:
                restored += self.persistence.restore(t.id.value, self.reuse.memory)
            except Exception as exc:  # noqa: BLE001 - serve the others
                log.error("tenant %s: hidden-state vectors not restored (%s)", t.id.value, exc)
        return restored

    def forget(self, tenant: str) -> None:
        self.reuse.memory.forget(tenant)

    def close(self) -> None:
        """Wait for the queued segments (call before the store closes)."""
        self._pool.shutdown(wait=True)
