"""The data plane of a replica: requests wait (briefly) for their tenant's index, deleted tenants are
refused, and the engine's sessions leave recording to the stream.

- ``ReplicaBackend`` wraps the engine's ``DecodeBackend``: before a request is queued its tenant is
  loaded (snapshot + stream tail, at most ``load_wait_s``; past that the request runs without history
  drafts while the load finishes) and pinned against eviction until it ends.
- ``StreamFedProposer`` wraps the proposer the engine drafts with: a finished session never writes its
  turn into the tenant's index itself. The turn reaches the index from the stream after the writer
  appends it, on this replica exactly as on every other, so no replica applies a turn twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from serving import errors
from serving.admission import CancelEvent
from serving.backend import WrappedBackend
from serving.records import BackendEvent, Request


class _StreamFedSession:
    """A drafting session whose ``finish`` keeps parking its indexes but records nothing."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def finish(self, record: bool = True) -> None:
        self._inner.finish(record=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StreamFedProposer:
    """The proposer as the engine sees it on a replica (every other attribute is the inner one's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def begin(self, tenant: str, session_id: str, prompt_ids: Any, request_id: str = "") -> _StreamFedSession:
        return _StreamFedSession(self.inner.begin(tenant, session_id, prompt_ids, request_id))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ReplicaBackend(WrappedBackend):
    """``serving.backend.DecodeBackend`` over the engine's backend and the ``Replica``."""

    def __init__(self, inner: Any, replica: Any, load_wait_s: float) -> None:
        super().__init__(inner)
        self.replica = replica
        self.load_wait_s = load_wait_s

    def _refuse_deleted(self, tenant: str) -> None:
        if tenant in self.replica.deleted:  # the key check caught up already, unless it ran just before
            raise errors.Unauthenticated("unknown or revoked API key")

    async def generate(self, request: Request, cancel: CancelEvent) -> AsyncGenerator[BackendEvent, None]:
        tenant = request.tenant
        self._refuse_deleted(tenant)
        if request.params.speculate:  # loading the tenant's index is real work (snapshot + stream tail)
            await asyncio.get_running_loop().run_in_executor(None, self.replica.ensure, tenant, self.load_wait_s)
        with self.replica.pinned(tenant):
            self._refuse_deleted(tenant)
            async for event in self.inner.generate(request, cancel):
                yield event

    async def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        self._refuse_deleted(tenant)
        return await super().append_trajectory(tenant, session_id, token_ids)
