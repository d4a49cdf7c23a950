"""What both fronts (the gRPC data plane, the OpenAI-compatible HTTP API) do with a generation request,
written once: parameter validation, tools and structured output, admission, the worker-thread pump,
fixed-size chunks, tool-call parsing, and the request metrics.

    front = DecodeFront(backend, admission, executor, settings, metrics)
    params, explicit = check_params(RawParams(...), names, info)       # a 400 / INVALID_ARGUMENT names the field
    job = DecodeJob(request_id, session_id, prompt, params, explicit, chunk_tokens, tool_format)
    async for item in front.decode(tenant, job):   # request id, then (token_ids, text) chunks, then Generation
        ...

A front translates its own wire format into these records and back; errors are ``grpc_api.errors``
exceptions, which each front maps to its own status (gRPC codes, HTTP statuses). Each request is
decoded in a worker thread by the ``DecodeBackend``; committed tokens travel to the event loop through
a ``ThreadPump`` and leave in chunks of a fixed number of tokens, so a caller cannot read how many
draft tokens a step accepted from the chunk sizes. A cancelled call sets the request's cancel event;
the request stops counting as active when its worker thread has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import math
import re
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpc_api import errors
from grpc_api.admission import ActiveRequest, Admission, ThreadPump
from grpc_api.backend import (
    ChatMessage,
    DecodeBackend,
    GenerateParams,
    Generation,
    ModelInfo,
    OutputConstraint,
    PromptInput,
    Tool,
)
from grpc_api.interceptors import NullMetrics
from grpc_api.tool_calls import FORMATS, ParsedReply

MAX_ID_CHARS = 128
MAX_SESSION_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_CHUNK_TOKENS = 4096
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 64 * 1024
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (and '.')


def check_id(name: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise errors.InvalidArgument(f"{name} has {len(value)} characters; at most {limit} are allowed")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise errors.InvalidArgument(f"{name} {value[:40]!r} contains control characters")
    return value


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        index = list(ids).index(bad)
        raise errors.InvalidArgument(f"{name}[{index}] = {bad} is outside the vocabulary [0, {vocab_size})")


def check_messages(field: str, messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """Roles known, tool messages answering a call; ``developer`` is read as ``system`` (OpenAI's rename)."""
    if not messages:
        raise errors.InvalidArgument(f"{field} is empty")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise errors.InvalidArgument(
                f"{field}[{i}].role is {m.role!r}; expected one of {', '.join(CHAT_ROLES)}")
        if m.tool_calls and m.role != "assistant":
            raise errors.InvalidArgument(f"{field}[{i}].tool_calls: only assistant messages carry tool calls")
        for j, call in enumerate(m.tool_calls):
            if not call.name:
                raise errors.InvalidArgument(f"{field}[{i}].tool_calls[{j}].function.name is empty")
        out.append(dataclasses.replace(m, role="system") if m.role == "developer" else m)
    return tuple(out)


# ---- sampling and stopping -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RawParams:
    """Sampling and stopping values as a front received them (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    speculate: bool = True
    record: bool = True
    constraint: OutputConstraint | None = None


def check_params(raw: RawParams, names: Mapping[str, str], info: ModelInfo) -> tuple[GenerateParams, bool]:
    """Validated parameters; the flag says whether max_new_tokens was given (else it is filled later).
    ``names`` maps RawParams' field names to the front's own (errors name the field as the caller sent it)."""

    def name(f: str) -> str:
        return names.get(f, f)

    temperature = 0.0 if raw.temperature is None else float(raw.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise errors.InvalidArgument(f"{name('temperature')} must be a finite number >= 0, got {temperature}")
    top_p = 1.0 if raw.top_p is None else float(raw.top_p)
    if not (0.0 < top_p <= 1.0):
        raise errors.InvalidArgument(f"{name('top_p')} must be in (0, 1], got {top_p}")
    top_k = 0 if raw.top_k is None else int(raw.top_k)
    if top_k < 0:
        raise errors.InvalidArgument(f"{name('top_k')} must be >= 0 (0 = no cut), got {top_k}")
    if raw.seed is not None and not 0 <= raw.seed < 2**63:
        raise errors.InvalidArgument(f"{name('seed')} must be below 2^63 and not negative, got {raw.seed}")
    penalty = 1.0 if raw.repetition_penalty is None else float(raw.repetition_penalty)
    if not math.isfinite(penalty) or penalty <= 0:
        raise errors.InvalidArgument(f"{name('repetition_penalty')} must be a finite number > 0, got {penalty}")
    explicit = raw.max_new_tokens is not None
    max_new = int(raw.max_new_tokens) if raw.max_new_tokens is not None else 0
    ctx = info.max_context_tokens
    if explicit and not 1 <= max_new < ctx:
        raise errors.InvalidArgument(
            f"{name('max_new_tokens')} must be in [1, {ctx - 1}] (the model's context is {ctx}), got {max_new}")
    if raw.min_new_tokens < 0:
        raise errors.InvalidArgument(f"{name('min_new_tokens')} must be >= 0, got {raw.min_new_tokens}")
    if explicit and raw.min_new_tokens > max_new:
        raise errors.InvalidArgument(
            f"{name('min_new_tokens')} ({raw.min_new_tokens}) exceeds max_new_tokens ({max_new})")
    if len(raw.stop) > MAX_STOP_STRINGS:
        raise errors.InvalidArgument(f"{name('stop')} has {len(raw.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(raw.stop):
        if not isinstance(text, str) or not text or len(text) > MAX_STOP_CHARS:
            raise errors.InvalidArgument(
                f"{name('stop')}[{i}] must be a string of 1 to {MAX_STOP_CHARS} characters, got {text!r:.60}")
    if len(raw.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise errors.InvalidArgument(
            f"{name('stop_token_ids')} has {len(raw.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    check_token_ids(name("stop_token_ids"), raw.stop_token_ids, info.vocab_size)
    params = GenerateParams(
        max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=None if raw.seed is None else int(raw.seed), repetition_penalty=penalty,
        min_new_tokens=int(raw.min_new_tokens), stop=tuple(raw.stop), stop_token_ids=tuple(raw.stop_token_ids),
        ignore_eos=raw.ignore_eos, include_stop_str_in_output=raw.include_stop_str_in_output,
        speculate=raw.speculate, record=raw.record, constraint=raw.constraint)
    return params, explicit


# ---- tools and structured output -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``auto`` (the model decides), ``none`` (no calls are parsed), ``required`` (one call of any tool,
    forced by the grammar), ``function`` (one call of the tool ``name``, forced)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str = ""


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (valid under ``schema``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: str = ""


def check_tools(field: str, tools: Sequence[Tool]) -> tuple[Tool, ...]:
    if len(tools) > MAX_TOOLS:
        raise errors.InvalidArgument(f"{field} has {len(tools)} tools; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not _TOOL_NAME.match(t.name):
            raise errors.InvalidArgument(
                f"{field}[{i}].function.name {t.name!r:.70} must be 1 to 64 letters, digits, '_', '-' or '.'")
        if t.name in seen:
            raise errors.InvalidArgument(f"{field}[{i}].function.name {t.name!r} appears twice")
        seen.add(t.name)
        _schema(f"{field}[{i}].function.parameters", t.parameters or "{}")
    return tuple(tools)


def _schema(field: str, text: str) -> dict:
    if len(text) > MAX_SCHEMA_CHARS:
        raise errors.InvalidArgument(f"{field} has {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidArgument(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise errors.InvalidArgument(f"{field} must be a JSON Schema object, got {type(value).__name__}")
    return value


def output_constraint(tools: Sequence[Tool], choice: ToolChoice, response_format: ResponseFormat,
                      tool_format: str, fields: Mapping[str, str]) -> OutputConstraint | None:
    """The grammar a request's output must follow, if any: a forced tool call (``required`` or a named
    function) in the model's own tool-call format, or the JSON of ``response_format``."""
    forced = choice.mode in ("required", "function")
    if forced and not tools:
        raise errors.InvalidArgument(f"{fields['tool_choice']} is {choice.mode!r} but the request has no tools")
    if forced and response_format.type != "text":
        raise errors.InvalidArgument(
            f"{fields['response_format']} and a forced {fields['tool_choice']} cannot both shape the output")
    if choice.mode == "function":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise errors.InvalidArgument(
                f"{fields['tool_choice']} names the function {choice.name!r}, which is not among the tools")
        return FORMATS[tool_format].constraint(chosen)
    if choice.mode == "required":
        return FORMATS[tool_format].constraint(tools)
    if response_format.type == "json_object":
        return OutputConstraint('{"type": "object"}', name="json_object")
    if response_format.type == "json_schema":
        _schema(fields["json_schema"], response_format.schema)
        return OutputConstraint(response_format.schema, name="json_schema")
    return None


# ---- one request -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeJob:
    """A validated generation request. ``tool_format`` is set when the reply is to be parsed for calls."""

    request_id: str
    session_id: str
    prompt: PromptInput
    params: GenerateParams
    explicit_max: bool
    chunk_tokens: int
    tool_format: str | None = None


class DecodeFront:
    """Admission, the worker thread, chunks and metrics of generation requests, for both fronts."""

    def __init__(self, backend: DecodeBackend, admission: Admission, executor: concurrent.futures.Executor,
                 settings: Any, metrics: Any = None) -> None:
        self.backend = backend
        self.admission = admission
        self.executor = executor
        self.settings = settings
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.info = backend.model_info()

    def chunk_tokens(self, requested: int, field: str) -> int:
        chunk = requested or self.settings.stream_chunk_tokens
        if chunk > MAX_CHUNK_TOKENS:
            raise errors.InvalidArgument(f"{field} must be <= {MAX_CHUNK_TOKENS}, got {chunk}")
        return chunk

    def check_chat(self) -> None:
        if not self.info.has_chat_template:
            raise errors.FailedPrecondition("the served model has no chat template: send text or tokens")

    def _run(self, pump: ThreadPump, active: ActiveRequest, job: DecodeJob) -> Generation:
        """Worker thread: tokenize, check the context, decode."""
        info, params = self.info, job.params
        if job.prompt.token_ids is not None:
            prompt_ids: Sequence[int] = job.prompt.token_ids
            check_token_ids("input.tokens.ids", prompt_ids, info.vocab_size)
        else:
            prompt_ids = self.backend.tokenize(job.prompt, add_generation_prompt=True)
        n, ctx = len(prompt_ids), info.max_context_tokens
        if n >= ctx:
            raise errors.OutOfRange(f"the prompt has {n} tokens; the model's context holds {ctx}")
        if job.explicit_max and n + params.max_new_tokens > ctx:
            raise errors.OutOfRange(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) = {n + params.max_new_tokens} "
                f"exceeds the model's context of {ctx} tokens")
        if not job.explicit_max:
            budget = min(self.settings.default_max_new_tokens, ctx - n)
            params = dataclasses.replace(params, max_new_tokens=budget,
                                         min_new_tokens=min(params.min_new_tokens, budget))
        if active.cancel.is_set():
            return Generation("aborted", prompt_tokens=n)
        return self.backend.generate(active.tenant, job.session_id, active.request_id, prompt_ids, params,
                                     lambda ids, text: pump.put((ids, text)), active.cancel)

    async def decode(self, tenant: str, job: DecodeJob) -> AsyncGenerator[Any, None]:
        """Yield the request id, then ``(token_ids, text)`` chunks of ``job.chunk_tokens`` tokens, then the
        final ``Generation``. Admission errors raise before anything is yielded."""
        arrival = time.perf_counter()
        active = self.admission.admit(tenant, job.request_id)
        loop = asyncio.get_running_loop()
        release = functools.partial(self.admission.release, active)
        pump = ThreadPump(loop, on_end=release)  # freed before the answer goes out, so a client's next call fits
        future = pump.start(self.executor, self._run, pump, active, job)
        future.add_done_callback(lambda _: _call_soon(loop, release))  # a worker left running by a cancelled call
        chunker = Chunker(job.chunk_tokens)
        first: float | None = None
        last = arrival
        completion = 0
        finish = "error"
        generation: Generation | None = None
        try:
            yield job.request_id
            async for ids, text in pump.items():
                now = time.perf_counter()
                if ids:
                    if first is None:
                        first = now
                    else:
                        self.metrics.observe_emission_gap(now - last)
                    last = now
                    completion += len(ids)
                chunker.add(ids, text)
                for out in chunker.take():
                    yield out
            generation = pump.result
            if active.aborted and generation.finish_reason != "aborted":
                generation = dataclasses.replace(generation, finish_reason="aborted")
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
            self.metrics.observe_request(finish, prompt_tokens, completion,
                                         None if first is None else first - arrival,
                                         time.perf_counter() - arrival)

    async def append_trajectory(self, tenant: str, session_id: str, content: PromptInput, field: str) -> int:
        if self.admission.draining:
            raise errors.Unavailable("server is shutting down; retry on another replica")

        def run() -> int:
            if content.token_ids is not None:
                ids: Sequence[int] = content.token_ids
                check_token_ids(f"{field}.tokens.ids", ids, self.info.vocab_size)
            else:
                ids = self.backend.tokenize(content, add_generation_prompt=False)
            return self.backend.append_trajectory(tenant, session_id, ids)

        return await asyncio.get_running_loop().run_in_executor(self.executor, run)


def parse_reply(job: DecodeJob, text: str, generation: Generation) -> tuple[Generation, ParsedReply | None]:
    """The reply's tool calls when the request had tools (and ``tool_choice`` was not ``none``) and the
    output ended by itself; then the finish reason is ``tool_calls``."""
    if job.tool_format is None or generation.finish_reason not in ("stop", "eos"):
        return generation, None
    parsed = FORMATS[job.tool_format].parse(text)
    if parsed is None:
        return generation, None
    return dataclasses.replace(generation, finish_reason="tool_calls"), parsed


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


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nothing left to release
        pass
