"""The admin plane's backend: tenants and keys (privacy.HistoryStore) and their indexes (retrieval).

Implements ``serving.admin.AdminBackend``. Privacy errors become statuses here: an unknown tenant
NOT_FOUND, a taken name ALREADY_EXISTS, an integrity failure DATA_LOSS, a store outage UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from privacy.errors import (
    AuthenticationError,
    IntegrityError,
    MasterKeyError,
    StorageError,
    TenantExistsError,
    UnknownTenantError,
)
from privacy.tenants import TenantId
from serving import errors
from serving.admin import (
    BadRecordInfo,
    CorpusDocument,
    CorpusImport,
    HistoryCheck,
    HistoryExport,
    HistoryImport,
    IndexMemory,
    KeyRotation,
    Progress,
    ProgressCallback,
    TenantInfo,
    TenantStats,
)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def privacy_errors() -> Iterator[None]:
    """Map privacy's exceptions to gRPC statuses (ValueError passes: it becomes INVALID_ARGUMENT)."""
    try:
        yield
    except UnknownTenantError as exc:
        raise errors.NotFound(str(exc) or "no such tenant", what="tenant") from None
    except TenantExistsError as exc:
        raise errors.AlreadyExists(str(exc)) from None
    except IntegrityError as exc:
        raise errors.DataLoss(str(exc)) from None
    except AuthenticationError as exc:
        raise errors.Unauthenticated(str(exc)) from None
    except MasterKeyError as exc:
        raise errors.FailedPrecondition(str(exc)) from None
    except StorageError as exc:
        raise errors.Unavailable(f"history store unavailable: {exc}") from None


def tenant_id(value: str) -> Any:
    """A ``privacy.TenantId``; INVALID_ARGUMENT naming the value if it is not one."""
    try:
        return TenantId(value)
    except ValueError:
        raise errors.InvalidArgument(f"{value[:80]!r} is not a tenant id (32 lowercase hex digits)") from None


def _info(t: Any) -> TenantInfo:
    return TenantInfo(t.id.value, t.name, int(t.created_at * 1000))


def bad_record_info(b: Any) -> BadRecordInfo:
    """A ``privacy.integrity.BadRecord`` as the admin plane's record."""
    return BadRecordInfo(b.kind, b.record_id, b.cursor, b.reason)


def history_check(c: Any) -> HistoryCheck:
    """A ``privacy.integrity.HistoryCheck`` as the admin plane's record."""
    return HistoryCheck(c.tenant.value, c.num_records, tuple(map(bad_record_info, c.bad)), c.repaired,
                        c.num_quarantined)


def _relay(progress: ProgressCallback) -> Callable[[Any], None]:
    return lambda p: progress(Progress(p.phase, p.done, p.total, p.unit))


class ServiceAdmin:
    """``AdminBackend`` over the history store and the tenants' indexes.

    ``indexes`` provides the index operations (``stats``, ``build``, ``compact``, ``add_corpus``,
    ``forget``) — see ``reprise.server.indexes``. ``on_keys_changed`` runs after anything that revokes keys
    (the authenticator's cache is cleared there).
    """

    def __init__(self, store: Any, indexes: Any, on_keys_changed: Callable[[], None] = lambda: None) -> None:
        self._store = store
        self._indexes = indexes
        self._keys_changed = on_keys_changed

    # ---- tenants and keys --------------------------------------------------------------------------

    def create_tenant(self, name: str) -> tuple[TenantInfo, str]:
        with privacy_errors():
            tenant = self._store.create_tenant(name)
            key = self._store.create_api_key(tenant.id)
        return _info(tenant), key.secret

    def list_tenants(self) -> list[TenantInfo]:
        with privacy_errors():
            return [_info(t) for t in self._store.list_tenants()]

    def delete_tenant(self, tenant: str, dry_run: bool = False) -> int:
        tid = tenant_id(tenant)
        with privacy_errors():
            report = self._store.delete_tenant(tid, dry_run=dry_run)
        if not dry_run:
            self._keys_changed()
            self._indexes.forget(tid.value)
        return report.num_records

    def rotate_keys(self, kind: str, tenant: str, progress: ProgressCallback) -> KeyRotation:
        with privacy_errors():
            if kind == "master_key":
                report = self._store.rotate_master_key(_relay(progress))
                return KeyRotation(key_version=report.version, num_records=report.num_records)
            tid = tenant_id(tenant)
            if kind == "api_key":
                issued = self._store.rotate_api_key(tid)
                self._keys_changed()
                return KeyRotation(api_key=issued.secret)
            report = self._store.rotate_data_key(tid, _relay(progress))
            return KeyRotation(key_version=report.version, num_records=report.num_records)

    def export_history(self, tenant: str, password: str, write: Callable[[bytes], None],
                       progress: ProgressCallback) -> HistoryExport:
        tid = tenant_id(tenant)
        with privacy_errors():
            report = self._store.export_tenant(tid, _Sink(write), password=password, progress=_relay(progress))
        for bad in report.skipped:
            log.warning("tenant %s: export left out %s", tid.value, bad.describe())
        return HistoryExport(report.num_bytes, report.num_trajectories, tuple(map(bad_record_info, report.skipped)))

    def import_history(self, source: BinaryIO, password: str, new_tenant_name: str, into_tenant_id: str,
                       progress: ProgressCallback) -> HistoryImport:
        into = tenant_id(into_tenant_id) if into_tenant_id else None
        with privacy_errors():
            report = self._store.import_tenant(source, password=password, into=into,
                                               name=new_tenant_name or None, progress=_relay(progress))
            key = self._store.create_api_key(report.tenant.id).secret if report.created else ""
        self._indexes.forget(report.tenant.id.value)  # rebuilt from the store on next use
        return HistoryImport(_info(report.tenant), report.created, report.num_trajectories, report.num_blobs, key)

    # ---- indexes -----------------------------------------------------------------------------------

    def index_stats(self, tenant: str | None) -> list[TenantStats]:
        with privacy_errors():
            if tenant:
                return [self._indexes.stats(self._store.get_tenant(tenant_id(tenant)).id.value)]
            return self._indexes.all_stats([t.id.value for t in self._store.list_tenants()])

    def index_memory(self) -> IndexMemory:
        return self._indexes.memory()

    def verify_history(self, tenant: str, progress: ProgressCallback) -> HistoryCheck:
        tid = tenant_id(tenant)
        with privacy_errors():
            return history_check(self._store.verify_history(tid, _relay(progress)))

    def repair_history(self, tenant: str, progress: ProgressCallback) -> HistoryCheck:
        """Set the bad records aside, then rebuild the tenant's index from what remains (all of it is
        good now, so its quarantine count at load drops to 0)."""
        tid = tenant_id(tenant)
        with privacy_errors():
            check = self._store.repair_history(tid, _relay(progress))
        for bad in check.bad:
            log.warning("tenant %s: repair moved %s to quarantine", tid.value, bad.describe())
        self._indexes.reload(tid.value)
        return history_check(check)

    def build_index(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        tid = tenant_id(tenant)
        with privacy_errors():
            self._store.get_tenant(tid)
            return self._indexes.build(tid.value, progress)

    def compact_index(self, tenant: str, progress: ProgressCallback) -> TenantStats:
        tid = tenant_id(tenant)
        with privacy_errors():
            self._store.get_tenant(tid)
            return self._indexes.compact(tid.value, progress)

    def import_corpus(self, tenant: str, documents: Iterable[CorpusDocument], replace: bool,
                      progress: ProgressCallback) -> CorpusImport:
        tid = tenant_id(tenant)
        with privacy_errors():
            self._store.get_tenant(tid)
            return self._indexes.add_corpus(tid.value, documents, replace, progress)


class _Sink:
    """A write-only binary file object that hands every write to ``write``."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write

    def write(self, data: bytes) -> int:
        self._write(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass
