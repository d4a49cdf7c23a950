"""The data plane: ``reprise.v1.DecodingService``.

Each generation request is validated here (the boundary), admitted (per-tenant and global limits), and
decoded in a worker thread by the ``DecodeBackend``; committed tokens travel to the event loop through a
``ThreadPump`` and leave in chunks of a fixed number of tokens, so a caller cannot read how many draft
tokens a step accepted from the chunk sizes. A cancelled or expired call sets the request's cancel
event; the request stops counting as active when its worker thread has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from grpc_api import errors
from grpc_api.admission import ActiveRequest, Admission, ThreadPump
from grpc_api.backend import ChatMessage, DecodeBackend, GenerateParams, Generation, PromptInput
from grpc_api.interceptors import NullMetrics, current_principal
from grpc_api.v1 import common_pb2, decoding_pb2, decoding_pb2_grpc

MAX_ID_CHARS = 128
MAX_SESSION_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_CHUNK_TOKENS = 4096
CHAT_ROLES = ("system", "user", "assistant", "tool")
FINISH = {
    "stop": decoding_pb2.FINISH_REASON_STOP,
    "length": decoding_pb2.FINISH_REASON_LENGTH,
    "eos": decoding_pb2.FINISH_REASON_EOS,
    "aborted": decoding_pb2.FINISH_REASON_ABORTED,
}


def _check_id(name: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise errors.InvalidArgument(f"{name} has {len(value)} characters; at most {limit} are allowed")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise errors.InvalidArgument(f"{name} {value[:40]!r} contains control characters")
    return value


def prompt_input(message: Any, field: str) -> PromptInput:
    """The prompt of a GenerateRequest (oneof ``input``) or AppendTrajectoryRequest (``content``)."""
    which = message.WhichOneof(field)
    if which is None:
        raise errors.InvalidArgument(f"{field} is empty: set one of tokens, text or messages")
    if which == "tokens":
        if not message.tokens.ids:
            raise errors.InvalidArgument(f"{field}.tokens is empty")
        return PromptInput(token_ids=tuple(message.tokens.ids))
    if which == "text":
        if not message.text:
            raise errors.InvalidArgument(f"{field}.text is empty")
        return PromptInput(text=message.text)
    msgs = message.messages.messages
    if not msgs:
        raise errors.InvalidArgument(f"{field}.messages is empty")
    for i, m in enumerate(msgs):
        if m.role not in CHAT_ROLES:
            raise errors.InvalidArgument(
                f"{field}.messages[{i}].role is {m.role!r}; expected one of {', '.join(CHAT_ROLES)}")
    return PromptInput(messages=tuple(ChatMessage(m.role, m.content) for m in msgs))


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        index = list(ids).index(bad)
        raise errors.InvalidArgument(f"{name}[{index}] = {bad} is outside the vocabulary [0, {vocab_size})")


def generate_params(request: decoding_pb2.GenerateRequest, vocab_size: int,
                    max_context: int) -> tuple[GenerateParams, bool]:
    """Validated parameters; the flag says whether max_new_tokens was given (else it is filled later)."""
    s, st = request.sampling, request.stopping
    temperature = s.temperature if s.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise errors.InvalidArgument(f"sampling.temperature must be a finite number >= 0, got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise errors.InvalidArgument(f"sampling.top_p must be in (0, 1], got {top_p}")
    top_k = s.top_k if s.HasField("top_k") else 0
    if top_k < 0:
        raise errors.InvalidArgument(f"sampling.top_k must be >= 0 (0 = no cut), got {top_k}")
    if s.HasField("seed") and s.seed >= 2**63:
        raise errors.InvalidArgument(f"sampling.seed must be below 2^63, got {s.seed}")
    penalty = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    if not math.isfinite(penalty) or penalty <= 0:
        raise errors.InvalidArgument(f"sampling.repetition_penalty must be a finite number > 0, got {penalty}")
    explicit = st.HasField("max_new_tokens")
    max_new = st.max_new_tokens if explicit else 0
    if explicit and not 1 <= max_new < max_context:
        raise errors.InvalidArgument(
            f"stopping.max_new_tokens must be in [1, {max_context - 1}] (the model's context is {max_context}), "
            f"got {max_new}")
    if explicit and st.min_new_tokens > max_new:
        raise errors.InvalidArgument(
            f"stopping.min_new_tokens ({st.min_new_tokens}) exceeds max_new_tokens ({max_new})")
    if len(st.stop) > MAX_STOP_STRINGS:
        raise errors.InvalidArgument(f"stopping.stop has {len(st.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(st.stop):
        if not text or len(text) > MAX_STOP_CHARS:
            raise errors.InvalidArgument(
                f"stopping.stop[{i}] must have 1 to {MAX_STOP_CHARS} characters, got {len(text)}")
    if len(st.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise errors.InvalidArgument(
            f"stopping.stop_token_ids has {len(st.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    check_token_ids("stopping.stop_token_ids", st.stop_token_ids, vocab_size)
    if request.speculation not in (decoding_pb2.SPECULATION_MODE_UNSPECIFIED, decoding_pb2.SPECULATION_MODE_AUTO,
                                   decoding_pb2.SPECULATION_MODE_OFF):
        raise errors.InvalidArgument(f"speculation mode {request.speculation} is not a SpeculationMode")
    params = GenerateParams(
        max_new_tokens=max_new,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=int(s.seed) if s.HasField("seed") else None,
        repetition_penalty=float(penalty),
        min_new_tokens=int(st.min_new_tokens),
        stop=tuple(st.stop),
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        include_stop_str_in_output=st.include_stop_str_in_output,
        speculate=request.speculation != decoding_pb2.SPECULATION_MODE_OFF,
        record=not request.do_not_record,
    )
    return params, explicit


class Chunker:
    """Regroups committed tokens into chunks of exactly ``size`` tokens (the last may be shorter).

    A text delta leaves with the chunk that holds the last token it belongs to, so the concatenated
    chunk texts always equal the concatenated deltas.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: list[int] = []
        self._texts: list[tuple[int, str]] = []  # (tokens received when the delta arrived, delta)
        self._received = 0
        self._sent = 0

    def add(self, token_ids: Sequence[int], text: str) -> None:
        self._ids.extend(token_ids)
        self._received += len(token_ids)
        if text:
            self._texts.append((self._received, text))

    def take(self, final: bool = False) -> list[tuple[list[int], str]]:
        out: list[tuple[list[int], str]] = []
        while len(self._ids) >= self.size or (final and self._ids):
            n = min(self.size, len(self._ids))
            ids = self._ids[:n]
            del self._ids[:n]
            self._sent += n
            out.append((ids, self._pop_text(self._sent)))
        if final and self._texts:
            out.append(([], self._pop_text(self._received)))
        return out

    def _pop_text(self, upto: int) -> str:
        k = 0
        while k < len(self._texts) and self._texts[k][0] <= upto:
            k += 1
        text = "".join(t for _, t in self._texts[:k])
        del self._texts[:k]
        return text


class DecodingServicer(decoding_pb2_grpc.DecodingServiceServicer):
    def __init__(self, backend: DecodeBackend, admission: Admission, executor: concurrent.futures.Executor,
                 settings: Any, metrics: Any = None, version: str = "") -> None:
        self._backend = backend
        self._admission = admission
        self._executor = executor
        self._settings = settings
        self._metrics = metrics if metrics is not None else NullMetrics()
        self._info = backend.model_info()
        self._version = version

    # ---- generation ------------------------------------------------------------------------------

    def _prepare(self, request: decoding_pb2.GenerateRequest) -> tuple[str, PromptInput, GenerateParams, bool, int]:
        _check_id("request_id", request.request_id, MAX_ID_CHARS)
        _check_id("session_id", request.session_id, MAX_SESSION_CHARS)
        prompt = prompt_input(request, "input")
        if prompt.messages is not None and not self._info.has_chat_template:
            raise errors.FailedPrecondition("the served model has no chat template: send text or tokens")
        params, explicit = generate_params(request, self._info.vocab_size, self._info.max_context_tokens)
        chunk = request.stream_chunk_tokens or self._settings.stream_chunk_tokens
        if chunk > MAX_CHUNK_TOKENS:
            raise errors.InvalidArgument(f"stream_chunk_tokens must be <= {MAX_CHUNK_TOKENS}, got {chunk}")
        request_id = request.request_id or uuid.uuid4().hex
        return request_id, prompt, params, explicit, chunk

    def _run(self, pump: ThreadPump, active: ActiveRequest, session_id: str, prompt: PromptInput,
             params: GenerateParams, explicit: bool) -> Generation:
        """Worker thread: tokenize, check the context, decode."""
        info = self._info
        if prompt.token_ids is not None:
            prompt_ids: Sequence[int] = prompt.token_ids
            check_token_ids("input.tokens.ids", prompt_ids, info.vocab_size)
        else:
            prompt_ids = self._backend.tokenize(prompt, add_generation_prompt=True)
        n, ctx = len(prompt_ids), info.max_context_tokens
        if n >= ctx:
            raise errors.OutOfRange(f"the prompt has {n} tokens; the model's context holds {ctx}")
        if explicit and n + params.max_new_tokens > ctx:
            raise errors.OutOfRange(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) = {n + params.max_new_tokens} "
                f"exceeds the model's context of {ctx} tokens")
        if not explicit:
            budget = min(self._settings.default_max_new_tokens, ctx - n)
            params = _replace(params, max_new_tokens=budget, min_new_tokens=min(params.min_new_tokens, budget))
        if active.cancel.is_set():
            return Generation("aborted", prompt_tokens=n)
        return self._backend.generate(active.tenant, session_id, active.request_id, prompt_ids, params,
                                      lambda ids, text: pump.put((ids, text)), active.cancel)

    async def _decode(self, request: decoding_pb2.GenerateRequest):
        """Yield (token_ids, text) chunks, then the final ``Generation``; shared by both RPCs."""
        principal = current_principal()
        arrival = time.perf_counter()
        request_id, prompt, params, explicit, chunk_size = self._prepare(request)
        active = self._admission.admit(principal.id, request_id)
        loop = asyncio.get_running_loop()
        release = functools.partial(self._admission.release, active)
        pump = ThreadPump(loop, on_end=release)  # freed before the answer goes out, so a client's next call fits
        future = pump.start(self._executor, self._run, pump, active, request.session_id, prompt, params, explicit)
        future.add_done_callback(lambda _: _call_soon(loop, release))  # a worker left running by a cancelled call
        chunker = Chunker(chunk_size)
        first: float | None = None
        last = arrival
        completion = 0
        finish = "error"
        generation: Generation | None = None
        try:
            yield request_id
            async for ids, text in pump.items():
                now = time.perf_counter()
                if ids:
                    if first is None:
                        first = now
                    else:
                        self._metrics.observe_emission_gap(now - last)
                    last = now
                    completion += len(ids)
                chunker.add(ids, text)
                for out in chunker.take():
                    yield out
            generation = pump.result
            if active.aborted and generation.finish_reason != "aborted":
                generation = _replace(generation, finish_reason="aborted")
            for out in chunker.take(final=True):
                yield out
            finish = generation.finish_reason
            yield generation
        except BaseException as exc:
            finish = "aborted" if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else "error"
            raise
        finally:
            active.cancel.set()  # no-op once the worker has returned
            prompt_tokens = generation.prompt_tokens if generation else 0
            self._metrics.observe_request(finish, prompt_tokens, completion,
                                          None if first is None else first - arrival,
                                          time.perf_counter() - arrival)

    async def GenerateStream(self, request, context):
        request_id = ""
        async with contextlib.aclosing(self._decode(request)) as items:
            async for item in items:
                if isinstance(item, str):
                    request_id = item
                elif isinstance(item, Generation):
                    yield decoding_pb2.GenerateStreamResponse(request_id=request_id, complete=_complete(item))
                else:
                    ids, text = item
                    yield decoding_pb2.GenerateStreamResponse(
                        request_id=request_id, chunk=decoding_pb2.Chunk(token_ids=ids, text=text))

    async def Generate(self, request, context):
        request_id, ids, texts = "", [], []
        generation = None
        async with contextlib.aclosing(self._decode(request)) as items:
            async for item in items:
                if isinstance(item, str):
                    request_id = item
                elif isinstance(item, Generation):
                    generation = item
                else:
                    ids.extend(item[0])
                    texts.append(item[1])
        assert generation is not None
        return decoding_pb2.GenerateResponse(request_id=request_id, token_ids=ids, text="".join(texts),
                                             complete=_complete(generation))

    # ---- the rest ----------------------------------------------------------------------------------

    async def Abort(self, request, context):
        principal = current_principal()
        if not request.request_id:
            raise errors.InvalidArgument("request_id is empty: name the request to abort")
        _check_id("request_id", request.request_id, MAX_ID_CHARS)  # as Generate caps it: ids echo in statuses
        if not self._admission.abort(principal.id, request.request_id):
            raise errors.NotFound(f"no request {request.request_id!r} in flight")
        return decoding_pb2.AbortResponse()

    async def GetModelInfo(self, request, context):
        info = self._info
        return decoding_pb2.ModelInfo(model_name=info.model_name, max_context_tokens=info.max_context_tokens,
                                      eos_token_ids=info.eos_token_ids, vocab_size=info.vocab_size,
                                      has_chat_template=info.has_chat_template, server_version=self._version)

    async def AppendTrajectory(self, request, context):
        principal = current_principal()
        _check_id("session_id", request.session_id, MAX_SESSION_CHARS)
        content = prompt_input(request, "content")
        if content.messages is not None and not self._info.has_chat_template:
            raise errors.FailedPrecondition("the served model has no chat template: send text or tokens")
        if self._admission.draining:
            raise errors.Unavailable("server is shutting down; retry on another replica")

        def run() -> int:
            if content.token_ids is not None:
                ids: Sequence[int] = content.token_ids
                check_token_ids("content.tokens.ids", ids, self._info.vocab_size)
            else:
                ids = self._backend.tokenize(content, add_generation_prompt=False)
            return self._backend.append_trajectory(principal.id, request.session_id, ids)

        loop = asyncio.get_running_loop()
        num = await loop.run_in_executor(self._executor, run)
        return decoding_pb2.AppendTrajectoryResponse(num_tokens=num)


def _complete(g: Generation) -> decoding_pb2.Complete:
    complete = decoding_pb2.Complete(
        finish_reason=FINISH.get(g.finish_reason, decoding_pb2.FINISH_REASON_UNSPECIFIED),
        usage=decoding_pb2.Usage(prompt_tokens=g.prompt_tokens, completion_tokens=g.completion_tokens,
                                 total_tokens=g.prompt_tokens + g.completion_tokens),
    )
    if isinstance(g.matched_stop, str):
        complete.stop_str = g.matched_stop
    elif isinstance(g.matched_stop, int):
        complete.stop_token_id = g.matched_stop
    return complete


def _replace(record: Any, **changes: Any) -> Any:
    return dataclasses.replace(record, **changes)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nothing left to release
        pass


__all__ = ["Chunker", "DecodingServicer", "common_pb2", "generate_params", "prompt_input"]
