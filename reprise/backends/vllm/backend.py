"""The data plane's backend when vLLM decodes: ``grpc_api.backend.DecodeBackend`` over ``VllmEngine``.

A gRPC worker thread calls ``generate``; the request runs on vLLM's engine (continuous batching with
every other request) and its tokens reach ``on_tokens`` as vLLM streams them. What Reprise adds, all
decided here in the service after authentication, never taken from the client:

- the request's ``RequestTag`` (tenant, session, speculation on or off) in ``SamplingParams.extra_args``:
  the worker's proposer drafts for that tenant only (``proposer.RepriseVllmProposer``);
- the prefix cache's ``cache_salt``: a keyed hash of the tenant, so one tenant's requests never reuse
  (or time) another's cached blocks (CVE-2025-46570), while a tenant's own repeated prefixes still hit;
- the finished turn: sealed into the encrypted store through the same history sink as the own engine
  (``reprise.server.history_writer.HistoryWriter``) before the reply goes out (``store_before_reply``,
  as the own engine does: ``reprise.backends.stored``), and added to the worker's index of that tenant;
- the per-step figures: the worker's step records (draft length, accepted, drafter) are drained every
  ``poll_s`` into the same step observer (``reprise.server.metering.StepMeter``: per-tenant accounting
  and Prometheus metrics) the own engine feeds.

Cancelling (client gone, deadline, Abort) cancels the request's task; vLLM's ``generate`` then aborts
the request in the engine core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import secrets
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from grpc_api import errors
from grpc_api.backend import FinishReason, GenerateParams, Generation, ModelInfo, PromptInput, TokenCallback
from reprise.backends.stored import STORE_WAIT_S, await_stored
from reprise.backends.vllm.tags import RequestTag, StepRecord
from reprise.backends.vllm.tenants import token_bytes
from reprise.engine.engine import StepReport
from reprise.engine.request import GenerationRequest, GenerationResult, Usage

log = logging.getLogger(__name__)


def cache_salt(key: bytes, tenant: str) -> str:
    """The prefix-cache salt of ``tenant``: HMAC-SHA256 under the service's key (the tenant id itself
    never reaches vLLM's cache keys, and nobody without the key can compute another tenant's salt)."""
    return hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()


def tokenize_prompt(tokenizer: Any, prompt: PromptInput, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a text or chat prompt (the chat template applied to messages)."""
    if tokenizer is None:
        raise errors.FailedPrecondition("the served model has no tokenizer: send token ids")
    if prompt.text is not None:
        return list(tokenizer.encode(prompt.text, add_special_tokens=False))
    messages = [{"role": m.role, "content": m.content} for m in prompt.messages or ()]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the caller's
        raise errors.InvalidArgument(f"the chat template rejected these messages: {exc}") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class VllmBackend:
    """``DecodeBackend`` over a started ``VllmEngine`` whose proposer is Reprise's (or off).

    ``history_sink`` receives each recorded turn as a ``reprise.engine.request.GenerationResult`` (the
    store's writer, as for the own engine);
    ``record_trajectory`` stores an ``AppendTrajectory`` turn and indexes it (``TenantIndexes.record``);
    ``meter`` (a ``StepObserver``: ``on_step(reports)``) receives the worker's steps and ``accounting``
    (``record_request``) each finished request.
    ``close`` shuts the engine down too unless ``owns_engine`` is False (an engine shared by tests).
    """

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, *, accounting: Any, meter: Any = None,
                 history_sink: Callable[[Any], Any] | None = None,
                 record_trajectory: Callable[[str, str, Sequence[int]], None] | None = None,
                 on_close: Callable[[], None] | None = None, salt_key: bytes | None = None,
                 poll_s: float = 1.0, owns_engine: bool = True, store_before_reply: bool = True,
                 store_wait_s: float = STORE_WAIT_S, on_store_wait: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._drafting = engine.settings.speculation == "reprise"
        eos = getattr(tokenizer, "eos_token_id", None)
        self._info = ModelInfo(
            model_name=model_name, max_context_tokens=engine.settings.max_model_len,
            eos_token_ids=(int(eos),) if eos is not None else (),
            vocab_size=len(tokenizer) if tokenizer is not None else 0,
            has_chat_template=bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)),
        )
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
        self.prefix_cached_tokens: dict[str, int] = {}  # per tenant: prompt tokens served from its prefix cache
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()
        self._poller = threading.Thread(target=self._poll, args=(poll_s,), name="reprise-vllm-steps", daemon=True)
        if self._drafting:
            self._poller.start()

    # ---- DecodeBackend -------------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self._info

    def tokenize(self, prompt: PromptInput, add_generation_prompt: bool = True) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, add_generation_prompt)

    def cache_salt(self, tenant: str) -> str:
        return cache_salt(self._salt_key, tenant)

    def generate(self, tenant: str, session_id: str, request_id: str, prompt_ids: Sequence[int],
                 params: GenerateParams, on_tokens: TokenCallback, cancel: threading.Event) -> Generation:
        if not self.engine.alive:
            raise errors.Unavailable("the vLLM engine has stopped")
        prompt = [int(t) for t in prompt_ids]
        tag = RequestTag(tenant, session_id, params.speculate and self._drafting)
        engine_id = f"{request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        future = asyncio.run_coroutine_threadsafe(
            self._run(engine_id, prompt, self._sampling(params, tag), self.cache_salt(tenant), on_tokens),
            self.engine.loop)
        while True:
            try:
                reason, matched, output, cached = future.result(timeout=0.2)
                break
            except concurrent.futures.TimeoutError:
                if cancel.is_set():
                    future.cancel()  # the task's CancelledError makes vLLM abort the request
                    self._accounting.record_request(tenant)
                    return Generation("aborted", None, len(prompt), 0)
                if not self.engine.alive:
                    raise errors.Unavailable("the vLLM engine stopped while the request ran") from None
            except concurrent.futures.CancelledError:
                self._accounting.record_request(tenant)
                return Generation("aborted", None, len(prompt), 0)
        self._accounting.record_request(tenant)
        self.prefix_cached_tokens[tenant] = self.prefix_cached_tokens.get(tenant, 0) + cached
        if reason != "aborted" and params.record:
            ticket = self._remember(GenerationResult(
                GenerationRequest(prompt_ids=tuple(prompt), tenant=tenant, session_id=session_id,
                                  request_id=request_id), tuple(output), "", reason, matched,
                Usage(len(prompt), len(output), 0, 0, 0)))
            if self._store_before_reply:
                await_stored(ticket, self._store_wait_s, self._on_store_wait)
        return Generation(reason, matched, len(prompt), len(output))

    def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        if self._record is None:
            raise errors.FailedPrecondition("this server keeps no history")
        self._record(tenant, session_id, token_ids)
        return len(token_ids)

    def close(self) -> None:
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join(5)
            if self.engine.alive:  # the last steps' figures; a stopped engine has none to give
                try:
                    self.drain_steps()
                except RuntimeError as exc:
                    log.warning("the last drafting figures were lost: %s", exc)
        if self._on_close is not None:
            self._on_close()
        if self._owns_engine:
            self.engine.close()

    # ---- one request on the engine's loop ------------------------------------------------------------

    def _sampling(self, params: GenerateParams, tag: RequestTag) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed, repetition_penalty=params.repetition_penalty, min_tokens=params.min_new_tokens,
            max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA, extra_args=tag.to_extra_args())

    async def _run(self, engine_id: str, prompt: list[int], sampling: Any, salt: str,
                   on_tokens: TokenCallback) -> tuple[FinishReason, str | int | None, list[int], int]:
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
        """The finished turn: to the encrypted store (queued; the writer's ticket is returned) and to the
        worker's index of the tenant."""
        request = turn.request
        tenant = request.tenant
        ticket = self._sink(turn) if self._sink is not None else None
        if self._drafting and turn.token_ids:
            try:
                self.engine.rpc("reprise_record", tenant, request.session_id, token_bytes(request.prompt_ids),
                                token_bytes(turn.token_ids))
            except Exception:
                log.warning("could not add a turn of tenant %s to vLLM's drafting index", tenant, exc_info=True)
        return ticket

    def drain_steps(self) -> int:
        """Move the worker's step records into the accounting and metrics now; returns how many."""
        if not self._drafting:
            return 0
        with self._drain_lock:
            raw = self.engine.rpc("reprise_drain_steps")[0]
            steps = [StepRecord.from_wire(item) for item in raw]
            if steps and self._meter is not None:
                self._meter.on_step([StepReport(s.tenant, s.num_draft, s.num_accepted, s.source, 0, None, True)
                                     for s in steps])
        return len(raw)

    def health(self) -> dict[str, int]:
        """The worker proposer's degraded-step counters (failed, stalled, skipped, warnings)."""
        return dict(self.engine.rpc("reprise_health")[0]) if self._drafting else {}

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.drain_steps()
            except Exception:
                if not self._stop.is_set():
                    log.debug("draining vLLM's step records failed", exc_info=True)
