"""The versioned master key (KEK) that wraps every tenant's data key.

Sources, in order: the environment variable ``REPRISE_MASTER_KEY``, else the key file (default
``<data_dir>/master.key``), else - only for a store that holds nothing sealed yet - a newly generated
key file with 0600 permissions (its path is logged). Both hold either one base64 key (version 1) or
several ``<version>:<base64>`` entries separated by newlines or commas; the highest version is the
primary (it wraps new and re-wrapped data keys), older ones only unwrap until rotation retires them.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fileio import fsync_dir, write_atomic
from privacy.errors import MasterKeyError

log = logging.getLogger(__name__)

KEY_BYTES = 32
_ENTRY_RE = re.compile(r"^(?:v?(\d{1,9}):)?([A-Za-z0-9+/=_-]+)$")


@dataclass(frozen=True, slots=True)
class MasterKeyring:
    """Master key versions. ``path`` is set when the keys came from (or went to) a writable file."""

    keys: tuple[tuple[int, bytes], ...]
    source: str
    path: Path | None = None

    def __post_init__(self) -> None:
        if not self.keys:
            raise MasterKeyError(f"no master key in {self.source}")
        versions = [v for v, _ in self.keys]
        if len(set(versions)) != len(versions):
            raise MasterKeyError(f"master key versions repeat in {self.source}: {sorted(versions)}")
        for version, key in self.keys:
            if version < 1:
                raise MasterKeyError(f"master key version must be >= 1 in {self.source}, got {version}")
            if len(key) != KEY_BYTES:
                raise MasterKeyError(
                    f"master key version {version} in {self.source} is {len(key)} bytes, expected {KEY_BYTES}"
                )

    def __repr__(self) -> str:
        return f"MasterKeyring(versions={self.versions}, source={self.source!r})"

    @property
    def versions(self) -> list[int]:
        """The versions held, ascending."""
        return sorted(v for v, _ in self.keys)

    @property
    def primary(self) -> int:
        """The version that wraps new data keys."""
        return max(v for v, _ in self.keys)

    def key(self, version: int) -> bytes:
        """The key of ``version``; MasterKeyError if it is not held."""
        for v, k in self.keys:
            if v == version:
                return k
        raise MasterKeyError(f"master key version {version} is not in {self.source} (it has {self.versions})")

    def with_new_version(self) -> MasterKeyring:
        """This keyring plus a random key one version above the primary (not saved)."""
        return MasterKeyring(self.keys + ((self.primary + 1, secrets.token_bytes(KEY_BYTES)),), self.source, self.path)

    def without(self, versions: list[int]) -> MasterKeyring:
        """This keyring minus ``versions`` (not saved)."""
        return MasterKeyring(tuple((v, k) for v, k in self.keys if v not in versions), self.source, self.path)

    def to_text(self) -> str:
        """The key file text (highest version first)."""
        lines = ["# Reprise master key: <version>:<base64>. Losing it loses every tenant's history."]
        lines += [f"{v}:{base64.b64encode(k).decode()}" for v, k in sorted(self.keys, reverse=True)]
        return "\n".join(lines) + "\n"

    def save(self) -> None:
        """Write the keyring to its file atomically with 0600 permissions (MasterKeyError if read-only)."""
        if self.path is None:
            raise MasterKeyError(
                f"the master key comes from {self.source}, which Reprise cannot rewrite: put the new "
                f"version there yourself (as <version>:<base64>, highest version first)"
            )
        write_secret_file(self.path, self.to_text().encode())


def generate_keyring(path: Path) -> MasterKeyring:
    """A new version-1 key written to ``path`` (0600, must not exist)."""
    ring = MasterKeyring(((1, secrets.token_bytes(KEY_BYTES)),), f"key file {path}", path)
    write_secret_file(path, ring.to_text().encode(), exclusive=True)
    log.warning("generated a new master key in %s (0600): back it up; without it the history is unreadable", path)
    return ring


def parse_keyring(text: str, source: str, path: Path | None = None) -> MasterKeyring:
    """Parse key file or environment text (see the module docstring); MasterKeyError names the entry."""
    entries = [e.strip() for line in text.splitlines() if not line.strip().startswith("#") for e in line.split(",")]
    entries = [e for e in entries if e]
    if not entries:
        raise MasterKeyError(f"{source} holds no master key")
    keys = []
    for n, entry in enumerate(entries, 1):
        m = _ENTRY_RE.match(entry)
        if not m:
            raise MasterKeyError(f"entry {n} of {source} is not <version>:<base64> or <base64>")
        version = int(m.group(1)) if m.group(1) else 1
        if m.group(1) is None and len(entries) > 1:
            raise MasterKeyError(f"entry {n} of {source} has no version; with several keys write <version>:<base64>")
        try:
            key = base64.b64decode(m.group(2).replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise MasterKeyError(f"master key version {version} in {source} is not valid base64") from None
        keys.append((version, key))
    return MasterKeyring(tuple(keys), source, path)


def load_keyring(key_file: Path, env: Mapping[str, str] | None = None, env_name: str = "REPRISE_MASTER_KEY") -> MasterKeyring | None:
    """The keyring from the environment or the key file, or None when neither exists."""
    env = os.environ if env is None else env
    if env.get(env_name):
        return parse_keyring(env[env_name], f"environment variable {env_name}")
    if key_file.exists():
        mode = key_file.stat().st_mode
        if mode & 0o077:
            log.warning("master key file %s is readable by group or others (mode %o): chmod 600 it", key_file, mode & 0o777)
        try:
            text = key_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise MasterKeyError(f"cannot read master key file {key_file}: {exc}") from None
        return parse_keyring(text, f"key file {key_file}", key_file)
    return None


def write_secret_file(path: Path, data: bytes, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` with 0600 permissions, durably: replacing it atomically, or with
    ``exclusive`` creating it (``FileExistsError`` when it exists)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not exclusive:
        write_atomic(path, data, mode=0o600)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)
