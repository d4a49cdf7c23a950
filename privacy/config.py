"""Settings of the history store: one frozen record per part, validated at construction.

Built once at start-up (flags > ``REPRISE_*`` environment > TOML > defaults, by the application) and
passed down. Every error names the offending value; passwords never appear in reprs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from fileio import HOME_ENV, reprise_home

MASTER_KEY_ENV = "REPRISE_MASTER_KEY"
DATA_DIR_ENV = HOME_ENV
# NIST SP 800-38D: at most 2^32 invocations of GCM with random 96-bit nonces under one key. Retire
# each data key at a quarter of that.
DEFAULT_MAX_ENCRYPTIONS = 2**30
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def default_data_dir() -> Path:
    """``$REPRISE_HOME``, else ``~/.reprise`` (the service's data directory, see reprise.config)."""
    return reprise_home()


@dataclass(frozen=True, slots=True)
class SqliteConfig:
    """The embedded store: one SQLite file at ``path``.

    ``synchronous``: ``FULL`` (default) fsyncs the WAL at every commit, so an acknowledged write survives
    a process kill and a power cut; ``NORMAL`` survives a process kill but may lose the last commits on
    an OS crash or power loss.
    """

    path: Path
    synchronous: str = "FULL"
    busy_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        if self.synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise ValueError(f"sqlite synchronous must be FULL, NORMAL or EXTRA, got {self.synchronous!r}")
        if self.busy_timeout_ms < 0:
            raise ValueError(f"sqlite busy_timeout_ms must be >= 0, got {self.busy_timeout_ms}")
        if not isinstance(self.path, Path):
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
        settings: dict[str, Any] = {
            "host": parts.hostname or "127.0.0.1",
            "port": port,
            "db": db,
            "username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None,
            "tls": parts.scheme == "rediss",
        }
        settings.update(overrides)
        return cls(**settings)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where history lives and how it is sealed: one flat section (``[store]`` in reprise.toml,
    ``REPRISE_STORE_<FIELD>`` in the environment), validated here; ``sqlite``/``redis`` give the
    backends' own records.

    The master key itself is never a setting: it comes from ``REPRISE_MASTER_KEY`` or the key file.
    """

    backend: str = field(default="sqlite", metadata=_help(
        "history store: sqlite (one file in the data dir, no server) or redis"))
    data_dir: Path | None = field(default=None, metadata=_help(
        "directory of the SQLite file, the generated master key and the first admin key "
        "(default $REPRISE_HOME, else ~/.reprise)"))
    sqlite_path: Path | None = field(default=None, metadata=_help("SQLite file (default <data_dir>/history.db)"))
    sqlite_synchronous: str = field(default="FULL", metadata=_help(
        "FULL: a commit survives kill -9 and power loss; NORMAL: kill -9 only, faster"))
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=_help(
        "redis://[user[:password]@]host[:port][/db], rediss:// for TLS"))
    redis_username: str = field(default="", metadata=_help("Redis ACL user (overrides the URL's)"))
    redis_password: str = field(default="", repr=False, metadata=_help(
        "Redis password (overrides the URL's; prefer the environment variable)"))
    redis_tls_ca_file: Path | None = field(default=None, metadata=_help("PEM CA that signed the Redis server's certificate"))
    redis_tls_cert_file: Path | None = field(default=None, metadata=_help("PEM client certificate (tls-auth-clients)"))
    redis_tls_key_file: Path | None = field(default=None, metadata=_help("PEM key of redis_tls_cert_file"))
    redis_key_prefix: str = field(default="reprise", metadata=_help("first part of every Redis key"))
    redis_cluster: bool = field(default=False, metadata=_help("redis_url points at a Redis Cluster node"))
    master_key_file: Path | None = field(default=None, metadata=_help(
        "master key file, used when $REPRISE_MASTER_KEY is unset (default <data_dir>/master.key)"))
    max_encryptions_per_key: int = field(default=DEFAULT_MAX_ENCRYPTIONS, metadata=_help(
        "encryptions after which a tenant's data key is retired and a new version takes new writes"))
    chunk_bytes: int = field(default=4 * 2**20, metadata=_help(
        "index snapshots and corpora are sealed in chunks of this many bytes"))

    def __post_init__(self) -> None:
        if self.backend not in ("sqlite", "redis"):
            raise ValueError(f"store backend must be 'sqlite' or 'redis', got {self.backend!r}")
        for name in ("data_dir", "sqlite_path", "master_key_file", "redis_tls_ca_file", "redis_tls_cert_file",
                     "redis_tls_key_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value).expanduser())
        if not 16 <= self.max_encryptions_per_key <= 2**32 - 2**24:
            raise ValueError(
                f"max_encryptions_per_key must be in [16, 2^32 - 2^24] (AES-GCM with random nonces), "
                f"got {self.max_encryptions_per_key}"
            )
        if not 4096 <= self.chunk_bytes <= 256 * 2**20:
            raise ValueError(f"chunk_bytes must be in [4096, 268435456], got {self.chunk_bytes}")
        self.sqlite  # noqa: B018 - validate the backend records now, with errors naming the value
        if self.backend == "redis":
            self.redis  # noqa: B018

    @property
    def directory(self) -> Path:
        """``data_dir``, or the default data directory when unset."""
        return self.data_dir if self.data_dir is not None else default_data_dir()

    @property
    def key_file(self) -> Path:
        """The master key file used when the environment variable is not set."""
        return self.master_key_file or self.directory / "master.key"

    @property
    def sqlite(self) -> SqliteConfig:
        """The SQLite backend's record (path resolved against the data directory)."""
        return SqliteConfig(self.sqlite_path or self.directory / "history.db", self.sqlite_synchronous)

    @property
    def redis(self) -> RedisConfig:
        """The Redis backend's record: ``redis_url`` with the other ``redis_*`` settings applied."""
        overrides: dict[str, Any] = {"key_prefix": self.redis_key_prefix, "cluster": self.redis_cluster}
        if self.redis_username:
            overrides["username"] = self.redis_username
        if self.redis_password:
            overrides["password"] = self.redis_password
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(self, "redis_" + name) is not None:
                overrides[name] = getattr(self, "redis_" + name)
        return RedisConfig.from_url(self.redis_url, **overrides)

    @classmethod
    def for_redis(cls, redis: RedisConfig, **kwargs: Any) -> StoreConfig:
        """A Redis-backed config from a ``RedisConfig`` record (tests, embedding)."""
        auth = quote(redis.username or "", safe="") + (":" + quote(redis.password, safe="") if redis.password else "")
        url = f"{'rediss' if redis.tls else 'redis'}://{auth + '@' if auth else ''}{redis.host}:{redis.port}/{redis.db}"
        return cls(backend="redis", redis_url=url, redis_key_prefix=redis.key_prefix, redis_cluster=redis.cluster,
                   redis_tls_ca_file=redis.tls_ca_file, redis_tls_cert_file=redis.tls_cert_file,
                   redis_tls_key_file=redis.tls_key_file, **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """Build from a mapping (a TOML table); unknown keys are an error naming them."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown store settings: {', '.join(unknown)}")
        return cls(**data)
