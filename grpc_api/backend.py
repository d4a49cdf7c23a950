"""What the gRPC servicers need from the rest of Reprise, as plain records and protocols.

``grpc_api`` imports only grpc and protobuf (../shared/DESIGN.md); the application (``reprise.server.service``)
implements these protocols over the decode pipeline and the privacy store. Methods marked *blocking*
are called from worker threads, never on the event loop; they may raise ``grpc_api.errors.ServiceError``
subclasses or ``ValueError`` for bad input.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, Protocol

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
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of the three is set."""

    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None


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


FinishReason = Literal["stop", "length", "eos", "aborted"]


@dataclass(frozen=True, slots=True)
class Generation:
    """The end of one request. ``matched_stop`` is the stop string or stop token id that ended it."""

    finish_reason: FinishReason
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    max_context_tokens: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    has_chat_template: bool


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

    @property
    def hit_rate(self) -> float:
        return self.num_drafted_steps / self.num_steps if self.num_steps else 0.0

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
