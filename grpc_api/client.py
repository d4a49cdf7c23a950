"""Python clients of the Reprise service.

    from grpc_api.client import RepriseClient

    with RepriseClient("127.0.0.1:50051", api_key="rpk_...") as client:
        stream = client.generate_stream(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=64)
        for chunk in stream:                  # StreamChunk(token_ids, text), as tokens are committed
            print(chunk.text, end="", flush=True)
        print(stream.completion.finish_reason)  # "stop" | "length" | "eos" | "aborted"

``AsyncRepriseClient`` has the same calls as coroutines (``generate_stream`` is an async iterator);
``AdminClient`` wraps the admin plane for operators. Failures raise ``RepriseError`` with the gRPC
status code, the server's message and, for RESOURCE_EXHAUSTED, the server's suggested retry delay.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from grpc_api.v1 import admin_pb2, admin_pb2_grpc, common_pb2, decoding_pb2, decoding_pb2_grpc
from serving.records import ToolCall  # the one record of a tool call, on both sides of the wire

if TYPE_CHECKING:
    from typing_extensions import Self

FINISH_REASONS = {
    decoding_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    decoding_pb2.FINISH_REASON_STOP: "stop",
    decoding_pb2.FINISH_REASON_LENGTH: "length",
    decoding_pb2.FINISH_REASON_EOS: "eos",
    decoding_pb2.FINISH_REASON_ABORTED: "aborted",
    decoding_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
DEFAULT_TARGET = "127.0.0.1:50051"
MiB = 1024 * 1024


class RepriseError(Exception):
    """A failed call: ``code`` (grpc.StatusCode), ``message`` and, when the server sent one, ``retry_after_s``."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> RepriseError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return cls(code, details or "", _retry_after(exc))


def _retry_after(exc: Any) -> float | None:
    try:
        status = rpc_status.from_call(exc)
    except Exception:  # noqa: BLE001 - no status details, or not a call object
        return None
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


@dataclass(frozen=True, slots=True)
class StreamChunk:
    token_ids: list[int]
    text: str


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request. ``matched_stop`` is the stop string or stop token id that ended it, if any.
    With tools, ``tool_calls`` holds the reply's parsed calls (``finish_reason`` "tool_calls") and
    ``content`` the text before them."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    max_context_tokens: int
    eos_token_ids: list[int]
    vocab_size: int
    has_chat_template: bool
    server_version: str


def build_request(
    prompt: str | Sequence[int] | Sequence[Mapping[str, Any]] | None = None, *,
    tokens: Sequence[int] | None = None, text: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None, session_id: str = "", request_id: str | None = None,
    temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
    seed: int | None = None, repetition_penalty: float | None = None, max_new_tokens: int | None = None,
    min_new_tokens: int = 0,
    stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
    include_stop_str_in_output: bool = False, do_not_record: bool = False, speculation: bool = True,
    stream_chunk_tokens: int = 0, tools: Sequence[Mapping[str, Any]] = (), tool_choice: Any = None,
    response_format: Any = None,
) -> decoding_pb2.GenerateRequest:
    """A GenerateRequest. ``prompt`` may be text, token ids or chat messages (dicts with role/content);
    or give exactly one of ``tokens``, ``text``, ``messages``. ``request_id`` defaults to a fresh uuid.

    Messages, tools, ``tool_choice`` and ``response_format`` take OpenAI's shapes: an assistant message
    may carry ``tool_calls`` (``[{"id", "function": {"name", "arguments"}}]``), a tool message
    ``tool_call_id``; a tool is ``{"type": "function", "function": {"name", "description", "parameters"}}``
    (or the inner object); ``tool_choice`` is "auto", "none", "required", a tool's name or
    ``{"type": "function", "function": {"name"}}``; ``response_format`` is "json_object",
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``."""
    tokens, text, messages = _one_prompt(prompt, tokens, text, messages)
    for name, value, low in (("max_new_tokens", max_new_tokens, 1), ("min_new_tokens", min_new_tokens, 0),
                             ("top_k", top_k, 0), ("seed", seed, 0), ("stream_chunk_tokens", stream_chunk_tokens, 0)):
        _check_int(name, value, low)
    if isinstance(stop, str):
        raise TypeError(f"stop must be a list of strings, got the string {stop!r} (write stop=[{stop!r}])")
    for i, t in enumerate(stop_token_ids):
        _check_int(f"stop_token_ids[{i}]", t, 0)
    req = decoding_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex if request_id is None else request_id, session_id=session_id,
        do_not_record=do_not_record, stream_chunk_tokens=stream_chunk_tokens,
        speculation=decoding_pb2.SPECULATION_MODE_AUTO if speculation else decoding_pb2.SPECULATION_MODE_OFF,
    )
    _set_content(req, tokens, text, messages)
    s = req.sampling
    if temperature is not None:
        s.temperature = temperature
    if top_p is not None:
        s.top_p = top_p
    if top_k is not None:
        s.top_k = top_k
    if seed is not None:
        s.seed = seed
    if repetition_penalty is not None:
        s.repetition_penalty = repetition_penalty
    st = req.stopping
    if max_new_tokens is not None:
        st.max_new_tokens = max_new_tokens
    st.min_new_tokens = min_new_tokens
    st.stop.extend(stop)
    st.stop_token_ids.extend(stop_token_ids)
    st.ignore_eos = ignore_eos
    st.include_stop_str_in_output = include_stop_str_in_output
    _set_tools(req, tools, tool_choice, response_format)
    return req


def _one_prompt(prompt: Any, tokens: Any, text: Any, messages: Any) -> tuple[Any, Any, Any]:
    """(tokens, text, messages) with exactly one given: ``prompt`` sorted by its kind, or the one keyword."""
    if prompt is not None:
        if tokens is not None or text is not None or messages is not None:
            raise ValueError("give the prompt either positionally or as tokens=/text=/messages=, not both")
        if isinstance(prompt, str):
            text = prompt
        elif prompt and isinstance(prompt[0], Mapping):
            messages = prompt
        else:
            tokens = prompt
    if len([x for x in (tokens, text, messages) if x is not None]) != 1:
        raise ValueError("give exactly one of tokens, text or messages")
    return tokens, text, messages


def _set_tools(req: Any, tools: Sequence[Mapping[str, Any]], tool_choice: Any, response_format: Any) -> None:
    """The request's tools, ``tool_choice`` and ``response_format`` from OpenAI's shapes (``build_request``)."""
    for tool in tools:
        fn = tool.get("function", tool)
        req.tools.add(name=fn["name"], description=fn.get("description") or "",
                      parameters=json.dumps(fn.get("parameters") or {}))
    if isinstance(tool_choice, Mapping):
        req.tool_choice.function = tool_choice["function"]["name"]
    elif tool_choice in _TOOL_CHOICE:
        req.tool_choice.mode = _TOOL_CHOICE[tool_choice]
    elif isinstance(tool_choice, str):
        req.tool_choice.function = tool_choice
    elif tool_choice is not None:
        raise ValueError(f"tool_choice must be auto, none, required, a tool's name or a dict, got {tool_choice!r}")
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    if kind == "json_object":
        req.response_format.type = decoding_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT
    elif kind == "json_schema":
        req.response_format.type = decoding_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA
        req.response_format.json_schema = json.dumps(response_format["json_schema"]["schema"])
    elif kind not in (None, "text"):
        raise ValueError(f"response_format must be text, json_object or a json_schema dict, got {response_format!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    """None (unset) or an int >= ``low``; else an error naming the argument and what is expected."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {low}, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")


def _check_messages(messages: Any) -> None:
    """Chat messages: a list of dicts, each with a string 'role' and a string 'content'."""
    example = "[{'role': 'user', 'content': 'Hi'}]"
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts like {example}, got {type(messages).__name__} "
                        f"{str(messages)[:40]!r}")
    if not messages:
        raise ValueError(f"messages is empty: give at least one, like {example}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a 'role' (system, user, assistant or tool), got {role!r}")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):  # an assistant's tool calls may stand alone
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content': expected a string")
        if content is not None and not isinstance(content, str):
            raise TypeError(f"messages[{i}] (role {role!r}) has a {type(content).__name__} 'content': expected a string")


_TOOL_CHOICE = {"auto": decoding_pb2.TOOL_CHOICE_MODE_AUTO, "none": decoding_pb2.TOOL_CHOICE_MODE_NONE,
                "required": decoding_pb2.TOOL_CHOICE_MODE_REQUIRED}


def _set_content(msg: Any, tokens: Sequence[int] | None, text: str | None,
                 messages: Sequence[Mapping[str, Any]] | None) -> None:
    if tokens is not None:
        ids = list(tokens) if not isinstance(tokens, (str, bytes, Mapping)) and hasattr(tokens, "__iter__") else None
        if not ids:
            raise TypeError(f"tokens must be a non-empty list of token ids, got {str(tokens)[:40]!r}")
        for i, t in enumerate(ids):
            _check_int(f"tokens[{i}]", t, 0)
        msg.tokens.ids.extend(int(t) for t in ids)
    elif text is not None:
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        msg.text = text
    elif messages is not None:
        _check_messages(messages)
        for m in messages:
            added = msg.messages.messages.add(role=m["role"], content=m.get("content") or "",
                                              tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
            for call in m.get("tool_calls") or ():
                fn = call.get("function", call)
                args = fn.get("arguments", "{}")
                added.tool_calls.add(id=call.get("id") or "", name=fn["name"],
                                     arguments=args if isinstance(args, str) else json.dumps(args))


def completion_from(request_id: str, token_ids: list[int], text: str, complete: Any) -> Completion:
    which = complete.WhichOneof("matched_stop")
    matched = getattr(complete, which) if which else None
    return Completion(request_id, token_ids, text, FINISH_REASONS.get(complete.finish_reason, "unspecified"),
                      matched, complete.usage.prompt_tokens, complete.usage.completion_tokens,
                      [ToolCall(c.id, c.name, c.arguments) for c in complete.tool_calls], complete.content,
                      complete.usage.cached_tokens)


def channel_options(max_message_bytes: int = 16 * MiB) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _credentials(tls: bool, root_certificates: bytes | str | Path | None, client_cert: Any) -> Any:
    if not tls and root_certificates is None and client_cert is None:
        return None
    root = Path(root_certificates).read_bytes() if isinstance(root_certificates, (str, Path)) else root_certificates
    key = cert = None
    if client_cert is not None:
        cert_path, key_path = client_cert
        cert, key = Path(cert_path).read_bytes(), Path(key_path).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)


@contextlib.contextmanager
def _rpc_errors() -> Iterator[None]:
    """``grpc.RpcError`` raised inside the block becomes ``RepriseError``."""
    try:
        yield
    except grpc.RpcError as exc:
        raise RepriseError.from_rpc_error(exc) from None


class _Client:
    """What every client shares: one HTTP/2 channel (TLS when asked: ``root_certificates`` and, for
    mutual TLS, ``client_cert`` as (certificate file, key file)), the service stub, the bearer key sent
    with every call, and the default ``timeout`` in seconds."""

    _STUB: Any  # the generated stub class of the service
    _AIO = False  # grpc.aio channel (AsyncRepriseClient)

    def __init__(self, target: str = DEFAULT_TARGET, key: str | None = None, *, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, client_cert: tuple[str, str] | None = None,
                 timeout: float | None = None, max_message_bytes: int = 16 * MiB) -> None:
        creds = _credentials(tls, root_certificates, client_cert)
        opts = channel_options(max_message_bytes)
        channels: Any = grpc.aio if self._AIO else grpc
        self._channel = channels.secure_channel(target, creds, opts) if creds else channels.insecure_channel(target, opts)
        self._stub = self._STUB(self._channel)
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.timeout = timeout


class _SyncClient(_Client):
    """A blocking client: a context manager; ``close`` closes the channel."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Callable[..., Any], request: Any, timeout: float | None = None) -> Any:
        """One unary call (``timeout`` or the client's), failures as ``RepriseError``."""
        with _rpc_errors():
            return method(request, metadata=self._metadata, timeout=timeout or self.timeout)


class GenerationStream:
    """Iterator of ``StreamChunk``; after it ends, ``completion`` holds the whole result."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.request_id = ""
        self.completion: Completion | None = None
        self._ids: list[int] = []
        self._texts: list[str] = []

    def __iter__(self) -> Iterator[StreamChunk]:
        with _rpc_errors():
            for message in self._call:
                self.request_id = message.request_id
                if message.WhichOneof("kind") == "chunk":
                    chunk = StreamChunk(list(message.chunk.token_ids), message.chunk.text)
                    self._ids.extend(chunk.token_ids)
                    self._texts.append(chunk.text)
                    yield chunk
                else:
                    self.completion = completion_from(self.request_id, self._ids, "".join(self._texts),
                                                      message.complete)

    def cancel(self) -> None:
        """Stop the request (the server frees its resources at once)."""
        self._call.cancel()


class RepriseClient(_SyncClient):
    """Synchronous data-plane client; one HTTP/2 channel, safe to share between threads. Options (``tls``,
    ``root_certificates``, ``client_cert``, ``timeout``, ``max_message_bytes``) as ``_Client``."""

    _STUB = decoding_pb2_grpc.DecodingServiceStub

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None, **options: Any) -> None:
        super().__init__(target, api_key, **options)

    def generate_stream(self, prompt: Any = None, *, timeout: float | None = None, **kwargs: Any) -> GenerationStream:
        """Stream a completion; keyword arguments as ``build_request``."""
        request = build_request(prompt, **kwargs)
        call = self._stub.GenerateStream(request, metadata=self._metadata, timeout=timeout or self.timeout)
        return GenerationStream(call)

    def generate(self, prompt: Any = None, *, timeout: float | None = None, **kwargs: Any) -> Completion:
        """The whole completion in one message; keyword arguments as ``build_request``."""
        r = self._call(self._stub.Generate, build_request(prompt, **kwargs), timeout)
        return completion_from(r.request_id, list(r.token_ids), r.text, r.complete)

    def abort(self, request_id: str) -> None:
        self._call(self._stub.Abort, decoding_pb2.AbortRequest(request_id=request_id))

    def model_info(self) -> ModelInfo:
        r = self._call(self._stub.GetModelInfo, decoding_pb2.GetModelInfoRequest())
        return ModelInfo(r.model_name, r.max_context_tokens, list(r.eos_token_ids), r.vocab_size,
                         r.has_chat_template, r.server_version)

    def append_trajectory(self, session_id: str = "", *, tokens: Sequence[int] | None = None, text: str | None = None,
                          messages: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Add a turn produced elsewhere (e.g. a tool's output) to this tenant's history."""
        if sum(x is not None for x in (tokens, text, messages)) != 1:
            raise ValueError("give exactly one of tokens, text or messages")
        req = decoding_pb2.AppendTrajectoryRequest(session_id=session_id)
        _set_content(req, tokens, text, messages)
        return self._call(self._stub.AppendTrajectory, req).num_tokens


class AsyncRepriseClient(_Client):
    """asyncio data-plane client (``grpc.aio``); options as ``RepriseClient``."""

    _STUB = decoding_pb2_grpc.DecodingServiceStub
    _AIO = True

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None, **options: Any) -> None:
        super().__init__(target, api_key, **options)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate_stream(self, prompt: Any = None, *, timeout: float | None = None,
                              **kwargs: Any) -> AsyncIterator[StreamChunk | Completion]:
        """Yield ``StreamChunk``s, then one ``Completion`` (with the whole text)."""
        call = self._stub.GenerateStream(build_request(prompt, **kwargs), metadata=self._metadata,
                                         timeout=timeout or self.timeout)
        ids: list[int] = []
        texts: list[str] = []
        try:
            with _rpc_errors():
                async for message in call:
                    if message.WhichOneof("kind") == "chunk":
                        chunk = StreamChunk(list(message.chunk.token_ids), message.chunk.text)
                        ids.extend(chunk.token_ids)
                        texts.append(chunk.text)
                        yield chunk
                    else:
                        yield completion_from(message.request_id, ids, "".join(texts), message.complete)
        finally:
            call.cancel()  # no-op once finished; frees the server's request when the caller stops early

    async def generate(self, prompt: Any = None, *, timeout: float | None = None, **kwargs: Any) -> Completion:
        with _rpc_errors():
            r = await self._stub.Generate(build_request(prompt, **kwargs), metadata=self._metadata,
                                          timeout=timeout or self.timeout)
        return completion_from(r.request_id, list(r.token_ids), r.text, r.complete)

    async def abort(self, request_id: str) -> None:
        with _rpc_errors():
            await self._stub.Abort(decoding_pb2.AbortRequest(request_id=request_id), metadata=self._metadata)

    async def model_info(self) -> ModelInfo:
        with _rpc_errors():
            r = await self._stub.GetModelInfo(decoding_pb2.GetModelInfoRequest(), metadata=self._metadata)
        return ModelInfo(r.model_name, r.max_context_tokens, list(r.eos_token_ids), r.vocab_size,
                         r.has_chat_template, r.server_version)


# ---- admin plane -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    phase: str
    done: int
    total: int
    unit: str


ProgressFn = Callable[[Progress], None]
KEY_KINDS = {"api_key": admin_pb2.KEY_KIND_API_KEY, "data_key": admin_pb2.KEY_KIND_DATA_KEY,
             "master_key": admin_pb2.KEY_KIND_MASTER_KEY}


@dataclass(frozen=True, slots=True)
class TenantRecord:
    tenant_id: str
    name: str
    created_unix_ms: int


@dataclass(frozen=True, slots=True)
class IndexStats:
    tenant_id: str
    index_tokens: int
    index_sequences: int
    index_memory_bytes: int
    corpus_tokens: int
    num_requests: int
    num_steps: int
    num_drafted_steps: int
    hit_rate: float
    tau: float
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_by_position: list[float] = field(default_factory=list)
    drafter_steps: dict[str, int] = field(default_factory=dict)
    counting_since_unix_ms: int = 0  # the figures from num_requests on count since (the server's start)
    prefix_cache_bytes: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    index_resident: bool = True
    quarantined_records: int = 0
    # What Reprise saved (docs/service.md, "What Reprise saves"): seconds spent against the estimate
    # without drafts and prefix cache; speedup and tokens_per_second are None before any step.
    speedup: float | None = None
    seconds_saved: float = 0.0
    seconds_saved_drafts: float = 0.0
    seconds_saved_cache: float = 0.0
    seconds: float = 0.0
    plain_seconds: float = 0.0
    tokens_per_second: float | None = None
    # Measured on held-out requests (server.holdout_share): None before two held-out and two drafted ones.
    holdout_requests: int = 0
    drafted_requests: int = 0
    measured_speedup: float | None = None
    measured_speedup_low: float | None = None
    measured_speedup_high: float | None = None

    @classmethod
    def from_message(cls, m: Any) -> IndexStats:
        spent = m.decode_seconds + m.prefill_seconds
        plain = m.plain_decode_seconds + m.plain_prefill_seconds
        return cls(m.tenant_id, m.index_tokens, m.index_sequences, m.index_memory_bytes, m.corpus_tokens,
                   m.num_requests, m.num_steps, m.num_drafted_steps, m.hit_rate, m.tau, m.num_draft_tokens,
                   m.num_accepted_tokens, list(m.acceptance_by_position), dict(m.drafter_steps),
                   m.counting_since_unix_ms,
                   m.prefix_cache_bytes, m.prompt_tokens, m.cached_prompt_tokens, m.prefix_cache_hit_rate,
                   m.index_resident, m.quarantined_records,
                   m.speedup if spent > 0 else None, plain - spent, m.seconds_saved_drafts, m.seconds_saved_cache,
                   spent, plain, m.tokens_per_second if spent > 0 else None, m.holdout_requests, m.drafted_requests,
                   *((m.measured_speedup, m.measured_speedup_low, m.measured_speedup_high) if m.measured_speedup
                     else (None, None, None)))


@dataclass(frozen=True, slots=True)
class IndexMemory:
    """All tenants' in-memory indexes against the server's memory budget (0: none)."""

    budget_bytes: int
    resident_bytes: int
    resident_tenants: int
    num_evictions: int
    quarantined_records: int


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A stored record that failed authentication or parsing."""

    kind: str
    record_id: str
    cursor: str
    reason: str


@dataclass(frozen=True, slots=True)
class HistoryCheck:
    """VerifyHistory's or RepairHistory's result (``bad``: dropped into quarantine when ``repaired``)."""

    tenant_id: str
    num_records: int
    bad: list[BadRecord]
    repaired: bool
    num_quarantined: int


@dataclass(frozen=True, slots=True)
class ExportSummary:
    num_bytes: int
    num_trajectories: int
    skipped: list[BadRecord]


def _bad(m: Any) -> BadRecord:
    return BadRecord(m.kind, m.record_id, m.cursor, m.reason)


def _progress(p: common_pb2.Progress) -> Progress:
    return Progress(p.phase, p.done, p.total, p.unit)


class AdminClient(_SyncClient):
    """Synchronous admin-plane client (needs an admin key); options as ``RepriseClient``."""

    _STUB = admin_pb2_grpc.AdminServiceStub

    def __init__(self, target: str = DEFAULT_TARGET, admin_key: str | None = None, **options: Any) -> None:
        super().__init__(target, admin_key, **options)

    def _stream(self, method: Callable[..., Any], request: Any, on_progress: ProgressFn | None) -> Iterator[Any]:
        """Yield the non-progress messages' payloads; progress goes to ``on_progress``."""
        with _rpc_errors():
            for message in method(request, metadata=self._metadata, timeout=self.timeout):
                kind = message.WhichOneof("kind")
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(_progress(message.progress))
                else:
                    yield getattr(message, kind)

    def create_tenant(self, name: str) -> tuple[TenantRecord, str]:
        """The new tenant and its API key (shown once)."""
        r = self._call(self._stub.CreateTenant, admin_pb2.CreateTenantRequest(name=name))
        return TenantRecord(r.tenant.tenant_id, r.tenant.name, r.tenant.created_unix_ms), r.api_key

    def list_tenants(self) -> list[TenantRecord]:
        r = self._call(self._stub.ListTenants, admin_pb2.ListTenantsRequest())
        return [TenantRecord(t.tenant_id, t.name, t.created_unix_ms) for t in r.tenants]

    def delete_tenant(self, tenant_id: str, confirm: str, dry_run: bool = False) -> int:
        """Crypto-shred a tenant (``confirm`` must equal ``tenant_id``); the number of records deleted."""
        r = self._call(self._stub.DeleteTenant,
                        admin_pb2.DeleteTenantRequest(tenant_id=tenant_id, confirm=confirm, dry_run=dry_run))
        return r.num_records

    def rotate_keys(self, kind: str, tenant_id: str = "", on_progress: ProgressFn | None = None) -> Any:
        """``kind``: api_key, data_key or master_key. Returns RotateKeysResult (api_key set for api_key)."""
        if kind not in KEY_KINDS:
            raise ValueError(f"kind must be one of {', '.join(KEY_KINDS)}, got {kind!r}")
        request = admin_pb2.RotateKeysRequest(kind=KEY_KINDS[kind], tenant_id=tenant_id)
        results = list(self._stream(self._stub.RotateKeys, request, on_progress))
        return results[-1]

    def index_stats(self, tenant_id: str | None = None) -> list[IndexStats]:
        return self.index_stats_and_memory(tenant_id)[0]

    def index_stats_and_memory(self, tenant_id: str | None = None) -> tuple[list[IndexStats], IndexMemory]:
        """Per-tenant figures and the service-wide index memory figures."""
        r = self._call(self._stub.GetIndexStats, admin_pb2.GetIndexStatsRequest(tenant_id=tenant_id or ""))
        m = r.memory
        return [IndexStats.from_message(t) for t in r.tenants], IndexMemory(
            m.budget_bytes, m.resident_bytes, m.resident_tenants, m.num_evictions, m.quarantined_records)

    def verify_history(self, tenant_id: str, on_progress: ProgressFn | None = None) -> HistoryCheck:
        """Name the tenant's stored records that fail authentication or parsing (writes nothing)."""
        return self._history_check(self._stub.VerifyHistory, tenant_id, on_progress)

    def repair_history(self, tenant_id: str, on_progress: ProgressFn | None = None) -> HistoryCheck:
        """Move the tenant's bad records into its quarantine and rebuild its index; what was dropped."""
        return self._history_check(self._stub.RepairHistory, tenant_id, on_progress)

    def _history_check(self, method: Callable[..., Any], tenant_id: str, on_progress: ProgressFn | None) -> HistoryCheck:
        r = list(self._stream(method, admin_pb2.HistoryCheckRequest(tenant_id=tenant_id), on_progress))[-1]
        return HistoryCheck(r.tenant_id, r.num_records, [_bad(b) for b in r.bad], r.repaired, r.num_quarantined)

    def build_index(self, tenant_id: str, on_progress: ProgressFn | None = None) -> tuple[IndexStats, float]:
        """Rebuild a tenant's index from its history; its stats and the seconds it took."""
        r = list(self._stream(self._stub.BuildIndex, admin_pb2.IndexOperationRequest(tenant_id=tenant_id),
                              on_progress))[-1]
        return IndexStats.from_message(r.stats), r.seconds

    def compact_index(self, tenant_id: str, on_progress: ProgressFn | None = None) -> tuple[IndexStats, float]:
        r = list(self._stream(self._stub.CompactIndex, admin_pb2.IndexOperationRequest(tenant_id=tenant_id),
                              on_progress))[-1]
        return IndexStats.from_message(r.stats), r.seconds

    def import_corpus(self, tenant_id: str, documents: Iterable[str | Sequence[int]], replace: bool = False,
                      on_document: Callable[[int], None] | None = None) -> Any:
        """Upload documents (text, or token ids); ``on_document(n)`` after each one is sent."""

        def requests() -> Iterator[admin_pb2.ImportCorpusRequest]:
            yield admin_pb2.ImportCorpusRequest(header=admin_pb2.ImportCorpusHeader(tenant_id=tenant_id,
                                                                                    replace=replace))
            for n, doc in enumerate(documents, 1):
                message = admin_pb2.ImportCorpusRequest()
                if isinstance(doc, str):
                    message.document.text = doc
                else:
                    message.document.tokens.ids.extend(int(t) for t in doc)
                yield message
                if on_document is not None:
                    on_document(n)

        return self._call(self._stub.ImportCorpus, requests())

    def export_history(self, tenant_id: str, out: BinaryIO, password: str,
                       on_progress: ProgressFn | None = None) -> ExportSummary:
        """Write the tenant's history, sealed with ``password``, to ``out``; the bytes written and the
        records left out (they failed authentication or parsing)."""
        written, skipped, num = 0, [], 0
        request = admin_pb2.ExportHistoryRequest(tenant_id=tenant_id, password=password)
        for item in self._stream(self._stub.ExportHistory, request, on_progress):
            if isinstance(item, bytes):
                out.write(item)
                written += len(item)
            else:
                skipped, num = [_bad(b) for b in item.skipped], item.num_trajectories
        return ExportSummary(written, num, skipped)

    def import_history(self, source: BinaryIO, password: str, *, new_tenant_name: str = "",
                       into_tenant_id: str = "", on_bytes: Callable[[int], None] | None = None,
                       piece: int = 1 << 20) -> Any:
        """Upload an export file into a new tenant (its API key in the reply) or an existing one."""

        def requests() -> Iterator[admin_pb2.ImportHistoryRequest]:
            yield admin_pb2.ImportHistoryRequest(header=admin_pb2.ImportHistoryHeader(
                password=password, new_tenant_name=new_tenant_name, into_tenant_id=into_tenant_id))
            sent = 0
            while data := source.read(piece):
                yield admin_pb2.ImportHistoryRequest(data=data)
                sent += len(data)
                if on_bytes is not None:
                    on_bytes(sent)

        return self._call(self._stub.ImportHistory, requests())
