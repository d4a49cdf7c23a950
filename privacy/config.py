"""Settings of the history store: one frozen record per part, validated at construction.

Built once at start-up (flags > ``REPRISE_*`` environment > TOML > defaults, by the application) and
passed down. Every error names the offending value; passwords never appear in reprs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

MASTER_KEY_ENV = "REPRISE_MASTER_KEY"
DATA_DIR_ENV = "REPRISE_DATA_DIR"
# NIST SP 800-38D: at most 2^32 invocations of GCM with random 96-bit nonces under one key. Retire
# each data key at a quarter of that.
DEFAULT_MAX_ENCRYPTIONS = 2**30
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def default_data_dir() -> Path:
    """``$REPRISE_DATA_DIR``, else ``$XDG_DATA_HOME/reprise``, else ``~/.local/share/reprise``."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "reprise"


@dataclass(frozen=True, slots=True)
class SqliteConfig:
    """The embedded store. ``path`` defaults to ``<data_dir>/history.db``.

    ``synchronous``: ``FULL`` (default) fsyncs the WAL at every commit, so an acknowledged write survives
    a process kill and a power cut; ``NORMAL`` survives a process kill but may lose the last commits on
    an OS crash or power loss.
    """

    path: Path | None = None
    synchronous: str = "FULL"
    busy_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        if self.synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise ValueError(f"sqlite synchronous must be FULL, NORMAL or EXTRA, got {self.synchronous!r}")
        if self.busy_timeout_ms < 0:
            raise ValueError(f"sqlite busy_timeout_ms must be >= 0, got {self.busy_timeout_ms}")
        if self.path is not None and not isinstance(self.path, Path):
            object.__setattr__(self, "path", Path(self.path))


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Connection to Redis (or a Redis Cluster with ``cluster=True``).

    Keys are ``<key_prefix>:{t:<tenant id>}:...`` (one Cluster slot per tenant) and
    ``<key_prefix>:{meta}:...`` for the registry. ``tls`` turns on TLS (``rediss://``); ``tls_ca_file``
    verifies the server, ``tls_cert_file``/``tls_key_file`` authenticate the client (``tls-auth-clients``).
    ``username``/``password`` log in as an ACL user.
    """

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    key_prefix: str = "reprise"
    cluster: bool = False
    socket_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("redis host must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"redis port must be in [1, 65535], got {self.port}")
        if self.db < 0:
            raise ValueError(f"redis db must be >= 0, got {self.db}")
        if self.cluster and self.db != 0:
            raise ValueError(f"a Redis Cluster has only db 0, got db {self.db}")
        if not _PREFIX_RE.match(self.key_prefix):
            raise ValueError(
                f"redis key_prefix must be 1-64 letters, digits, '_', '.' or '-', got {self.key_prefix!r}"
            )
        if self.password is not None and self.username is not None and not self.username:
            raise ValueError("redis username must not be empty when given")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("redis tls_cert_file and tls_key_file must be given together")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            if value is None:
                continue
            if not self.tls:
                raise ValueError(f"redis {name} is set ({value}) but tls is off")
            path = Path(value)
            if not path.is_file():
                raise ValueError(f"redis {name} {str(path)!r} is not a readable file")
            object.__setattr__(self, name, path)
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(
                f"redis timeouts must be > 0, got socket {self.socket_timeout_s}, connect {self.connect_timeout_s}"
            )

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisConfig:
        """Parse ``redis://[user[:password]@]host[:port][/db]`` or ``rediss://`` (TLS)."""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"redis URL must start with redis:// or rediss://, got {url!r}")
        db = 0
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError(f"redis URL database must be a number, got {path!r}")
            db = int(path)
        try:
            port = parts.port or 6379
        except ValueError as exc:
            raise ValueError(f"redis URL has a bad port: {exc}") from None
        settings: dict[str, Any] = dict(
            host=parts.hostname or "127.0.0.1",
            port=port,
            db=db,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            tls=parts.scheme == "rediss",
        )
        settings.update(overrides)
        return cls(**settings)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where history lives and how it is sealed.

    ``backend``: ``sqlite`` (embedded, default) or ``redis``. ``data_dir`` holds the SQLite file, the
    generated master key file and the first admin key. ``master_key_file`` defaults to
    ``<data_dir>/master.key``; the ``REPRISE_MASTER_KEY`` environment variable takes precedence over the
    file. ``max_encryptions_per_key``: a tenant's data key is retired (a new version takes new writes)
    after this many encryptions. ``chunk_bytes``: snapshots and corpora are sealed in chunks of this size.
    """

    backend: str = "sqlite"
    data_dir: Path = field(default_factory=default_data_dir)
    sqlite: SqliteConfig = field(default_factory=SqliteConfig)
    redis: RedisConfig | None = None
    master_key_file: Path | None = None
    max_encryptions_per_key: int = DEFAULT_MAX_ENCRYPTIONS
    chunk_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if self.backend not in ("sqlite", "redis"):
            raise ValueError(f"store backend must be 'sqlite' or 'redis', got {self.backend!r}")
        if not isinstance(self.data_dir, Path):
            object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.master_key_file is not None and not isinstance(self.master_key_file, Path):
            object.__setattr__(self, "master_key_file", Path(self.master_key_file))
        if self.backend == "redis" and self.redis is None:
            object.__setattr__(self, "redis", RedisConfig())
        if not 16 <= self.max_encryptions_per_key <= 2**32 - 2**24:
            raise ValueError(
                f"max_encryptions_per_key must be in [16, 2^32 - 2^24] (AES-GCM with random nonces), "
                f"got {self.max_encryptions_per_key}"
            )
        if not 4096 <= self.chunk_bytes <= 256 * 2**20:
            raise ValueError(f"chunk_bytes must be in [4096, 268435456], got {self.chunk_bytes}")

    @property
    def key_file(self) -> Path:
        """The master key file used when the environment variable is not set."""
        return self.master_key_file or self.data_dir / "master.key"

    @property
    def sqlite_path(self) -> Path:
        return self.sqlite.path or self.data_dir / "history.db"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """Build from a mapping (a TOML table): nested ``sqlite``/``redis`` tables, or ``redis_url``.

        Unknown keys are an error naming them.
        """
        data = dict(data)
        names = {f.name for f in fields(cls)} | {"redis_url"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown store settings: {', '.join(unknown)}")
        if "sqlite" in data and isinstance(data["sqlite"], Mapping):
            data["sqlite"] = _build(SqliteConfig, data["sqlite"], "sqlite")
        url = data.pop("redis_url", None)
        if isinstance(data.get("redis"), Mapping):
            table = dict(data["redis"])
            data["redis"] = (
                RedisConfig.from_url(table.pop("url"), **table) if "url" in table else _build(RedisConfig, table, "redis")
            )
        elif url:
            data["redis"] = RedisConfig.from_url(url)
        return cls(**data)


def _build(cls: Any, table: Mapping[str, Any], section: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise ValueError(f"unknown {section} settings: {', '.join(unknown)}")
    return cls(**table)
