"""Bearer keys to principals, over the privacy store (``HistoryStore.authenticate``/``authenticate_admin``).

Every RPC authenticates, so verified keys are cached for a few seconds (by a SHA-256 of the whole key;
the key itself is not kept). Rotating or revoking keys and deleting tenants through this process clear
the cache at once; another replica's changes take effect here within ``ttl_s``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from privacy.errors import AuthenticationError, StorageError
from serving import errors
from serving.records import Principal

ADMIN_PREFIX = "rpa_"
TENANT_PREFIX = "rpk_"


class StoreAuthenticator:
    """``serving.records.Authenticator`` over a ``privacy.HistoryStore``."""

    def __init__(self, store: Any, ttl_s: float = 5.0, max_entries: int = 10_000) -> None:
        self._store = store
        self._ttl = ttl_s
        self._max = max_entries
        self._cache: dict[bytes, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def authenticate(self, key: str) -> Principal | None:
        if not key.startswith((ADMIN_PREFIX, TENANT_PREFIX)):
            return None
        digest = hashlib.sha256(key.encode()).digest()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None and hit[0] > now:
                return hit[1]
        principal = self._check(key)
        with self._lock:
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[digest] = (now + self._ttl, principal)
        return principal

    def _check(self, key: str) -> Principal | None:
        try:
            if key.startswith(ADMIN_PREFIX):
                return Principal("admin", self._store.authenticate_admin(key).key_id)
            return Principal("tenant", self._store.authenticate(key).value)
        except (AuthenticationError, ValueError):
            return None
        except StorageError as exc:  # the store is down: nobody gets in, nothing is cached, callers retry
            raise errors.Unavailable(f"cannot check credentials: the history store is unavailable ({exc})") from None

    def invalidate(self) -> None:
        """Forget every cached verdict (after a rotation, revocation or deletion)."""
        with self._lock:
            self._cache.clear()
