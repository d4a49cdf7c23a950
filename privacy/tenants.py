"""Records that cross the privacy boundary: tenant ids, tenants, principals, issued keys, progress."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

_TENANT_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True, slots=True)
class TenantId:
    """The opaque id of a tenant: 128 random bits as 32 lowercase hex digits.

    It appears in storage keys (``reprise:{t:<id>}:...``) and reveals nothing about the tenant. A
    request never supplies it: the service gets it from ``HistoryStore.authenticate(api_key)``.
    """

    value: str

    def __post_init__(self) -> None:
        if not isinstance(self.value, str) or not _TENANT_ID_RE.match(self.value):
            raise ValueError(f"tenant id must be 32 lowercase hex digits, got {self.value!r}")

    @classmethod
    def generate(cls) -> TenantId:
        """A fresh random id."""
        return cls(secrets.token_hex(16))

    @property
    def raw(self) -> bytes:
        """The 16 bytes bound into every record's associated data."""
        return bytes.fromhex(self.value)

    def __str__(self) -> str:
        return self.value


def validate_tenant_name(name: str) -> str:
    """Return ``name`` if it is a valid tenant name, else raise ValueError naming it.

    1-63 characters: letters, digits, ``.``, ``_``, ``-``; starting with a letter or digit; not 32 hex
    digits (the shape of a tenant id, in either case), so that a name never reads as another tenant's id
    where tenants are named by name or id.
    """
    if not isinstance(name, str) or not _TENANT_NAME_RE.match(name):
        raise ValueError(
            f"tenant name must be 1-63 characters of letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit; got {name!r}"
        )
    if _TENANT_ID_RE.match(name.lower()):
        raise ValueError(f"tenant name {name!r} has the shape of a tenant id (32 hex digits); choose another")
    return name


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant as the admin plane sees it. ``created_at`` is Unix seconds."""

    id: TenantId
    name: str
    created_at: float
    data_key_version: int


@dataclass(frozen=True, slots=True)
class AdminPrincipal:
    """An authenticated admin-plane caller (identified by the id of the admin key it used)."""

    key_id: str


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A freshly generated credential. ``secret`` is the whole key: shown once, stored only as a hash."""

    key_id: str
    secret: str = ""

    def __repr__(self) -> str:  # never print the secret by accident
        return f"IssuedKey(key_id={self.key_id!r}, secret=<hidden>)"


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    """What is stored about a key: no secret, only its id, owner and dates (Unix seconds)."""

    key_id: str
    tenant: TenantId | None  # None for an admin key
    created_at: float


@dataclass(frozen=True, slots=True)
class Progress:
    """Progress of a long operation (mirrors ``reprise.v1.Progress``); ``total`` is 0 while unknown."""

    phase: str
    done: int
    total: int
    unit: str


ProgressCallback = Callable[[Progress], None]
