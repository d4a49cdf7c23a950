"""The admin plane's records and what it needs from the rest of Reprise (``AdminBackend``), protocol-
neutral: the gRPC admin plane (``grpc_api.admin``) and the dashboard (``reprise.server.dashboard``)
both read these. Per-tenant figures are for admins only, never for data-plane callers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, Protocol

from serving.holdout import MeasuredSpeedup
from serving.savings import Savings


@dataclass(frozen=True, slots=True)
class Progress:
    """Progress of a long admin operation (streamed to the caller)."""

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
    index_resident: bool = True  # False: not in memory (evicted by the budget, or not used yet); loads on use
    quarantined_records: int = 0  # stored records skipped at the last load: they failed authentication or parsing
    savings: Savings = field(default_factory=Savings)  # seconds spent against the estimate without Reprise
    measured: MeasuredSpeedup = field(default_factory=MeasuredSpeedup)  # on held-out requests (server.holdout_share)

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
class IndexMemory:
    """Service-wide index figures: the memory budget (0: none), what the in-memory indexes hold, how
    many tenants' indexes were evicted to keep to it, and records quarantined at load over all tenants."""

    budget_bytes: int = 0
    resident_bytes: int = 0
    resident_tenants: int = 0
    num_evictions: int = 0
    quarantined_records: int = 0


@dataclass(frozen=True, slots=True)
class BadRecordInfo:
    """A stored record that failed authentication or parsing: ``kind`` (trajectory, snapshot, corpus,
    hidden, response), its record id or blob tag (hex), the trajectory's cursor, and why."""

    kind: str
    record_id: str
    cursor: str
    reason: str


@dataclass(frozen=True, slots=True)
class HistoryCheck:
    """A tenant's history verified (``repaired``: its bad records were moved to quarantine and dropped
    from the history). ``num_quarantined``: records in its quarantine afterwards."""

    tenant_id: str
    num_records: int
    bad: tuple[BadRecordInfo, ...]
    repaired: bool
    num_quarantined: int


@dataclass(frozen=True, slots=True)
class HistoryExport:
    """An export written: its size, and the records left out because they failed their check."""

    num_bytes: int
    num_trajectories: int = 0
    skipped: tuple[BadRecordInfo, ...] = ()


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
    """Every method is *blocking* (the admin plane runs it on a worker thread). Unknown tenants raise
    ``serving.errors.NotFound``."""

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

    def index_memory(self) -> IndexMemory:
        """The service-wide index figures (budget, resident memory, evictions, quarantine)."""
        ...

    def verify_history(self, tenant_id: str, progress: ProgressCallback) -> HistoryCheck:
        """Open and parse every stored record of the tenant; name those that fail. Writes nothing."""
        ...

    def repair_history(self, tenant_id: str, progress: ProgressCallback) -> HistoryCheck:
        """``verify_history``, then set the bad records aside (quarantine) and rebuild the tenant's index."""
        ...

    def build_index(self, tenant_id: str, progress: ProgressCallback) -> TenantStats: ...

    def compact_index(self, tenant_id: str, progress: ProgressCallback) -> TenantStats: ...

    def import_corpus(self, tenant_id: str, documents: Iterable[CorpusDocument], replace: bool,
                      progress: ProgressCallback) -> CorpusImport:
        """``documents`` is consumed as the upload arrives (a blocking iterator)."""
        ...

    def export_history(self, tenant_id: str, password: str, write: Callable[[bytes], None],
                       progress: ProgressCallback) -> HistoryExport:
        """Write the tenant's export file, sealed with ``password``, through ``write``; records that fail
        their check are left out and listed."""
        ...

    def import_history(self, source: BinaryIO, password: str, new_tenant_name: str, into_tenant_id: str,
                       progress: ProgressCallback) -> HistoryImport:
        """Read an export file (a seekable file) into a new tenant or append it to ``into_tenant_id``."""
        ...
