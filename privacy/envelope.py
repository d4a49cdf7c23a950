"""Envelope encryption: sealed records under data keys, data keys wrapped by the master key.

Every sealed value has the layout ``format(1) | key version(4, big-endian) | nonce(12) | ciphertext+tag``
and is AES-256-GCM with a random 96-bit nonce. The associated data binds where the value belongs:

- record:      "reprise/v1" | tenant id (16 bytes) | kind | record id | data key version
- wrapped key: "reprise/v1/key" | owner (tenant id, or 16 zero bytes for system keys) | key name |
               master key version

so a value copied under another tenant, kind, id or version fails authentication instead of decrypting.
Variable-length parts are length-prefixed, so no two different tuples give the same associated data.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from privacy.errors import IntegrityError

FORMAT_V1 = 1
NONCE_BYTES = 12
TAG_BYTES = 16
_HEADER = struct.Struct(">BI")
HEADER_BYTES = _HEADER.size + NONCE_BYTES
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
SYSTEM_OWNER = bytes(16)
_CHECK_PLAINTEXT = b"reprise master key check v1"


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def record_aad(tenant_raw: bytes, kind: str, record_id: bytes, key_version: int) -> bytes:
    """Associated data of a record: binds tenant, kind, record id and data key version."""
    return b"".join((b"reprise/v1\x00", tenant_raw, _lp(kind.encode()), _lp(record_id), key_version.to_bytes(4, "big")))


def key_aad(owner: bytes, name: str, master_version: int) -> bytes:
    """Associated data of a wrapped key: binds owner, key name and master key version."""
    return b"".join((b"reprise/v1/key\x00", owner, _lp(name.encode()), master_version.to_bytes(4, "big")))


def seal(cipher: AESGCM, key_version: int, aad: bytes, plaintext: bytes) -> bytes:
    """Encrypt ``plaintext`` under ``cipher`` (key ``key_version``) with a fresh random nonce."""
    nonce = os.urandom(NONCE_BYTES)
    return _HEADER.pack(FORMAT_V1, key_version) + nonce + cipher.encrypt(nonce, plaintext, aad)


def sealed_version(blob: bytes, what: str) -> int:
    """The key version in a sealed value's header; IntegrityError if the value is too short or unknown."""
    if len(blob) < OVERHEAD_BYTES:
        raise IntegrityError(f"{what}: sealed value is {len(blob)} bytes, shorter than any valid one (truncated)")
    fmt, version = _HEADER.unpack_from(blob)
    if fmt != FORMAT_V1:
        raise IntegrityError(f"{what}: unknown sealed format {fmt}")
    return version


def open_sealed(cipher: AESGCM, aad: bytes, blob: bytes, what: str) -> bytes:
    """Authenticate and decrypt; IntegrityError (nothing decrypted) on any mismatch."""
    try:
        return cipher.decrypt(blob[_HEADER.size:HEADER_BYTES], blob[HEADER_BYTES:], aad)
    except InvalidTag:
        raise IntegrityError(
            f"{what}: authentication failed (the value was altered, truncated, or moved from another "
            f"tenant, kind or id)"
        ) from None


def wrap_key(master_key: bytes, master_version: int, owner: bytes, name: str, key: bytes) -> bytes:
    """Wrap a data key (or a system key) under a master key version."""
    return seal(AESGCM(master_key), master_version, key_aad(owner, name, master_version), key)


def unwrap_key(master_key: bytes, owner: bytes, name: str, wrapped: bytes) -> bytes:
    """Unwrap a key wrapped by :func:`wrap_key`; the caller picks ``master_key`` by the header version."""
    version = sealed_version(wrapped, f"wrapped key {name!r}")
    return open_sealed(AESGCM(master_key), key_aad(owner, name, version), wrapped, f"wrapped key {name!r}")


def make_check(master_key: bytes, master_version: int) -> bytes:
    """A sealed constant that proves, at start-up, that a master key version is the right one."""
    return wrap_key(master_key, master_version, SYSTEM_OWNER, "master-key-check", _CHECK_PLAINTEXT)


def verify_check(master_key: bytes, check: bytes) -> bool:
    """True if ``check`` was made by :func:`make_check` with this master key."""
    try:
        return unwrap_key(master_key, SYSTEM_OWNER, "master-key-check", check) == _CHECK_PLAINTEXT
    except IntegrityError:
        return False
