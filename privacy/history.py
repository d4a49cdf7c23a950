"""``HistoryStore``: the privacy layer's public face. Everything is sealed before it reaches storage.

    store = open_store(StoreConfig())                  # privacy.bootstrap
    tenant = store.create_tenant("acme")
    key = store.create_api_key(tenant.id)              # key.secret: shown once, stored as a keyed hash
    tid = store.authenticate(key.secret)               # -> TenantId; the only way a request gets one
    store.append_trajectory(tid, session_id, token_ids, text)
    for rec in store.iter_trajectories(tid): ...       # commit order, to rebuild the tenant's index
    store.delete_tenant(tid)                           # crypto-shred, then delete, then hooks evict

Methods take a ``TenantId`` (never a name or a request field) and raise UnknownTenantError for tenants
that do not exist, IntegrityError for records that fail authentication.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from privacy import credentials as creds
from privacy import envelope, integrity, rotation, transfer
from privacy.blobs import BLOB_KINDS, KIND_CORPUS, KIND_HIDDEN, KIND_SNAPSHOT, BlobRecords
from privacy.config import StoreConfig
from privacy.errors import AuthenticationError, IntegrityError, UnknownTenantError
from privacy.integrity import HistoryCheck, trajectory_bad_record
from privacy.keychain import Keychain, TenantKeys, dek_version
from privacy.keyring import MasterKeyring
from privacy.records import (
    KIND_TENANT,
    KIND_TRAJECTORY,
    TENANT_RECORD_ID,
    BadRecordCallback,
    DeletionReport,
    Trajectory,
    TrajectoryRecord,
    TrajectoryRef,
    as_token_ids,
    decode_trajectory,
    encode_trajectory,
)
from privacy.rotation import RotationReport
from privacy.storage import CredentialRow, Storage, TenantRow
from privacy.tenants import (
    AdminPrincipal,
    ApiKeyInfo,
    IssuedKey,
    ProgressCallback,
    Tenant,
    TenantId,
    validate_tenant_name,
)

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

_DUMMY_DIGEST = bytes(32)
__all__ = ["BLOB_KINDS", "KIND_CORPUS", "KIND_HIDDEN", "KIND_SNAPSHOT", "KIND_TENANT", "KIND_TRAJECTORY",
           "DeletionReport", "HistoryStore", "KeyStatus", "RotationReport", "TenantKeyStatus", "TrajectoryRef"]


@dataclass(frozen=True, slots=True)
class TenantKeyStatus:
    """A tenant's data key versions (``current`` seals new records), the encryptions reserved under the
    current one (retired at ``max_encryptions_per_key``), and the master key versions wrapping its keys."""

    tenant: TenantId
    current: int
    versions: tuple[int, ...]
    encryptions: int
    master_key_versions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KeyStatus:
    """Master key versions (primary and where they come from) and every tenant's key status."""

    master_key_versions: tuple[int, ...]
    master_key_primary: int
    master_key_source: str
    max_encryptions_per_key: int
    tenants: tuple[TenantKeyStatus, ...]


class HistoryStore(BlobRecords):
    """Tenants, credentials and their sealed history over one ``Storage`` backend. Thread-safe."""

    def __init__(self, storage: Storage, keyring: MasterKeyring, config: StoreConfig | None = None) -> None:
        self.config = config or StoreConfig()
        self.storage = storage
        self.keychain = Keychain(storage, keyring, self.config)
        self._deletion_hooks: list[Callable[[TenantId], None]] = []
        self._key_hooks: list[Callable[[TenantId], None]] = []
        self.num_integrity_failures = 0
        for tid in storage.tenant_ids():  # finish deletions a crash interrupted
            row = storage.tenant_get(tid)
            if row is not None and row.state == "deleting":
                log.warning("finishing the interrupted deletion of tenant %s", tid)
                storage.tenant_purge(tid)

    def close(self) -> None:
        """Close the backend connection."""
        self.storage.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- tenants
    def create_tenant(self, name: str) -> Tenant:
        """A new tenant with a random id and its own data key. TenantExistsError if the name is taken."""
        validate_tenant_name(name)
        tenant = TenantId.generate()
        tk, wrapped = self.keychain.new_tenant_keys(tenant)
        created = time.time()
        info = self._seal_info(tk, name, created)
        self.storage.tenant_insert(TenantRow(tenant.value, self.keychain.name_tag(name), info, 1, "active"), wrapped)
        self.storage.counter_reserve(tenant.value, 1, 1)  # the info record's encryption
        log.info("created tenant %s", tenant.value)
        return Tenant(tenant, name, created, 1)

    def _seal_info(self, tk: TenantKeys, name: str, created: float) -> bytes:
        body = json.dumps({"name": name, "created_at": created}).encode()
        aad = envelope.record_aad(tk.tenant.raw, KIND_TENANT, TENANT_RECORD_ID, tk.current)
        return envelope.seal(tk.ciphers[tk.current], tk.current, aad, body)

    def get_tenant(self, tenant: TenantId) -> Tenant:
        """The tenant's name, creation time and current data key version (UnknownTenantError if none)."""
        tk = self.keychain.tenant_keys(tenant)
        row = self.storage.tenant_get(tenant.value)
        if row is None:
            raise UnknownTenantError(f"no tenant {tenant.value}")
        info = json.loads(self._open(tk, KIND_TENANT, TENANT_RECORD_ID, row.info))
        return Tenant(tenant, info["name"], info["created_at"], row.dek_version)

    def find_tenant(self, name: str) -> Tenant | None:
        """The tenant called ``name`` (case-insensitive), or None."""
        validate_tenant_name(name)
        tid = self.storage.tenant_by_name_tag(self.keychain.name_tag(name))
        if tid is None:
            return None
        try:
            return self.get_tenant(TenantId(tid))
        except UnknownTenantError:
            return None

    def list_tenants(self) -> list[Tenant]:
        """Every active tenant, oldest first."""
        out = []
        for tid in self.storage.tenant_ids():
            try:
                out.append(self.get_tenant(TenantId(tid)))
            except UnknownTenantError:
                continue
        return out

    def count_records(self, tenant: TenantId) -> int:
        """Trajectories plus blobs (snapshots, corpus parts, hidden-state sets) the tenant holds."""
        self.keychain.tenant_keys(tenant)
        return self.storage.traj_count(tenant.value) + self.storage.blob_count(tenant.value)

    def add_deletion_hook(self, hook: Callable[[TenantId], None]) -> None:
        """Call ``hook(tenant)`` when a tenant is deleted (after its keys are destroyed), e.g. to drop its
        in-memory index. Exceptions from hooks are logged, not raised."""
        self._deletion_hooks.append(hook)

    def delete_tenant(self, tenant: TenantId, dry_run: bool = False) -> DeletionReport:
        """Crypto-shred ``tenant``: destroy its wrapped data keys and API keys (one atomic step; from then
        on its records are unreadable), run the deletion hooks, then delete its records.

        Copies made earlier (backups, Redis AOF/RDB files) still hold the wrapped keys: run
        ``rotate_master_key()`` afterwards and destroy the old master key version (a shred epoch).
        """
        self.keychain.tenant_keys(tenant)  # UnknownTenantError if absent
        num = self.count_records(tenant)
        if dry_run:
            return DeletionReport(tenant, num, False)
        self.keychain.evict(tenant)
        self.storage.tenant_shred(tenant.value)
        self.keychain.evict(tenant)
        log.warning("tenant %s: data keys destroyed (crypto-shredded); deleting %d records", tenant.value, num)
        for hook in self._deletion_hooks:
            try:
                hook(tenant)
            except Exception:  # a hook must not stop the deletion
                log.exception("deletion hook %r failed for tenant %s", hook, tenant.value)
        num = self.storage.tenant_purge(tenant.value)
        return DeletionReport(tenant, num, True)

    def add_key_hook(self, hook: Callable[[TenantId], None]) -> None:
        """Call ``hook(tenant)`` when the tenant's API keys are rotated or its data key gets a new version
        (as soon as new writes use it), e.g. so that other processes on the store drop their cached keys
        (``evict_tenant``). Exceptions from hooks are logged, not raised."""
        self._key_hooks.append(hook)

    def _keys_changed(self, tenant: TenantId) -> None:
        for hook in self._key_hooks:
            try:
                hook(tenant)
            except Exception:  # a hook must not stop the rotation
                log.exception("key hook %r failed for tenant %s", hook, tenant.value)

    def evict_tenant(self, tenant: TenantId) -> None:
        """Drop the tenant's cached keys (call when another replica deleted or rotated it)."""
        self.keychain.evict(tenant)

    # ---------------------------------------------------------------- credentials
    def create_api_key(self, tenant: TenantId) -> IssuedKey:
        """A new API key for ``tenant``. ``secret`` is returned once; only a keyed hash is stored."""
        self.keychain.tenant_keys(tenant)
        return self._issue(creds.TENANT_KEY_PREFIX, tenant.value)

    def create_admin_key(self) -> IssuedKey:
        """A new admin-plane key (``rpa_...``)."""
        return self._issue(creds.ADMIN_KEY_PREFIX, creds.ADMIN_OWNER)

    def _issue(self, prefix: str, owner: str) -> IssuedKey:
        parsed = creds.generate_key(prefix)
        digest = creds.key_digest(self.keychain.credential_key, parsed, owner)
        self.storage.cred_put(CredentialRow(parsed.key_id, owner, digest, time.time()))
        return IssuedKey(parsed.key_id, parsed.whole)

    def rotate_api_key(self, tenant: TenantId) -> IssuedKey:
        """Issue a new key for ``tenant`` and revoke all its others."""
        old = [r.key_id for r in self.storage.cred_list(tenant.value)]
        issued = self.create_api_key(tenant)
        self.storage.cred_delete(old)
        self._keys_changed(tenant)
        return issued

    def revoke_api_key(self, key_id: str, tenant: TenantId | None = None) -> bool:
        """Revoke a key by id (admin keys included). With ``tenant``, only that tenant's own keys."""
        row = self.storage.cred_get(key_id)
        if row is None or (tenant is not None and row.owner != tenant.value):
            return False
        self.storage.cred_delete([key_id])
        return True

    def list_api_keys(self, tenant: TenantId | None = None) -> list[ApiKeyInfo]:
        """Keys of ``tenant``, or every key (admin keys have ``tenant=None``)."""
        rows = self.storage.cred_list(tenant.value if tenant is not None else None)
        return [
            ApiKeyInfo(r.key_id, None if r.owner == creds.ADMIN_OWNER else TenantId(r.owner), r.created_at) for r in rows
        ]

    def has_admin_key(self) -> bool:
        """True once any admin key exists."""
        return bool(self.storage.cred_list(creds.ADMIN_OWNER))

    def authenticate(self, api_key: str) -> TenantId:
        """The tenant a data-plane key belongs to; AuthenticationError if malformed, unknown or revoked."""
        return TenantId(self._check(api_key, creds.TENANT_KEY_PREFIX)[0])

    def authenticate_admin(self, api_key: str) -> AdminPrincipal:
        """The admin principal of an admin key; AuthenticationError otherwise (tenant keys included)."""
        return AdminPrincipal(self._check(api_key, creds.ADMIN_KEY_PREFIX)[1])

    def _check(self, api_key: str, prefix: str) -> tuple[str, str]:
        """(owner, key id) of a valid key with ``prefix``; AuthenticationError otherwise."""
        parsed = creds.parse_key(api_key)
        row = self.storage.cred_get(parsed.key_id)
        owner = row.owner if row is not None else "-"
        actual = creds.key_digest(self.keychain.credential_key, parsed, owner)
        good = creds.digests_match(row.digest if row is not None else _DUMMY_DIGEST, actual)
        is_admin = owner == creds.ADMIN_OWNER
        if not good or parsed.prefix != prefix or is_admin != (prefix == creds.ADMIN_KEY_PREFIX):
            raise AuthenticationError("unknown or revoked API key")
        return owner, parsed.key_id

    # ---------------------------------------------------------------- trajectories
    def append_trajectory(
        self,
        tenant: TenantId,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        text: str = "",
        *,
        num_prompt_tokens: int = 0,
        started_at: float = 0.0,
        finished_at: float | None = None,
    ) -> TrajectoryRef:
        """Seal and durably append one request's trajectory (the pipeline's history sink)."""
        t = Trajectory(session_id, as_token_ids(token_ids), text, num_prompt_tokens, started_at,
                       time.time() if finished_at is None else finished_at)
        return self.append_trajectories(tenant, [t])[0]

    def append_trajectories(self, tenant: TenantId, trajectories: Sequence[Trajectory]) -> list[TrajectoryRef]:
        """Append several in one atomic write (one transaction / one pipelined MULTI)."""
        for t in trajectories:
            if not isinstance(t, Trajectory):
                raise TypeError(f"expected Trajectory, got {type(t).__name__}")
        if not trajectories:
            return []
        tk = self.keychain.tenant_keys(tenant)
        bodies = [(os.urandom(16), encode_trajectory(t), tk.tag("session", t.session_id)) for t in trajectories]
        with tk.gate.shared():
            items = [(rid, tag, self.keychain.seal(tk, KIND_TRAJECTORY, rid, body)) for rid, body, tag in bodies]
            cursors = self.storage.traj_append(tenant.value, items)
        return [TrajectoryRef(c, rid.hex()) for c, (rid, _, _) in zip(cursors, items)]

    def iter_trajectories(
        self, tenant: TenantId, after: str | None = None, session_id: str | None = None, batch_size: int = 512,
        on_bad: BadRecordCallback | None = None,
    ) -> Iterator[TrajectoryRecord]:
        """The tenant's trajectories in commit order (after ``after``, a cursor), optionally one session's.

        Reads in batches, so appends may continue meanwhile. A record that fails authentication or
        parsing raises IntegrityError, or, with ``on_bad``, is skipped and reported to it
        (``privacy.integrity``: what an index load or an export does, so one bad record costs only itself).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        tk = self.keychain.tenant_keys(tenant)
        tag = tk.tag("session", session_id) if session_id is not None else None
        return self._iter(tk, after, tag, batch_size, on_bad)

    def _iter(self, tk: TenantKeys, after: str | None, tag: bytes | None, batch_size: int,
              on_bad: BadRecordCallback | None = None) -> Iterator[TrajectoryRecord]:
        cursor = after
        while True:
            rows = self.storage.traj_scan(tk.tenant.value, cursor, batch_size, tag)
            for row in rows:
                try:
                    trajectory = decode_trajectory(self._open(tk, KIND_TRAJECTORY, row.record_id, row.sealed))
                except IntegrityError as exc:
                    if on_bad is None:
                        raise
                    on_bad(trajectory_bad_record(row.cursor, row.record_id, exc))
                    continue
                yield TrajectoryRecord(row.cursor, row.record_id.hex(), trajectory)
            if len(rows) < batch_size:
                return
            cursor = rows[-1].cursor

    def verify_history(self, tenant: TenantId, progress: ProgressCallback | None = None) -> HistoryCheck:
        """Open and parse every record of ``tenant``; report those that fail (``privacy.integrity``)."""
        return integrity.verify_history(self, tenant, progress)

    def repair_history(self, tenant: TenantId, progress: ProgressCallback | None = None) -> HistoryCheck:
        """``verify_history``, then move each bad record to the tenant's quarantine (``privacy.integrity``)."""
        return integrity.repair_history(self, tenant, progress)

    def count_trajectories(self, tenant: TenantId) -> int:
        """How many trajectories the tenant has."""
        self.keychain.tenant_keys(tenant)
        return self.storage.traj_count(tenant.value)

    def _open(self, tk: TenantKeys, kind: str, record_id: bytes, sealed: bytes) -> bytes:
        try:
            return self.keychain.open(tk, kind, record_id, sealed)
        except IntegrityError:
            self.num_integrity_failures += 1
            raise

    # ---------------------------------------------------------------- keys, export (privacy.rotation/transfer)
    def key_status(self) -> KeyStatus:
        """Master key versions and, per tenant, its data key versions and encryption count."""
        tenants = []
        for tid in self.storage.tenant_ids():
            row = self.storage.tenant_get(tid)
            if row is None or row.state != "active":
                continue
            wrapped = self.storage.keys_get(tid)
            versions = tuple(sorted(v for v in map(dek_version, wrapped) if v is not None))
            masters = tuple(sorted({envelope.sealed_version(w, n) for n, w in wrapped.items()}))
            tenants.append(TenantKeyStatus(TenantId(tid), row.dek_version, versions,
                                           self.storage.counter_get(tid, row.dek_version), masters))
        ring = self.keychain.keyring
        return KeyStatus(tuple(ring.versions), ring.primary, ring.source, self.config.max_encryptions_per_key,
                         tuple(tenants))

    def rotate_data_key(self, tenant: TenantId, progress: ProgressCallback | None = None) -> RotationReport:
        """New data key version for ``tenant``; re-encrypt its records; destroy the old versions."""
        return rotation.rotate_data_key(self, tenant, progress)

    def rotate_master_key(self, progress: ProgressCallback | None = None, retire_old: bool = True) -> RotationReport:
        """Re-wrap every data key under a new master key version (data is not re-encrypted)."""
        return rotation.rotate_master_key(self, progress, retire_old)

    def export_tenant(self, tenant: TenantId, sink: BinaryIO, *, password: str | None = None,
                      key: bytes | None = None, progress: ProgressCallback | None = None) -> transfer.ExportReport:
        """Write the tenant's history as a sealed export file (see ``privacy.transfer``)."""
        return transfer.export_tenant(self, tenant, sink, password=password, key=key, progress=progress)

    def import_tenant(self, source: BinaryIO, *, password: str | None = None, key: bytes | None = None,
                      into: TenantId | None = None, name: str | None = None,
                      progress: ProgressCallback | None = None) -> transfer.ImportReport:
        """Read a sealed export file into a new tenant (``name``) or an existing one (``into``)."""
        return transfer.import_tenant(self, source, password=password, key=key, into=into, name=name, progress=progress)
