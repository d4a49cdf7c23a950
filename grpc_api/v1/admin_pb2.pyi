from grpc_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KeyKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_KIND_UNSPECIFIED: _ClassVar[KeyKind]
    KEY_KIND_API_KEY: _ClassVar[KeyKind]
    KEY_KIND_DATA_KEY: _ClassVar[KeyKind]
    KEY_KIND_MASTER_KEY: _ClassVar[KeyKind]
KEY_KIND_UNSPECIFIED: KeyKind
KEY_KIND_API_KEY: KeyKind
KEY_KIND_DATA_KEY: KeyKind
KEY_KIND_MASTER_KEY: KeyKind

class Tenant(_message.Message):
    __slots__ = ("tenant_id", "name", "created_unix_ms")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    name: str
    created_unix_ms: int
    def __init__(self, tenant_id: _Optional[str] = ..., name: _Optional[str] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CreateTenantResponse(_message.Message):
    __slots__ = ("tenant", "api_key")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    api_key: str
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., api_key: _Optional[str] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class DeleteTenantRequest(_message.Message):
    __slots__ = ("tenant_id", "confirm", "dry_run")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    confirm: str
    dry_run: bool
    def __init__(self, tenant_id: _Optional[str] = ..., confirm: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class DeleteTenantResponse(_message.Message):
    __slots__ = ("deleted", "num_records")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    num_records: int
    def __init__(self, deleted: _Optional[bool] = ..., num_records: _Optional[int] = ...) -> None: ...

class RotateKeysRequest(_message.Message):
    __slots__ = ("kind", "tenant_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    kind: KeyKind
    tenant_id: str
    def __init__(self, kind: _Optional[_Union[KeyKind, str]] = ..., tenant_id: _Optional[str] = ...) -> None: ...

class RotateKeysResponse(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    result: RotateKeysResult
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., result: _Optional[_Union[RotateKeysResult, _Mapping]] = ...) -> None: ...

class RotateKeysResult(_message.Message):
    __slots__ = ("api_key", "key_version", "num_records")
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    key_version: int
    num_records: int
    def __init__(self, api_key: _Optional[str] = ..., key_version: _Optional[int] = ..., num_records: _Optional[int] = ...) -> None: ...

class GetIndexStatsRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class GetIndexStatsResponse(_message.Message):
    __slots__ = ("tenants", "memory")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantIndexStats]
    memory: IndexMemory
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantIndexStats, _Mapping]]] = ..., memory: _Optional[_Union[IndexMemory, _Mapping]] = ...) -> None: ...

class IndexMemory(_message.Message):
    __slots__ = ("budget_bytes", "resident_bytes", "resident_tenants", "num_evictions", "quarantined_records")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TENANTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    resident_bytes: int
    resident_tenants: int
    num_evictions: int
    quarantined_records: int
    def __init__(self, budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., resident_tenants: _Optional[int] = ..., num_evictions: _Optional[int] = ..., quarantined_records: _Optional[int] = ...) -> None: ...

class TenantIndexStats(_message.Message):
    __slots__ = ("tenant_id", "index_tokens", "index_sequences", "index_memory_bytes", "corpus_tokens", "num_requests", "num_steps", "num_drafted_steps", "hit_rate", "tau", "num_draft_tokens", "num_accepted_tokens", "acceptance_by_position", "drafter_steps", "counting_since_unix_ms", "prefix_cache_bytes", "prompt_tokens", "cached_prompt_tokens", "prefix_cache_hit_rate", "index_resident", "quarantined_records", "decode_seconds", "plain_decode_seconds", "prefill_seconds", "plain_prefill_seconds", "committed_tokens", "speedup", "seconds_saved_drafts", "seconds_saved_cache", "tokens_per_second", "holdout_requests", "drafted_requests", "measured_speedup", "measured_speedup_low", "measured_speedup_high")
    class DrafterStepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    INDEX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORPUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    COUNTING_SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    INDEX_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SAVED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SAVED_CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    HOLDOUT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SPEEDUP_LOW_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SPEEDUP_HIGH_FIELD_NUMBER: _ClassVar[int]
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
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    drafter_steps: _containers.ScalarMap[str, int]
    counting_since_unix_ms: int
    prefix_cache_bytes: int
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_cache_hit_rate: float
    index_resident: bool
    quarantined_records: int
    decode_seconds: float
    plain_decode_seconds: float
    prefill_seconds: float
    plain_prefill_seconds: float
    committed_tokens: int
    speedup: float
    seconds_saved_drafts: float
    seconds_saved_cache: float
    tokens_per_second: float
    holdout_requests: int
    drafted_requests: int
    measured_speedup: float
    measured_speedup_low: float
    measured_speedup_high: float
    def __init__(self, tenant_id: _Optional[str] = ..., index_tokens: _Optional[int] = ..., index_sequences: _Optional[int] = ..., index_memory_bytes: _Optional[int] = ..., corpus_tokens: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_drafted_steps: _Optional[int] = ..., hit_rate: _Optional[float] = ..., tau: _Optional[float] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., drafter_steps: _Optional[_Mapping[str, int]] = ..., counting_since_unix_ms: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., index_resident: _Optional[bool] = ..., quarantined_records: _Optional[int] = ..., decode_seconds: _Optional[float] = ..., plain_decode_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., plain_prefill_seconds: _Optional[float] = ..., committed_tokens: _Optional[int] = ..., speedup: _Optional[float] = ..., seconds_saved_drafts: _Optional[float] = ..., seconds_saved_cache: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., holdout_requests: _Optional[int] = ..., drafted_requests: _Optional[int] = ..., measured_speedup: _Optional[float] = ..., measured_speedup_low: _Optional[float] = ..., measured_speedup_high: _Optional[float] = ...) -> None: ...

class IndexOperationRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class IndexOperationResponse(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    result: IndexOperationResult
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., result: _Optional[_Union[IndexOperationResult, _Mapping]] = ...) -> None: ...

class IndexOperationResult(_message.Message):
    __slots__ = ("stats", "seconds")
    STATS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    stats: TenantIndexStats
    seconds: float
    def __init__(self, stats: _Optional[_Union[TenantIndexStats, _Mapping]] = ..., seconds: _Optional[float] = ...) -> None: ...

class ImportCorpusHeader(_message.Message):
    __slots__ = ("tenant_id", "replace")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    replace: bool
    def __init__(self, tenant_id: _Optional[str] = ..., replace: _Optional[bool] = ...) -> None: ...

class CorpusDocument(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _common_pb2.TokenIds
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...

class ImportCorpusRequest(_message.Message):
    __slots__ = ("header", "document")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    header: ImportCorpusHeader
    document: CorpusDocument
    def __init__(self, header: _Optional[_Union[ImportCorpusHeader, _Mapping]] = ..., document: _Optional[_Union[CorpusDocument, _Mapping]] = ...) -> None: ...

class ImportCorpusResponse(_message.Message):
    __slots__ = ("num_documents", "num_tokens", "corpus_tokens")
    NUM_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CORPUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_documents: int
    num_tokens: int
    corpus_tokens: int
    def __init__(self, num_documents: _Optional[int] = ..., num_tokens: _Optional[int] = ..., corpus_tokens: _Optional[int] = ...) -> None: ...

class ExportHistoryRequest(_message.Message):
    __slots__ = ("tenant_id", "password")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    password: str
    def __init__(self, tenant_id: _Optional[str] = ..., password: _Optional[str] = ...) -> None: ...

class ExportHistoryResponse(_message.Message):
    __slots__ = ("progress", "data", "summary")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    data: bytes
    summary: ExportSummary
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., data: _Optional[bytes] = ..., summary: _Optional[_Union[ExportSummary, _Mapping]] = ...) -> None: ...

class ExportSummary(_message.Message):
    __slots__ = ("num_bytes", "num_trajectories", "skipped")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    num_trajectories: int
    skipped: _containers.RepeatedCompositeFieldContainer[BadRecord]
    def __init__(self, num_bytes: _Optional[int] = ..., num_trajectories: _Optional[int] = ..., skipped: _Optional[_Iterable[_Union[BadRecord, _Mapping]]] = ...) -> None: ...

class BadRecord(_message.Message):
    __slots__ = ("kind", "record_id", "cursor", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    record_id: str
    cursor: str
    reason: str
    def __init__(self, kind: _Optional[str] = ..., record_id: _Optional[str] = ..., cursor: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class HistoryCheckRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class HistoryCheckResponse(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    result: HistoryCheckResult
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., result: _Optional[_Union[HistoryCheckResult, _Mapping]] = ...) -> None: ...

class HistoryCheckResult(_message.Message):
    __slots__ = ("tenant_id", "num_records", "bad", "repaired", "num_quarantined")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    BAD_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    num_records: int
    bad: _containers.RepeatedCompositeFieldContainer[BadRecord]
    repaired: bool
    num_quarantined: int
    def __init__(self, tenant_id: _Optional[str] = ..., num_records: _Optional[int] = ..., bad: _Optional[_Iterable[_Union[BadRecord, _Mapping]]] = ..., repaired: _Optional[bool] = ..., num_quarantined: _Optional[int] = ...) -> None: ...

class ImportHistoryHeader(_message.Message):
    __slots__ = ("password", "new_tenant_name", "into_tenant_id")
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    NEW_TENANT_NAME_FIELD_NUMBER: _ClassVar[int]
    INTO_TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    password: str
    new_tenant_name: str
    into_tenant_id: str
    def __init__(self, password: _Optional[str] = ..., new_tenant_name: _Optional[str] = ..., into_tenant_id: _Optional[str] = ...) -> None: ...

class ImportHistoryRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ImportHistoryHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ImportHistoryHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportHistoryResponse(_message.Message):
    __slots__ = ("tenant", "created", "num_trajectories", "num_blobs", "api_key")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOBS_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    created: bool
    num_trajectories: int
    num_blobs: int
    api_key: str
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., created: _Optional[bool] = ..., num_trajectories: _Optional[int] = ..., num_blobs: _Optional[int] = ..., api_key: _Optional[str] = ...) -> None: ...
