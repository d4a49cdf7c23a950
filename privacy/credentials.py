"""API keys: generation, parsing, and the keyed hash they are stored as.

A key reads ``rpk_<key id>_<secret>`` (tenant) or ``rpa_<key id>_<secret>`` (admin): the prefix makes
leaked keys recognisable to secret scanners, the 16-hex-digit key id is the public lookup handle, and the
secret holds 256 random bits. Because the secret has full entropy a slow password hash buys nothing; the
stored digest is HMAC-SHA256 under a server-side key (wrapped by the master key), over the key id, its
owner and the whole key. Someone who can write the store but lacks the master key can therefore neither
forge a credential nor move one to another tenant. Comparison is constant-time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from privacy.errors import AuthenticationError

TENANT_KEY_PREFIX = "rpk"
ADMIN_KEY_PREFIX = "rpa"
ADMIN_OWNER = "admin"
_KEY_RE = re.compile(r"^(rpk|rpa)_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
_DIGEST_LABEL = b"reprise/v1/api-key\x00"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """A syntactically valid key split into its parts."""

    prefix: str
    key_id: str
    whole: str


def generate_key(prefix: str) -> ParsedKey:
    """A new random key with ``prefix`` (``rpk`` or ``rpa``)."""
    if prefix not in (TENANT_KEY_PREFIX, ADMIN_KEY_PREFIX):
        raise ValueError(f"key prefix must be {TENANT_KEY_PREFIX!r} or {ADMIN_KEY_PREFIX!r}, got {prefix!r}")
    key_id = secrets.token_hex(8)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return ParsedKey(prefix, key_id, f"{prefix}_{key_id}_{secret}")


def parse_key(key: str) -> ParsedKey:
    """Split a presented key; AuthenticationError if it is not shaped like one (the key is not echoed)."""
    if not isinstance(key, str):
        raise AuthenticationError("API key must be a string")
    key = key.strip()
    if key.lower().startswith("bearer "):
        key = key[7:].strip()
    m = _KEY_RE.match(key)
    if not m:
        raise AuthenticationError("malformed API key (expected rpk_<id>_<secret> or rpa_<id>_<secret>)")
    return ParsedKey(m.group(1), m.group(2), key)


def key_digest(hmac_key: bytes, parsed: ParsedKey, owner: str) -> bytes:
    """The stored form of a key: HMAC-SHA256(hmac_key, label, key id, owner, whole key)."""
    msg = b"\x00".join((_DIGEST_LABEL, parsed.key_id.encode(), owner.encode(), parsed.whole.encode()))
    return hmac.new(hmac_key, msg, hashlib.sha256).digest()


def digests_match(expected: bytes, actual: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(expected, actual)
