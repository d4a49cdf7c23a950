"""The data plane of a replica: a request waits (briefly) for its tenant's index, and deleted tenants are
refused.

``ReplicaResidency`` is the replica's ``serving.backend.TenantResidency``, whichever engine decodes:
before a request decodes its tenant is loaded (snapshot + stream tail, at most ``load_wait_s``; past that
the request runs without history drafts while the load finishes) and pinned against eviction until it
ends. A finished turn never enters the index from the engine itself (``EngineConfig.index_turns`` and
``VllmBackend``'s ``index_turns`` are off on a replica): it reaches the index from the stream after the
writer appends it, on this replica exactly as on every other, so no replica applies a turn twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from serving import errors


class ReplicaResidency:
    """``serving.backend.TenantResidency`` over the ``Replica``."""

    def __init__(self, replica: Any, load_wait_s: float) -> None:
        self.replica = replica
        self.load_wait_s = load_wait_s

    def check(self, tenant: str) -> None:
        if tenant in self.replica.deleted:  # the key check caught up already, unless it ran just before
            raise errors.Unauthenticated("unknown or revoked API key")

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, speculate: bool) -> AsyncIterator[None]:
        self.check(tenant)
        if speculate:  # loading the tenant's index is real work (snapshot + stream tail)
            await asyncio.get_running_loop().run_in_executor(None, self.replica.ensure, tenant, self.load_wait_s)
        with self.replica.pinned(tenant):
            self.check(tenant)
            yield
