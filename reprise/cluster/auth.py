"""Credentials that survive a short store outage: the last verdict for a key stands while Redis is down.

``reprise.server.auth.StoreAuthenticator`` caches verdicts for a few seconds and answers UNAVAILABLE when the
store cannot be asked. A replica keeps serving through a Redis restart (its model and in-memory indexes
need no store), so this subclass also remembers the last *positive* verdict per key (by SHA-256, never
the key) and falls back to it while the store is unreachable. Deleting a tenant or rotating its API
keys — here or on any replica (``forget_tenant``, called from the change feed) — drops its remembered
verdicts first, so a revoked key is never accepted from memory.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from reprise.server.auth import StoreAuthenticator
from serving import errors

log = logging.getLogger(__name__)


class ResilientAuthenticator(StoreAuthenticator):
    """``StoreAuthenticator`` that answers from its last verdict while the store is unavailable."""

    def __init__(self, store: Any, ttl_s: float = 5.0, max_entries: int = 10_000) -> None:
        super().__init__(store, ttl_s, max_entries)
        self._last: dict[bytes, Any] = {}
        self._last_lock = threading.Lock()
        self.num_fallbacks = 0

    def _check(self, key: str) -> Any:
        digest = hashlib.sha256(key.encode()).digest()
        try:
            principal = super()._check(key)
        except errors.Unavailable:
            with self._last_lock:
                remembered = self._last.get(digest)
            if remembered is None:
                raise
            self.num_fallbacks += 1
            return remembered
        with self._last_lock:
            if principal is None:
                self._last.pop(digest, None)
            else:
                if len(self._last) >= self._max:
                    self._last.clear()
                self._last[digest] = principal
        return principal

    def forget_tenant(self, tenant: str) -> None:
        """Drop every verdict for ``tenant``'s keys (deleted, or its API keys rotated)."""
        with self._last_lock:
            for digest in [d for d, p in self._last.items() if p.kind == "tenant" and p.id == tenant]:
                del self._last[digest]
        self.invalidate()
