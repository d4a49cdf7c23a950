"""Keys in memory: the master keyring, system keys, each tenant's data keys and encryption counters.

Start-up proves the master key against sealed check values (one per version the store uses), so a
wrong or missing key fails here with MasterKeyError rather than later as garbage. Data keys are
unwrapped on first use and cached per tenant; ``evict`` drops a tenant's (after deletion or rotation
elsewhere). Each data key's encryptions are counted in storage, reserved in blocks so a write costs no
extra round trip; a key that reaches ``max_encryptions_per_key`` is retired: a new version takes the
new writes while the old one still opens old records.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy import envelope
from privacy.config import StoreConfig
from privacy.errors import IntegrityError, MasterKeyError, UnknownTenantError
from privacy.keyring import MasterKeyring
from privacy.storage import Storage
from privacy.tenants import TenantId

log = logging.getLogger(__name__)

CHECK_PREFIX = "kek-check:"
SYSTEM_KEY_PREFIX = "syskey:"
_RESERVE_BLOCK = 4096
TAG_BYTES = 16
_TAG_CACHE = 4096


def dek_name(version: int) -> str:
    """Storage name of a data key version."""
    return f"dek:{version}"


def dek_version(name: str) -> int | None:
    """The version in a data key's storage name, None for other keys."""
    return int(name[4:]) if name.startswith("dek:") else None


class SharedGate:
    """Many holders share it (writers sealing and storing records); an exclusive holder (the last step
    of a data key rotation) waits until they have left and keeps new ones out meanwhile."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the gate with others (waits while an exclusive holder has it)."""
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate alone: waits for shared holders to leave, keeps new ones out."""
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


@dataclass(slots=True)
class TenantKeys:
    """A tenant's unwrapped keys. ``ciphers`` maps data key version -> AESGCM; ``current`` seals."""

    tenant: TenantId
    current: int
    ciphers: dict[int, AESGCM]
    tag_key: bytes
    reserved: int = 0  # encryptions reserved in storage for ``current``
    used: int = 0      # of which used; a new block is reserved when used == reserved
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Held shared from sealing a record to storing it, so a rotation can wait for in-flight writes.
    gate: SharedGate = field(default_factory=SharedGate)
    raw: bytes = field(init=False)  # the tenant id's 16 bytes, bound into every record's associated data
    _tags: dict[tuple[str, str], bytes] = field(default_factory=dict)  # agents reuse session ids

    def __post_init__(self) -> None:
        self.raw = self.tenant.raw

    def tag(self, label: str, value: str) -> bytes:
        """A keyed hash (HMAC-SHA256, 128 bits) that stands for ``value`` in storage keys (session ids,
        names)."""
        tag = self._tags.get((label, value))
        if tag is None:
            tag = hmac.digest(self.tag_key, label.encode() + b"\x00" + value.encode(), "sha256")[:TAG_BYTES]
            if len(self._tags) >= _TAG_CACHE:
                self._tags.clear()
            self._tags[(label, value)] = tag
        return tag


class Keychain:
    """Master keyring + system keys + per-tenant key cache, over one ``Storage``."""

    def __init__(self, storage: Storage, keyring: MasterKeyring, config: StoreConfig) -> None:
        self.storage = storage
        self.keyring = keyring
        self.config = config
        self._lock = threading.RLock()
        self._tenants: dict[str, TenantKeys] = {}
        self.verify_master_key()
        auth = self._system_key("auth")
        self.credential_key = _derive(auth, b"reprise/v1/credentials")
        self.name_key = _derive(auth, b"reprise/v1/tenant-names")

    # master key
    def verify_master_key(self) -> None:
        """Check every stored check value against the keyring; record checks for new versions."""
        checks = self.storage.meta_items(CHECK_PREFIX)
        stored = {int(n[len(CHECK_PREFIX):]): v for n, v in checks.items()}
        missing = sorted(set(stored) - set(self.keyring.versions))
        if missing:
            raise MasterKeyError(
                f"this store is sealed with master key version(s) {missing}, which {self.keyring.source} "
                f"does not hold (it has {self.keyring.versions}): supply the right key"
            )
        for version, check in stored.items():
            if not envelope.verify_check(self.keyring.key(version), check):
                raise MasterKeyError(
                    f"master key version {version} from {self.keyring.source} is not the key this store was "
                    f"sealed with"
                )
        for version in self.keyring.versions:
            if version not in stored:
                check = envelope.make_check(self.keyring.key(version), version)
                if not self.storage.meta_put(f"{CHECK_PREFIX}{version}", check, only_new=True):
                    self.verify_master_key()  # another process recorded it first: verify theirs
                    return

    def set_keyring(self, keyring: MasterKeyring) -> None:
        """Use ``keyring`` from now on (verified like at start-up)."""
        with self._lock:
            self.keyring = keyring
            self.verify_master_key()

    def wrap(self, owner: bytes, name: str, key: bytes) -> bytes:
        """Wrap under the primary master key version."""
        primary = self.keyring.primary
        return envelope.wrap_key(self.keyring.key(primary), primary, owner, name, key)

    def unwrap(self, owner: bytes, name: str, wrapped: bytes) -> bytes:
        """Unwrap with the master key version named in the wrapped key's header."""
        version = envelope.sealed_version(wrapped, f"wrapped key {name!r}")
        return envelope.unwrap_key(self.keyring.key(version), owner, name, wrapped)

    def _system_key(self, name: str) -> bytes:
        meta = SYSTEM_KEY_PREFIX + name
        wrapped = self.storage.meta_get(meta)
        if wrapped is None:
            fresh = self.wrap(envelope.SYSTEM_OWNER, name, os.urandom(32))
            self.storage.meta_put(meta, fresh, only_new=True)
            wrapped = self.storage.meta_get(meta)
            assert wrapped is not None
        return self.unwrap(envelope.SYSTEM_OWNER, name, wrapped)

    def name_tag(self, name: str) -> bytes:
        """Keyed hash of a tenant name (case-folded: names are unique regardless of case)."""
        return hmac.new(self.name_key, name.casefold().encode(), hashlib.sha256).digest()[:TAG_BYTES]

    # tenant keys
    def new_tenant_keys(self, tenant: TenantId) -> tuple[TenantKeys, dict[str, bytes]]:
        """Fresh data key (version 1) and tag key for a new tenant, and their wrapped forms."""
        dek, tag_key = AESGCM.generate_key(bit_length=256), os.urandom(32)
        wrapped = {dek_name(1): self.wrap(tenant.raw, dek_name(1), dek), "tag": self.wrap(tenant.raw, "tag", tag_key)}
        return TenantKeys(tenant, 1, {1: AESGCM(dek)}, tag_key), wrapped

    def tenant_keys(self, tenant: TenantId) -> TenantKeys:
        """The tenant's keys (cached); UnknownTenantError if it does not exist or is being deleted."""
        if not isinstance(tenant, TenantId):
            raise TypeError(f"tenant must be a TenantId (from authenticate), got {type(tenant).__name__}")
        cached = self._tenants.get(tenant.value)
        if cached is not None:
            return cached
        with self._lock:
            cached = self._tenants.get(tenant.value)
            if cached is None:
                cached = self._load(tenant)
                self._tenants[tenant.value] = cached
            return cached

    def _load(self, tenant: TenantId) -> TenantKeys:
        row = self.storage.tenant_get(tenant.value)
        if row is None or row.state != "active":
            raise UnknownTenantError(f"no tenant {tenant.value}")
        wrapped = self.storage.keys_get(tenant.value)
        if "tag" not in wrapped:
            raise UnknownTenantError(f"no tenant {tenant.value} (its keys are gone)")
        ciphers = {}
        for name, w in wrapped.items():
            version = dek_version(name)
            if version is not None:
                ciphers[version] = AESGCM(self.unwrap(tenant.raw, name, w))
        if row.dek_version not in ciphers:
            raise IntegrityError(f"tenant {tenant.value}: its current data key version {row.dek_version} is missing")
        return TenantKeys(tenant, row.dek_version, ciphers, self.unwrap(tenant.raw, "tag", wrapped["tag"]))

    def evict(self, tenant: TenantId) -> None:
        """Forget the tenant's unwrapped keys (reloaded from storage on next use)."""
        with self._lock:
            self._tenants.pop(tenant.value, None)

    def cached_tenants(self) -> list[str]:
        """Ids of the tenants whose keys are cached."""
        return list(self._tenants)

    # sealing
    def seal(self, tk: TenantKeys, kind: str, record_id: bytes, body: bytes) -> bytes:
        """Seal ``body`` as record (kind, record_id) of the tenant under its current data key."""
        with tk.lock:
            if tk.used >= tk.reserved:
                self._reserve(tk)
            tk.used += 1
            version, cipher = tk.current, tk.ciphers[tk.current]
        return envelope.seal(cipher, version, envelope.record_aad(tk.raw, kind, record_id, version), body)

    def open(self, tk: TenantKeys, kind: str, record_id: bytes, sealed: bytes) -> bytes:
        """Authenticate and decrypt a record; IntegrityError if anything does not match."""
        what = f"tenant {tk.tenant.value}: {kind} record {record_id.hex()}"
        version = envelope.sealed_version(sealed, what)
        cipher = tk.ciphers.get(version)
        if cipher is None:
            with tk.lock:
                self._refresh(tk)  # another process may have added a version
            cipher = tk.ciphers.get(version)
            if cipher is None:
                raise IntegrityError(f"{what}: sealed with data key version {version}, which this tenant does not have")
        return envelope.open_sealed(cipher, envelope.record_aad(tk.raw, kind, record_id, version), sealed, what)

    def _reserve(self, tk: TenantKeys) -> None:
        limit = self.config.max_encryptions_per_key
        block = min(_RESERVE_BLOCK, max(1, limit // 16))
        self._refresh_current(tk)
        high = self.storage.counter_reserve(tk.tenant.value, tk.current, block)
        if high > limit:
            log.info("tenant %s: data key version %d reached %d encryptions; retiring it", tk.tenant.value, tk.current, limit)
            self._add_version(tk)
            high = self.storage.counter_reserve(tk.tenant.value, tk.current, block)
        tk.reserved, tk.used = high, high - block

    def _refresh_current(self, tk: TenantKeys) -> None:
        row = self.storage.tenant_get(tk.tenant.value)
        if row is None or row.state != "active":
            self.evict(tk.tenant)
            raise UnknownTenantError(f"no tenant {tk.tenant.value}")
        if row.dek_version != tk.current:
            self._refresh(tk)

    def _refresh(self, tk: TenantKeys) -> None:
        fresh = self._load(tk.tenant)
        tk.ciphers, tk.current = fresh.ciphers, fresh.current
        tk.reserved = tk.used = 0

    def _add_version(self, tk: TenantKeys) -> int:
        """Create the next data key version and make it current (callers hold ``tk.lock``)."""
        while True:
            versions = [v for v in (dek_version(n) for n in self.storage.keys_get(tk.tenant.value)) if v is not None]
            version = max(versions, default=0) + 1
            key = AESGCM.generate_key(bit_length=256)
            if self.storage.keys_add(tk.tenant.value, dek_name(version), self.wrap(tk.tenant.raw, dek_name(version), key)):
                self.storage.tenant_update(tk.tenant.value, dek_version=version)
                tk.ciphers[version], tk.current = AESGCM(key), version
                tk.reserved = tk.used = 0
                return version

    def add_data_key_version(self, tk: TenantKeys) -> int:
        """Start a new data key version for new writes (rotation)."""
        with tk.lock:
            return self._add_version(tk)

    def drop_data_key_versions(self, tk: TenantKeys, versions: list[int]) -> None:
        """Destroy old data key versions (their records must have been re-encrypted)."""
        with tk.lock:
            assert tk.current not in versions
            self.storage.keys_delete(tk.tenant.value, [dek_name(v) for v in versions])
            for v in versions:
                tk.ciphers.pop(v, None)


def _derive(key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)
