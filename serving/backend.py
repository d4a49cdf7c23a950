"""The seam between the serving core and an engine, async end to end.

Both engines implement ``DecodeBackend``: Reprise's own (``reprise.backends.engine.EngineBackend``, its
engine stepping on a thread of its own) and vLLM (``reprise.backends.vllm.backend.VllmBackend``, vLLM's
engine on its own event loop). A backend hands its events to the caller's event loop as they happen
(``loop.call_soon_threadsafe``), so no thread waits on another and nothing polls.

    await backend.check(request)                      # refuse what this engine cannot do, before decoding
    async for event in backend.generate(request, cancel):
        ...                                            # Tokens(ids, text) ..., then Finished(...)

``generate`` decodes ``request.prompt_ids`` (rendered by the core); ``cancel``
(``serving.admission.CancelEvent``: a ``threading.Event`` an engine thread reads every step, with
callbacks for an engine that must act at once) stops it: the stream then ends with
``Finished("aborted")``. Leaving the
stream early (the caller went away) cancels the request too. A failure that belongs to the request
ends its stream with an exception (``serving.errors``); a backend whose engine died raises
``errors.Unavailable`` and reports ``alive`` False.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from serving.admission import CancelEvent
from serving.records import BackendEvent, ModelInfo, Request


class DecodeBackend(Protocol):
    tokenizer: Any
    """The model's tokenizer (None when the engine decodes token ids only): the core renders prompts and
    splits text per token with it."""

    def model_info(self) -> ModelInfo:
        """The served model (cheap; called on the event loop)."""
        ...

    @property
    def alive(self) -> bool:
        """False once the engine has died: health turns NOT_SERVING."""
        ...

    async def check(self, request: Request) -> None:
        """Refuse, before decoding, what this engine cannot honour for ``request`` (its output grammar
        admits no complete output within max_new_tokens, a parameter the engine cannot apply): raise
        ``serving.errors.InvalidArgument`` naming the field. Work proportional to the request runs off
        the event loop."""
        ...

    def generate(self, request: Request, cancel: CancelEvent) -> AsyncGenerator[BackendEvent, None]:
        """Decode; see the module docstring."""
        ...

    async def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        """Add a turn to the tenant's history; return the number of tokens added."""
        ...

    async def close(self) -> None:
        """Flush history and release the model (graceful shutdown)."""
        ...


class TenantResidency(Protocol):
    """What happens to a tenant's drafting state around each of its requests, whichever engine decodes:
    ``hold`` makes it ready before the request decodes (loading it off the event loop where the memory
    budget evicted it, or a replica has not loaded it yet; a tenant deleted elsewhere is refused with
    ``errors.Unauthenticated``) and keeps it from eviction until the request ends; ``check`` refuses a
    deleted tenant's ``AppendTrajectory``. ``reprise.server.index_budget.IndexResidency`` (one process)
    and ``reprise.cluster.residency.ReplicaResidency`` (a replica among several) implement it; the
    serving core calls it around every request (``ServingCore.generate``)."""

    def hold(self, tenant: str, speculate: bool) -> AbstractAsyncContextManager[None]: ...

    def check(self, tenant: str) -> None: ...


class NoResidency:
    """A backend whose drafting state needs nothing before a request (tests; drafters without per-tenant
    indexes)."""

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, speculate: bool) -> AsyncIterator[None]:
        yield

    def check(self, tenant: str) -> None:
        pass
