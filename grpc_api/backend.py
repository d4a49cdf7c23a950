"""What the gRPC servicers need from the rest of Reprise, as plain records and protocols.

``grpc_api`` imports only grpc and protobuf (docs/architecture.md, "Layers"); the application (``reprise.server.service``)
implements these protocols over the decode pipeline and the privacy store. Methods marked *blocking*
are called from worker threads, never on the event loop; they may raise ``grpc_api.errors.ServiceError``
subclasses or ``ValueError`` for bad input.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, Protocol, get_args

# ---- principals ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant (data plane) or an admin (admin plane). ``id`` is the tenant id or the
    admin key id; it never comes from a request field."""

    kind: Literal["tenant", "admin"]
    id: str


class Authenticator(Protocol):
    def authenticate(self, key: str) -> Principal | None:
        """The principal a bearer key belongs to, or None if it is unknown or revoked. Called on the
        event loop for every RPC, so it must be fast (an in-memory lookup of a keyed hash)."""
        ...


# ---- data plane ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of one of the request's tools, as the model made it: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: ``parameters`` is its JSON Schema as text (``{}`` when it takes none)."""

    name: str
    description: str = ""
    parameters: str = "{}"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message. An assistant message may carry ``tool_calls`` (its ``content`` may then be empty);
    a ``tool`` message answers the call ``tool_call_id`` (``name``: the tool's name, when known)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of ``token_ids``, ``text``, ``messages`` is set. ``tools`` are rendered with the
    messages (through the model's chat template, or the tool-call format's own prompt)."""

    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tools: tuple[Tool, ...] = ()


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """A grammar the output must follow: the literal ``prefix``, then a JSON value valid under ``schema``
    (JSON Schema text), then the literal ``suffix``, then end of sequence. Decoding masks every token
    the grammar forbids (reprise/engine/grammar.py), so a finished output always parses. ``name`` says
    what asked for it (``json_object``, ``json_schema``, ``tool_calls``)."""

    schema: str
    prefix: str = ""
    suffix: str = ""
    name: str = "json_schema"


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """Validated sampling and stopping parameters of one request (defaults filled in)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    speculate: bool = True
    record: bool = True
    constraint: OutputConstraint | None = None


FinishReason = Literal["stop", "eos", "length", "aborted", "error", "tool_calls"]
"""Why a request ended, in every layer (engine, backends, both APIs): ``stop`` a stop string or stop token
id, ``eos`` the model's end-of-sequence token, ``length`` max_new_tokens or the context, ``aborted``
cancelled (client gone, deadline, Abort), ``error`` the engine failed it (a backend raises instead of
returning it), ``tool_calls`` the reply parsed as tool calls (set by the fronts after parsing an output
that ended with ``stop`` or ``eos``; never by an engine)."""
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)


@dataclass(frozen=True, slots=True)
class Generation:
    """The end of one request. ``matched_stop`` is the stop string or stop token id that ended it;
    ``cached_tokens``: prompt tokens whose KV the engine reused from the tenant's earlier requests."""

    finish_reason: FinishReason
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    max_context_tokens: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    has_chat_template: bool
    tool_call_format: str = "hermes"
    """How the model writes tool calls (a name in ``grpc_api.tool_calls.FORMATS``)."""


TokenCallback = Callable[[Sequence[int], str], None]
"""Called by ``DecodeBackend.generate`` as tokens are committed: the new token ids and the text they add."""


class DecodeBackend(Protocol):
    def model_info(self) -> ModelInfo:
        """The served model (cheap; called on the event loop)."""
        ...

    def tokenize(self, prompt: PromptInput, add_generation_prompt: bool = True) -> list[int]:
        """*Blocking.* Token ids of a text or chat prompt (chat template applied for messages)."""
        ...

    def generate(self, tenant: str, session_id: str, request_id: str, prompt_ids: Sequence[int],
                 params: GenerateParams, on_tokens: TokenCallback, cancel: threading.Event) -> Generation:
        """*Blocking.* Decode, calling ``on_tokens`` as tokens commit; return promptly (finish reason
        "aborted") once ``cancel`` is set, with the request's model resources released."""
        ...

    def append_trajectory(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> int:
        """*Blocking.* Add a turn to the tenant's history; return the number of tokens added."""
        ...

    def close(self) -> None:
        """*Blocking.* Flush history and release the model (graceful shutdown)."""
        ...


# ---- admin plane -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    phase: str
    done: int
    total: int = 0
    unit: str = ""


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True, slots=True)
class TenantInfo:
    tenant_id: str
    name: str
    created_unix_ms: int = 0


@dataclass(frozen=True, slots=True)
class TenantStats:
    """Per-tenant figures for the admin plane and the dashboard (never for data-plane callers)."""

    tenant_id: str
    index_tokens: int = 0
    index_sequences: int = 0
    index_memory_bytes: int = 0
    corpus_tokens: int = 0
    num_requests: int = 0
    num_steps: int = 0
    num_drafted_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_by_position: tuple[float, ...] = ()
    drafter_steps: dict[str, int] = field(default_factory=dict)
    counting_since_unix_ms: int = 0  # the figures from num_requests on count since then (process start)
    prefix_cache_bytes: int = 0  # the tenant's KV held in the engine's prefix cache
    prompt_tokens: int = 0  # prompt tokens looked up in the prefix cache
    cached_prompt_tokens: int = 0  # of those, found (their KV reused instead of prefilled)

    @property
    def hit_rate(self) -> float:
        return self.num_drafted_steps / self.num_steps if self.num_steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the tenant's prompt tokens whose KV came from the prefix cache."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tau(self) -> float:
        """Tokens committed per step: accepted draft tokens plus the bonus token."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0


@dataclass(frozen=True, slots=True)
class KeyRotation:
    api_key: str = ""
    key_version: int = 0
    num_records: int = 0


@dataclass(frozen=True, slots=True)
class CorpusDocument:
    """One document of a corpus upload: text, or token ids."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class CorpusImport:
    num_documents: int
    num_tokens: int
    corpus_tokens: int


@dataclass(frozen=True, slots=True)
class HistoryImport:
    tenant: TenantInfo
    created: bool
    num_trajectories: int
    num_blobs: int
    api_key: str = ""


class AdminBackend(Protocol):
    """Every method is *blocking*. Unknown tenants raise ``errors.NotFound``."""

    def create_tenant(self, name: str) -> tuple[TenantInfo, str]:
        """The new tenant and its first API key (returned once)."""
        ...

    def list_tenants(self) -> list[TenantInfo]: ...

    def delete_tenant(self, tenant_id: str, dry_run: bool = False) -> int:
        """Crypto-shred the tenant; return the number of records deleted (or that would be)."""
        ...

    def rotate_keys(self, kind: Literal["api_key", "data_key", "master_key"], tenant_id: str,
                    progress: ProgressCallback) -> KeyRotation: ...

    def index_stats(self, tenant_id: str | None) -> list[TenantStats]:
        """One tenant's figures, or every tenant's when ``tenant_id`` is None."""
        ...

    def build_index(self, tenant_id: str, progress: ProgressCallback) -> TenantStats: ...

    def compact_index(self, tenant_id: str, progress: ProgressCallback) -> TenantStats: ...

    def import_corpus(self, tenant_id: str, documents: Iterable[CorpusDocument], replace: bool,
                      progress: ProgressCallback) -> CorpusImport:
        """``documents`` is consumed as the upload arrives (a blocking iterator)."""
        ...

    def export_history(self, tenant_id: str, password: str, write: Callable[[bytes], None],
                       progress: ProgressCallback) -> int:
        """Write the tenant's export file, sealed with ``password``, through ``write``; return its size."""
        ...

    def import_history(self, source: BinaryIO, password: str, new_tenant_name: str, into_tenant_id: str,
                       progress: ProgressCallback) -> HistoryImport:
        """Read an export file (a seekable file) into a new tenant or append it to ``into_tenant_id``."""
        ...
