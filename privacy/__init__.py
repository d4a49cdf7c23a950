"""Tenants, credentials, envelope encryption and the encrypted history store (SQLite or Redis).

Entry points: ``open_store(StoreConfig(...)) -> HistoryStore`` and ``ensure_admin_key``. See
docs/privacy.md for the design, the settings and the operator commands (``python -m privacy``).
"""

from __future__ import annotations

from privacy.bootstrap import ensure_admin_key, open_storage, open_store
from privacy.config import MASTER_KEY_ENV, RedisConfig, SqliteConfig, StoreConfig
from privacy.errors import (
    AuthenticationError,
    IntegrityError,
    MasterKeyError,
    PrivacyError,
    StorageError,
    TenantExistsError,
    UnknownTenantError,
)
from privacy.history import DeletionReport, HistoryStore, KeyStatus, TenantKeyStatus, TrajectoryRef
from privacy.keyring import MasterKeyring
from privacy.records import CorpusInfo, IndexSnapshot, Trajectory, TrajectoryRecord
from privacy.rotation import RotationReport
from privacy.tenants import AdminPrincipal, ApiKeyInfo, IssuedKey, Progress, Tenant, TenantId
from privacy.transfer import ExportReport, ImportReport

__all__ = [
    "MASTER_KEY_ENV",
    "AdminPrincipal",
    "ApiKeyInfo",
    "AuthenticationError",
    "CorpusInfo",
    "DeletionReport",
    "ExportReport",
    "HistoryStore",
    "ImportReport",
    "IndexSnapshot",
    "IntegrityError",
    "IssuedKey",
    "KeyStatus",
    "MasterKeyError",
    "MasterKeyring",
    "PrivacyError",
    "Progress",
    "RedisConfig",
    "RotationReport",
    "SqliteConfig",
    "StorageError",
    "StoreConfig",
    "Tenant",
    "TenantExistsError",
    "TenantId",
    "TenantKeyStatus",
    "Trajectory",
    "TrajectoryRecord",
    "TrajectoryRef",
    "UnknownTenantError",
    "ensure_admin_key",
    "open_storage",
    "open_store",
]
