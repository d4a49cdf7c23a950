"""The decode backend when vLLM decodes: ``serving.backend.DecodeBackend`` over ``VllmEngine``.

The serving core renders the prompt (the same renderer as for the own engine: tools, tool calls and
tool results through the chat template) and calls ``generate``; the request runs on vLLM's engine
(continuous batching with every other request, on vLLM's own event loop) and its tokens reach the
core's loop as vLLM streams them (``call_soon_threadsafe``): no thread waits and nothing polls. What
Reprise adds, all decided here in the service after authentication, never taken from the client:

- the request's ``RequestTag`` (tenant, session, speculation on or off) in ``SamplingParams.extra_args``:
  the worker's proposer drafts for that tenant only (``proposer.RepriseVllmProposer``);
- structured output: a request's ``OutputConstraint`` (``response_format``, a forced tool call) is
  compiled and checked like the own engine's (reprise/engine/grammar_compiler.py: no complete output, or none
  that fits max_new_tokens, is refused before decoding) and handed to vLLM's structured-output support
  as the grammar's EBNF, which masks every token the grammar forbids and checks the drafts;
- the prefix cache's ``cache_salt``: a keyed hash of the tenant, so one tenant's requests never reuse
  (or time) another's cached blocks (CVE-2025-46570), while a tenant's own repeated prefixes still hit;
- the finished turn: sealed into the encrypted store through the same history sink as the own engine
  (``reprise.server.history_writer.HistoryWriter``) before the reply goes out (``store_before_reply``,
  as the own engine does: ``reprise.backends.stored``), and added to the worker's index of that tenant;
- the per-step figures: after each request the worker's step records (draft length, accepted,
  drafter) are drained into the same step observer (``reprise.server.metering.StepMeter``: per-tenant
  accounting and Prometheus metrics) the own engine feeds; reading a tenant's figures drains too.

Cancelling (client gone, deadline, Abort) cancels the request's task on vLLM's loop at once (the cancel
event's callback); vLLM's ``generate`` then aborts the request in the engine core, which frees its KV
blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from reprise.backends.engine import call_soon
from reprise.backends.grammars import Grammars
from reprise.backends.stored import STORE_WAIT_S, wait_stored
from reprise.backends.vllm.tags import RequestTag, StepRecord
from reprise.backends.vllm.tenants import token_bytes
from reprise.engine.engine import StepReport
from reprise.engine.grammar_compiler import ebnf_text
from reprise.engine.request import GenerationResult
from serving import errors
from serving.admission import CancelEvent
from serving.records import (
    BackendEvent,
    Finished,
    FinishReason,
    GenerateParams,
    ModelInfo,
    Request,
    Tokens,
    Usage,
)
from serving.render import model_info
from serving.savings import RequestCost

log = logging.getLogger(__name__)


def cache_salt(key: bytes, tenant: str) -> str:
    """The prefix-cache salt of ``tenant``: HMAC-SHA256 under the service's key (the tenant id itself
    never reaches vLLM's cache keys, and nobody without the key can compute another tenant's salt)."""
    return hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()


def client_error(exc: Exception) -> Exception:
    """vLLM's refusal of a request (its ``VLLMClientError``: a 4xx in vLLM's own server) as InvalidArgument
    naming the parameter; anything else as it is."""
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, VLLMClientError):
        return errors.InvalidArgument(f"vLLM refused the request: {exc}", getattr(exc, "parameter", None))
    return exc


class VllmBackend:
    """``DecodeBackend`` over a started ``VllmEngine`` whose proposer is Reprise's (or off).

    ``history_sink`` receives each recorded turn as a ``reprise.engine.request.GenerationResult`` (the
    store's writer, as for the own engine);
    ``record_trajectory`` stores an ``AppendTrajectory`` turn and indexes it (``TenantIndexes.record``);
    ``meter`` (a ``StepObserver``: ``on_step(reports)``) receives the worker's steps and ``accounting``
    (``record_request``) each finished request.
    ``close`` shuts the engine down too unless ``owns_engine`` is False (an engine shared by tests).
    ``index_turns``: a finished turn is added to the worker's index of its tenant at once (off on a
    replica, where it reaches the index from the shared stream: reprise/cluster/).
    """

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, *, accounting: Any, meter: Any = None,
                 history_sink: Callable[[Any], Any] | None = None,
                 record_trajectory: Callable[[str, str, Sequence[int]], None] | None = None,
                 on_close: Callable[[], None] | None = None, salt_key: bytes | None = None,
                 owns_engine: bool = True, store_before_reply: bool = True,
                 store_wait_s: float = STORE_WAIT_S, on_store_wait: Callable[[float], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None, index_turns: bool = True) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._drafting = engine.settings.speculation == "reprise"
        self._index_turns = index_turns and self._drafting
        eos = getattr(tokenizer, "eos_token_id", None)
        self._info = model_info(tokenizer, model_name, engine.settings.max_model_len,
                                (int(eos),) if eos is not None else (),
                                len(tokenizer) if tokenizer is not None else 0)
        self._accounting = accounting
        self._meter = meter
        self._sink = history_sink
        self._record = record_trajectory
        self._on_close = on_close
        self._owns_engine = owns_engine
        self._store_before_reply = store_before_reply
        self._store_wait_s = store_wait_s
        self._on_store_wait = on_store_wait
        self._salt_key = salt_key if salt_key is not None else secrets.token_bytes(32)
        self._grammars = Grammars(tokenizer, self._info.vocab_size, self._info.eos_token_ids)
        self.prefix_cached_tokens: dict[str, int] = {}  # per tenant: prompt tokens served from its prefix cache
        self._drain_lock = threading.Lock()
        self._drain_pending = False
        self._on_fatal = on_fatal
        self._fatal_reported = False

    # ---- DecodeBackend -------------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self._info

    @property
    def alive(self) -> bool:
        return bool(self.engine.alive)

    def cache_salt(self, tenant: str) -> str:
        return cache_salt(self._salt_key, tenant)

    async def check(self, request: Request) -> None:
        if request.params.logit_bias and self.engine.settings.speculative_config() is not None:
            raise errors.bad_field("logit_bias", "is not supported by this server's engine: vLLM refuses it with "
                                                 "speculative decoding (model.engine vllm, drafting on)")
        if request.params.constraint is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._grammar_text, request)

    def _grammar_text(self, request: Request) -> str | None:
        """*Blocking.* The request's grammar as EBNF for vLLM, checked as the own engine checks it."""
        compiled = self._grammars.compile(request)
        return ebnf_text(compiled) if compiled is not None else None

    async def generate(self, request: Request, cancel: CancelEvent) -> AsyncGenerator[BackendEvent, None]:
        if not self.engine.alive:
            raise errors.Unavailable("the vLLM engine has stopped; retry on another replica")
        loop = asyncio.get_running_loop()
        grammar = None
        if request.params.constraint is not None:  # checked and compiled by check(): a cache hit
            grammar = await loop.run_in_executor(None, self._grammar_text, request)
        tenant, prompt = request.tenant, list(request.prompt_ids)
        tag = RequestTag(tenant, request.session_id, request.params.speculate and self._drafting)
        engine_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        tokens: asyncio.Queue[Tokens] = asyncio.Queue()
        task = asyncio.run_coroutine_threadsafe(
            self._run(engine_id, prompt, self._sampling(request.params, tag, grammar), self.cache_salt(tenant),
                      lambda ids, text: call_soon(loop, tokens.put_nowait, Tokens(tuple(ids), text))),
            self.engine.loop)

        def stop() -> None:  # from the cancelling thread; the task's CancelledError makes vLLM abort the request
            task.cancel()

        cancel.add_callback(stop)
        done = asyncio.wrap_future(task)
        try:
            while True:
                getter = asyncio.ensure_future(tokens.get())
                waiters: set[asyncio.Future[Any]] = {getter, done}
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not tokens.empty():  # streamed before the end
                    yield tokens.get_nowait()
                break
            try:
                reason, matched, output, cached = done.result()
            except asyncio.CancelledError:
                reason, matched, output, cached = "aborted", None, [], 0
            except Exception as exc:
                raise client_error(exc) from exc
            if not self.engine.alive and reason == "aborted" and not cancel.is_set():
                self._engine_died(RuntimeError("vLLM's engine stopped"))
                raise errors.Unavailable("the vLLM engine stopped while the request ran; retry")
            self._accounting.record_request(tenant)
            self.prefix_cached_tokens[tenant] = self.prefix_cached_tokens.get(tenant, 0) + cached
            usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(output), cached_tokens=cached)
            if reason != "aborted" and request.params.record:
                ticket = await loop.run_in_executor(None, self._remember, GenerationResult(
                    request, tuple(output), "", reason, matched, usage))
                if self._store_before_reply:
                    await wait_stored(ticket, self._store_wait_s, self._on_store_wait)
            self._drain_soon(loop)
            yield Finished(reason, usage, matched, token_ids=tuple(output))
        finally:
            cancel.set()  # a caller that left early: the task is cancelled (a no-op once it is done)

    def _engine_died(self, error: BaseException) -> None:
        """vLLM's engine stopped (a request noticed): tell the service once (health, exit code)."""
        if not self._fatal_reported and self._on_fatal is not None:
            self._fatal_reported = True
            log.critical("vLLM's engine has stopped; the service cannot decode")
            self._on_fatal(error)

    async def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        if self._record is None:
            raise errors.FailedPrecondition("this server keeps no history")
        record = self._record
        await asyncio.get_running_loop().run_in_executor(None, record, tenant, session_id, list(token_ids))
        return len(token_ids)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close_now)

    def close_now(self) -> None:
        """*Blocking.* The last steps' figures, then history flushed and the engine shut down."""
        if self._drafting and self.engine.alive:
            try:
                self.drain_steps()
            except RuntimeError as exc:
                log.warning("the last drafting figures were lost: %s", exc)
        if self._on_close is not None:
            self._on_close()
        if self._owns_engine:
            self.engine.close()

    # ---- one request on the engine's loop ------------------------------------------------------------

    def _sampling(self, params: GenerateParams, tag: RequestTag, grammar: str | None = None) -> Any:
        """The request's parameters as vLLM's ``SamplingParams`` (its wire), the tag in ``extra_args``."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        assert params.max_new_tokens is not None, "the serving core sets max_new_tokens before decoding"
        return SamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed, repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias) or None,
            min_tokens=params.min_new_tokens,
            max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            structured_outputs=StructuredOutputsParams(grammar=grammar) if grammar is not None else None,
            output_kind=RequestOutputKind.DELTA, extra_args=tag.to_extra_args())

    async def _run(self, engine_id: str, prompt: list[int], sampling: Any, salt: str,
                   on_tokens: Callable[[list[int], str], None]) -> tuple[FinishReason, str | int | None, list[int], int]:
        """On vLLM's loop: the request's stream, tokens to ``on_tokens``; its end."""
        from vllm.inputs import TokensPrompt

        output: list[int] = []
        reason: FinishReason = "aborted"
        matched: str | int | None = None
        cached = 0
        async for out in self.engine.llm.generate(TokensPrompt(prompt_token_ids=prompt, cache_salt=salt),
                                                  sampling, engine_id):
            delta = out.outputs[0]
            ids = list(delta.token_ids)
            if ids or delta.text:
                output += ids
                on_tokens(ids, delta.text)
            cached = int(out.num_cached_tokens or 0)
            if out.finished:
                reason, matched = self._finish(delta.finish_reason, delta.stop_reason, output)
        return reason, matched, output, cached

    def _finish(self, finish_reason: str | None, stop_reason: Any, output: list[int]) -> tuple[FinishReason,
                                                                                                 str | int | None]:
        """vLLM's finish reason as Reprise's: "stop" without a stop reason is the end-of-sequence token."""
        if finish_reason == "length":
            return "length", None
        if finish_reason == "stop":
            if stop_reason is None:
                return "eos", output[-1] if output else None
            return "stop", stop_reason
        return "aborted", None

    # ---- history and figures -------------------------------------------------------------------------

    def _remember(self, turn: GenerationResult) -> Any:
        """*Blocking.* The finished turn: to the encrypted store (queued; the writer's ticket is returned)
        and to the worker's index of the tenant."""
        request = turn.request
        tenant = request.tenant
        ticket = self._sink(turn) if self._sink is not None else None
        if self._index_turns and turn.token_ids:
            try:
                self.engine.rpc("reprise_record", tenant, request.session_id, token_bytes(request.prompt_ids),
                                token_bytes(turn.token_ids))
            except Exception:
                log.warning("could not add a turn of tenant %s to vLLM's drafting index", tenant, exc_info=True)
        return ticket

    def _drain_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drain the worker's step records on a worker thread, at most one drain pending at a time."""
        if not self._drafting or self._drain_pending:
            return
        self._drain_pending = True

        def drain() -> None:
            self._drain_pending = False
            try:
                self.drain_steps()
            except Exception:
                log.debug("draining vLLM's step records failed", exc_info=True)

        loop.run_in_executor(None, drain)

    def drain_steps(self) -> int:
        """*Blocking.* Move the worker's step records into the accounting and metrics now; returns how many."""
        if not self._drafting:
            return 0
        with self._drain_lock:
            raw = self.engine.rpc("reprise_drain_steps")[0]
            if raw and self._meter is not None:
                self._meter.on_step([_report(StepRecord.from_wire(item)) for item in raw])
        return len(raw)

    def health(self) -> dict[str, int]:
        """The worker proposer's degraded-step counters (failed, stalled, skipped, warnings)."""
        return dict(self.engine.rpc("reprise_health")[0]) if self._drafting else {}


def _report(step: StepRecord) -> StepReport:
    """A worker's step record as the own engine's report of it, for the same step observer."""
    cost = RequestCost(step.seconds, step.plain_seconds) if step.seconds > 0 else None
    return StepReport(step.tenant, step.num_draft, step.num_accepted, step.source, 0, None, True, step.num_tokens,
                      cost)
