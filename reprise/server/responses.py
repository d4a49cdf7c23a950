"""Stored responses of the Responses API (``http_api.responses.ResponseStore``), sealed in the tenant's
encrypted history store like every turn: kind ``response`` blobs (privacy/blobs.py), so crypto-shredding
a tenant, key rotation, export and import cover them. Each is kept for ``retention_s``; expired ones are
refused on read and purged as new ones are stored."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from privacy import HistoryStore
from privacy.errors import IntegrityError, UnknownTenantError
from privacy.tenants import TenantId
from serving import errors

log = logging.getLogger(__name__)
PURGE_EVERY = 64  # stored responses of a tenant between two sweeps for expired ones


class StoredResponses:
    """Per-tenant stored responses over a ``HistoryStore`` (blocking: call from worker threads)."""

    def __init__(self, store: HistoryStore, retention_s: float) -> None:
        self.store = store
        self.retention_s = retention_s
        self._puts: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, record: dict[str, Any]) -> None:
        tid = TenantId(tenant)
        body = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        self.store.put_response(tid, response_id, body, time.time() + self.retention_s)
        with self._lock:
            count = self._puts[tenant] = self._puts.get(tenant, 0) + 1
        if count % PURGE_EVERY == 0:
            purged = self.store.purge_responses(tid)
            if purged:
                log.info("purged %d expired stored responses", purged)

    def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        try:
            body = self.store.get_response(TenantId(tenant), response_id)
        except UnknownTenantError:
            return None
        except IntegrityError:
            raise errors.DataLoss(f"the stored response {response_id!r:.80} failed its integrity check") from None
        return json.loads(body) if body is not None else None

    def delete(self, tenant: str, response_id: str) -> bool:
        try:
            return self.store.delete_response(TenantId(tenant), response_id)
        except UnknownTenantError:
            return False
