"""Exceptions of the privacy layer: each names what failed, never a secret or a record's content."""

from __future__ import annotations


class PrivacyError(Exception):
    """Base class of every error raised by ``privacy``."""


class IntegrityError(PrivacyError):
    """A sealed record, wrapped key or export file failed authentication or framing.

    Raised instead of returning anything decrypted: a flipped byte, a truncated record, a record moved
    under another tenant, kind or id, or a record sealed with a key this tenant no longer has. The gRPC
    layer maps it to DATA_LOSS.
    """


class MasterKeyError(PrivacyError):
    """The master key is missing, malformed, or not the one the store was sealed with (start-up)."""


class AuthenticationError(PrivacyError):
    """A credential is malformed, unknown or revoked. The message never says which part was wrong."""


class UnknownTenantError(PrivacyError, LookupError):
    """No such tenant (never created, or deleted)."""


class TenantExistsError(PrivacyError, ValueError):
    """A tenant with this name already exists."""


class StorageError(PrivacyError):
    """The backing store (SQLite file, Redis server) failed or holds an unexpected schema."""


class StoreDamagedError(StorageError):
    """The store's file is damaged (SQLite reports a malformed page or a file that is not a database).
    The message names the file and the offline repair command (``python -m privacy repair``)."""
