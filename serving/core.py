"""The serving core: what every front does with a generation request, written once, for every engine.

    core = ServingCore(backend, ServingSettings(...), metrics)
    request = core.prepare(Request(tenant, PromptInput(...), GenerateParams(...)))   # validated once
    async for event in core.generate(request):
        ...   # Started, then TextDelta..., ToolCallDelta..., Finished

A front translates its wire into a ``Request`` and the events back into its wire; errors are
``serving.errors`` exceptions, which each front words in its own field names and maps to its own status
once. ``generate``:

1. **admit**: per-tenant and global limits (``serving.admission``), counted for both fronts together;
2. **render**: the prompt through the one renderer (``serving.render``) on a worker thread, the context
   checked and ``max_new_tokens`` set when the caller left it out (``serving.prepare.fit_to_prompt``);
3. **check**: the engine refuses what it cannot honour (an output grammar with no complete output that
   fits, ``DecodeBackend.check``);
4. **decode**: ``Started``, the tenant's drafting state held ready (``serving.backend.TenantResidency``),
   then the engine's committed tokens regrouped into fixed-size ``TextDelta``
   events with exactly their text (``serving.stream``), then the reply parsed for tool calls
   (``ToolCallDelta``) and ``Finished``.

Errors in steps 1-3 raise before ``Started``, so a front can still answer them with their own status.
The request leaves admission when the engine's stream has ended, before its last events go out, so a
client's next call fits at once. Cancelling (the caller went away, ``abort``, tenant deletion,
shutdown) sets the request's cancel event; the engine drops it at its next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from typing import Protocol

from serving import errors
from serving.admission import Admission
from serving.backend import DecodeBackend, NoResidency, TenantResidency
from serving.holdout import Holdout
from serving.prepare import (
    MAX_SESSION_CHARS,
    ServingSettings,
    check_id,
    check_size,
    check_token_ids,
    fit_to_prompt,
    prepare,
)
from serving.quotas import AppendQuotas
from serving.records import Event, Finished, PromptInput, Request, Started
from serving.render import PromptRenderer
from serving.stream import ReplyStream


class ServingMetrics(Protocol):
    """What the core reports (``reprise.server.metrics.ServiceMetrics`` has these methods)."""

    def observe_request(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        ttft: float | None, e2e: float) -> None: ...

    def observe_emission_gap(self, seconds: float) -> None: ...

    def set_requests_running(self, num: int) -> None: ...

    def observe_append_refused(self, quota: str) -> None: ...


class NullMetrics:
    """Reports nothing."""

    def observe_request(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        ttft: float | None, e2e: float) -> None:
        pass

    def observe_emission_gap(self, seconds: float) -> None:
        pass

    def set_requests_running(self, num: int) -> None:
        pass

    def observe_append_refused(self, quota: str) -> None:
        pass


class ServingCore:
    """Admission, rendering, the engine's stream and its events, for every front (module docstring)."""

    def __init__(self, backend: DecodeBackend, settings: ServingSettings, metrics: ServingMetrics | None = None,
                 render_threads: int = 4, residency: TenantResidency | None = None,
                 holdout: Holdout | None = None) -> None:
        self.backend = backend
        self.holdout = holdout if holdout is not None else Holdout(0.0)
        self.residency: TenantResidency = residency if residency is not None else NoResidency()
        self.settings = settings
        self.metrics: ServingMetrics = metrics if metrics is not None else NullMetrics()
        self.info = backend.model_info()
        self.renderer = PromptRenderer(backend.tokenizer, self.info)
        self.admission = Admission(settings.max_concurrent_requests, settings.max_requests_per_tenant,
                                   on_change=self.metrics.set_requests_running)
        self.append_quotas = AppendQuotas(settings.append_calls_per_s, settings.append_burst_calls,
                                          settings.append_tokens_per_minute,
                                          on_refused=self.metrics.observe_append_refused)
        self._render_pool = concurrent.futures.ThreadPoolExecutor(render_threads, thread_name_prefix="reprise-render")

    # ---- requests -----------------------------------------------------------------------------------

    def prepare(self, request: Request) -> Request:
        """The request a front built, validated (``serving.prepare.prepare`` with this server's model and
        settings)."""
        return prepare(self.info, self.settings, request)

    async def generate(self, request: Request, hold_tool_text: bool = False) -> AsyncGenerator[Event, None]:
        """The request's events (module docstring). Errors before ``Started`` raise from the first
        ``__anext__``; after it, from the event where they happened. ``hold_tool_text``: text that may
        be a tool call is held back from ``TextDelta`` events (``serving.stream.ReplyStream``)."""
        arrival = time.perf_counter()
        active = self.admission.admit(request.tenant, request.request_id)
        finish, usage, first, last, ended = "error", None, None, arrival, False
        measured, held_out, first_tokens = request.params.speculate, False, 0
        try:
            if self.admission.draining:
                raise errors.Unavailable("server is shutting down; retry on another replica")
            if not self.backend.alive:
                raise errors.Unavailable("the decoding engine has stopped; retry on another replica")
            ids = await self._render(request.prompt, add_generation_prompt=True)
            request = fit_to_prompt(request, ids, self.info, self.settings)
            request, held_out = self.holdout.take(request)
            await self.backend.check(request)
            yield Started(request)
            stream = ReplyStream(request, self.backend.tokenizer, hold_tool_text)
            end: Finished | None = None
            async with (self.residency.hold(request.tenant, request.params.speculate),
                        contextlib.aclosing(self.backend.generate(request, active.cancel)) as events):
                async for event in events:
                    if isinstance(event, Finished):
                        end = event
                        break
                    now = time.perf_counter()
                    if event.token_ids:
                        if first is None:
                            first, first_tokens = now, len(event.token_ids)
                        else:
                            self.metrics.observe_emission_gap(now - last)
                        last = now
                    for delta in stream.add(event.token_ids, event.text):
                        yield delta
            if end is None:
                raise errors.Internal("the engine's stream ended without finishing the request")
            self.admission.release(active)
            if active.aborted and end.finish_reason != "aborted":
                end = dataclasses.replace(end, finish_reason="aborted")
            closing = stream.finish(end)
            last_event = closing[-1]
            assert isinstance(last_event, Finished)
            finish, usage, ended = last_event.finish_reason, last_event.usage, True
            if measured and first is not None and finish not in ("aborted", "error"):
                self.holdout.record(request.tenant, held_out, usage.completion_tokens - first_tokens, last - first)
            for out in closing:
                yield out
        except BaseException as exc:
            if not ended:
                finish = "aborted" if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else "error"
            raise
        finally:
            active.cancel.set()  # no-op once the engine is done with it
            self.admission.release(active)
            self.metrics.observe_request(finish, len(request.prompt_ids),
                                         usage.completion_tokens if usage is not None else 0,
                                         None if first is None else first - arrival, time.perf_counter() - arrival)

    async def append_trajectory(self, tenant: str, session_id: str, content: PromptInput) -> int:
        """Add a turn that did not go through ``generate`` to the tenant's history, within the tenant's
        quotas (``serving.quotas``: the call rate first, before any work; the tokens once counted).
        Errors name ``content`` (its token ids: ``content.token_ids``) and ``session_id``."""
        field = "content"
        if self.admission.draining:
            raise errors.Unavailable("server is shutting down; retry on another replica")
        self.append_quotas.admit_call(tenant)
        check_id("session_id", session_id, MAX_SESSION_CHARS)
        if content.token_ids is not None:
            check_token_ids("content.token_ids", content.token_ids, self.info.vocab_size)
        elif content.messages is not None and not self.info.has_chat_template:
            raise errors.FailedPrecondition.about(field, "the served model has no chat template: send text or tokens")
        check_size(content, self.info, field)
        ids = await self._render(content, add_generation_prompt=False)
        self.append_quotas.admit_tokens(tenant, len(ids), field)
        self.residency.check(tenant)
        return await self.backend.append_trajectory(tenant, session_id, ids)

    def abort(self, tenant: str, request_id: str) -> bool:
        """Cancel one of ``tenant``'s requests in flight; False when it has none with that id."""
        return self.admission.abort(tenant, request_id)

    async def _render(self, prompt: PromptInput, add_generation_prompt: bool) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._render_pool, self.renderer.render, prompt, add_generation_prompt)

    # ---- life cycle ---------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """What health says: not draining, and the engine alive."""
        return not self.admission.draining and self.backend.alive

    async def close(self) -> None:
        """Cancel what is still in flight, stop the render threads, close the backend (history flushed)."""
        self.admission.cancel_all()
        await asyncio.get_running_loop().run_in_executor(None, self._render_pool.shutdown, True)
        await self.backend.close()

