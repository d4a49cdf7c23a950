"""Export and import of one tenant's history as a sealed file.

Protection: a password (scrypt, n=2^15, r=8, p=1, random 16-byte salt) or a raw 256-bit key; one of
the two is required. The header is only authenticated once a frame opens, so nothing in it may choose
the work done before that: an import accepts exactly the scrypt parameters Reprise writes (32 MiB,
about 0.1 s) and a first frame (the tenant entry) of at most 1 MiB; later frames, read once the key is
proven, may be as large as a snapshot. The file is a header then frames, each AES-256-GCM sealed under the derived key:

    header = "REPRISE-EXPORT\\0\\x01" | protection(1) | log2 n(1) | r(1) | p(1) | salt(16) | nonce prefix(8)
    frame  = length(4, big-endian) | ciphertext+tag     nonce = prefix | frame counter(4)
                                                        associated data = header | final flag(1)

The counter in the nonce fixes each frame's position and the final flag marks the last one, so a
reordered, truncated, extended or altered file fails (IntegrityError), as does a wrong password. Frames
hold, in order: the tenant (name, snapshot cursors), its trajectories in commit order, its blobs
(snapshots, corpus parts, hidden states), and an end marker with the counts. Records are opened with
the tenant's data key and re-sealed with the export key; an import re-seals them under the target
tenant's data key, so the file is independent of both stores' master keys.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from privacy.blobs import BLOB_KINDS
from privacy.errors import IntegrityError
from privacy.integrity import BLOB_PARSE_ERRORS, blob_bad_record, check_blob
from privacy.records import (
    BadRecord,
    Trajectory,
    decode_documents,
    decode_hidden_states,
    decode_trajectory,
    encode_trajectory,
)
from privacy.sealed import SealedStore
from privacy.tenants import Progress, ProgressCallback, Tenant, TenantId

MAGIC = b"REPRISE-EXPORT\x00\x01"
_HEADER = struct.Struct(">BBBB16s8s")
_LEN = struct.Struct(">I")
PROTECT_PASSWORD, PROTECT_KEY = 1, 2
SCRYPT_LOG2_N, SCRYPT_R, SCRYPT_P = 15, 8, 1
_MAX_FIRST_FRAME = 1 << 20  # the tenant entry (a name and snapshot cursors), read before the key is proven
_MAX_FRAME = 1 << 30
MIN_PASSWORD_CHARS = 10
T_TENANT, T_TRAJECTORY, T_BLOB, T_END = 1, 2, 3, 4
_BATCH = 256


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What an export wrote, and what it left out."""

    num_trajectories: int
    num_blobs: int
    num_bytes: int
    skipped: tuple[BadRecord, ...] = ()  # records left out: they failed authentication or parsing


@dataclass(frozen=True, slots=True)
class ImportReport:
    """What an import read, and into which tenant (``created``: a new one)."""

    tenant: Tenant
    created: bool
    num_trajectories: int
    num_blobs: int


def _derive(protection: int, log2_n: int, r: int, p: int, salt: bytes, password: str | None, key: bytes | None) -> AESGCM:
    if protection == PROTECT_PASSWORD:
        if password is None:
            raise ValueError("this export is password-protected: give password=")
        if (log2_n, r, p) != (SCRYPT_LOG2_N, SCRYPT_R, SCRYPT_P):  # before any work: the header is not authenticated
            raise IntegrityError(
                f"export file asks for scrypt log2 n {log2_n}, r {r}, p {p}; Reprise writes and reads only log2 n "
                f"{SCRYPT_LOG2_N}, r {SCRYPT_R}, p {SCRYPT_P}, so this file was not written by Reprise or was altered")
        return AESGCM(Scrypt(salt=salt, length=32, n=1 << log2_n, r=r, p=p).derive(password.encode()))
    if protection == PROTECT_KEY:
        if key is None:
            raise ValueError("this export is key-protected: give key= (32 bytes)")
        return AESGCM(key)
    raise IntegrityError(f"export file has unknown protection {protection}")


def _check_secret(password: str | None, key: bytes | None) -> None:
    if (password is None) == (key is None):
        raise ValueError("give exactly one of password= or key=")
    if password is not None and (not isinstance(password, str) or len(password) < MIN_PASSWORD_CHARS):
        raise ValueError(f"export password must be a string of at least {MIN_PASSWORD_CHARS} characters")
    if key is not None and (not isinstance(key, (bytes, bytearray)) or len(key) != 32):
        raise ValueError(f"export key must be 32 bytes, got {len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__}")


class _Writer:
    def __init__(self, sink: BinaryIO, password: str | None, key: bytes | None) -> None:
        protection = PROTECT_PASSWORD if password is not None else PROTECT_KEY
        salt, self.prefix = os.urandom(16), os.urandom(8)
        self.header = MAGIC + _HEADER.pack(protection, SCRYPT_LOG2_N, SCRYPT_R, SCRYPT_P, salt, self.prefix)
        self.cipher = _derive(protection, SCRYPT_LOG2_N, SCRYPT_R, SCRYPT_P, salt, password, key)
        self.sink, self.counter = sink, 0
        sink.write(self.header)
        self.num_bytes = len(self.header)

    def frame(self, entry_type: int, payload: bytes, final: bool = False) -> None:
        nonce = self.prefix + _LEN.pack(self.counter)
        ct = self.cipher.encrypt(nonce, bytes([entry_type]) + payload, self.header + bytes([final]))
        self.sink.write(_LEN.pack(len(ct)) + ct)
        self.counter += 1
        self.num_bytes += 4 + len(ct)


def _lp(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def _split_lp(buf: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 4 > len(buf):
        raise IntegrityError("export entry is truncated")
    (n,) = _LEN.unpack_from(buf, pos)
    if pos + 4 + n > len(buf):
        raise IntegrityError("export entry is truncated")
    return buf[pos + 4:pos + 4 + n], pos + 4 + n


def export_tenant(store: SealedStore, tenant: TenantId, sink: BinaryIO, *, password: str | None = None,
                  key: bytes | None = None, progress: ProgressCallback | None = None) -> ExportReport:
    """Write ``tenant``'s history to ``sink`` (a binary file object) as a sealed export. A record that
    fails authentication or parsing is left out and listed in the report's ``skipped``."""
    _check_secret(password, key)
    info = store.get_tenant(tenant)
    tk = store.keychain.tenant_keys(tenant)
    skipped: list[BadRecord] = []
    heads = []
    for kind in BLOB_KINDS:
        for blob in store.storage.blob_list(tenant.value, kind):
            try:
                heads.append((kind, blob, store._blob_head(tk, kind, blob)))
            except BLOB_PARSE_ERRORS as exc:
                skipped.append(blob_bad_record(kind, blob.tag, exc))
    total = store.count_trajectories(tenant)
    w = _Writer(sink, password, key)
    w.frame(T_TENANT, json.dumps({
        "name": info.name, "exported_at": time.time(),
        "snapshot_cursors": [h["cursor"] for kind, _, h in heads if kind == "snapshot" and h.get("cursor")],
    }).encode())
    n = 0
    for rec in store.iter_trajectories(tenant, on_bad=skipped.append):
        w.frame(T_TRAJECTORY, _lp(rec.cursor.encode()) + encode_trajectory(rec.trajectory))
        n += 1
        if progress is not None and n % _BATCH == 0:
            progress(Progress("export", n, total, "records"))
    num_blobs = 0
    for kind, blob, head in heads:
        try:
            got = check_blob(store, tk, kind, blob)
        except BLOB_PARSE_ERRORS as exc:
            skipped.append(blob_bad_record(kind, blob.tag, exc))
            continue
        if got is not None:
            w.frame(T_BLOB, _lp(kind.encode()) + _lp(json.dumps(got[0]).encode()) + got[1])
            num_blobs += 1
    w.frame(T_END, json.dumps({"num_trajectories": n, "num_blobs": num_blobs}).encode(), final=True)
    if progress is not None:
        progress(Progress("export", n, total, "records"))
    return ExportReport(n, num_blobs, w.num_bytes, tuple(skipped))


def _read_header(source: BinaryIO) -> bytes:
    header = source.read(len(MAGIC) + _HEADER.size)
    if len(header) < len(MAGIC) + _HEADER.size or not header.startswith(MAGIC):
        raise IntegrityError("not a Reprise export file (bad magic or truncated header)")
    return header


def _cipher(header: bytes, password: str | None, key: bytes | None) -> AESGCM:
    protection, log2_n, r, p, salt, _ = _HEADER.unpack_from(header, len(MAGIC))
    return _derive(protection, log2_n, r, p, salt, password, key)


def _frames(source: BinaryIO, header: bytes, cipher: AESGCM) -> Iterator[tuple[int, bytes]]:
    """The frames after ``header`` (already read from ``source``), each authenticated with ``cipher``."""
    prefix = _HEADER.unpack_from(header, len(MAGIC))[-1]
    counter, final = 0, False
    while True:
        raw_len = source.read(4)
        if not raw_len:
            if not final:
                raise IntegrityError("export file is truncated (no final frame)")
            return
        if final:
            raise IntegrityError("export file has data after its final frame")
        if len(raw_len) < 4:
            raise IntegrityError("export file is truncated (partial frame length)")
        (n,) = _LEN.unpack(raw_len)
        limit = _MAX_FRAME if counter else _MAX_FIRST_FRAME
        if not 17 <= n <= limit:
            raise IntegrityError(f"export file has a frame of implausible length {n} (frame {counter}: at most {limit})")
        ct = source.read(n)
        if len(ct) < n:
            raise IntegrityError("export file is truncated (partial frame)")
        nonce = prefix + _LEN.pack(counter)
        for flag in (False, True):
            try:
                plain = cipher.decrypt(nonce, ct, header + bytes([flag]))
                final = flag
                break
            except InvalidTag:
                continue
        else:
            raise IntegrityError(
                f"export frame {counter} failed authentication (wrong password/key, or the file was altered)"
            )
        counter += 1
        yield plain[0], plain[1:]


def import_tenant(store: SealedStore, source: BinaryIO, *, password: str | None = None, key: bytes | None = None,
                  into: TenantId | None = None, name: str | None = None,
                  progress: ProgressCallback | None = None) -> ImportReport:
    """Import an export into a new tenant (``name``, default the exported name) or append it to ``into``.

    A seekable source is authenticated completely before anything is written; otherwise a failure
    part-way removes a newly created tenant again (an existing one keeps what was imported).
    """
    if (password is None) == (key is None):
        raise ValueError("give exactly one of password= or key=")
    if into is not None and name is not None:
        raise ValueError("give into= (an existing tenant) or name= (a new one), not both")
    start = source.tell() if source.seekable() else 0
    header = _read_header(source)
    cipher = _cipher(header, password, key)  # derived once, for both passes
    if source.seekable():
        for _ in _frames(source, header, cipher):
            pass
        source.seek(start)
        if _read_header(source) != header:
            raise IntegrityError("export file changed while it was being read")
    frames = _frames(source, header, cipher)
    entry_type, payload = next(frames, (0, b""))
    if entry_type != T_TENANT:
        raise IntegrityError("export file does not start with a tenant entry")
    meta = json.loads(payload)
    created = into is None
    tenant = store.create_tenant(name or meta["name"]) if created else store.get_tenant(into)  # type: ignore[arg-type]
    try:
        n_traj, n_blob = _import_entries(store, tenant.id, frames, set(meta.get("snapshot_cursors", [])), created, progress)
    except BaseException:
        if created:
            store.delete_tenant(tenant.id)
        raise
    return ImportReport(store.get_tenant(tenant.id), created, n_traj, n_blob)


def _import_entries(store: SealedStore, tenant: TenantId, frames: Iterator[tuple[int, bytes]], wanted: set[str],
                    fresh: bool, progress: ProgressCallback | None) -> tuple[int, int]:
    cursor_map: dict[str, str] = {}
    batch: list[tuple[str, Trajectory]] = []
    n_traj = n_blob = 0

    def flush() -> None:
        refs = store.append_trajectories(tenant, [t for _, t in batch])
        cursor_map.update({old: ref.cursor for (old, _), ref in zip(batch, refs) if old in wanted})
        batch.clear()

    for entry_type, payload in frames:
        if entry_type == T_TRAJECTORY:
            old, pos = _split_lp(payload, 0)
            batch.append((old.decode(), decode_trajectory(payload[pos:])))
            n_traj += 1
            if len(batch) == _BATCH:
                flush()
                if progress is not None:
                    progress(Progress("import", n_traj, 0, "records"))
        elif entry_type == T_BLOB:
            if batch:
                flush()
            kind, pos = _split_lp(payload, 0)
            head_raw, pos = _split_lp(payload, pos)
            _import_blob(store, tenant, kind.decode(), json.loads(head_raw), payload[pos:], cursor_map, fresh)
            n_blob += 1
        elif entry_type == T_END:
            if batch:
                flush()
            counts = json.loads(payload)
            if counts != {"num_trajectories": n_traj, "num_blobs": n_blob}:
                raise IntegrityError(f"export file counts {counts} do not match its entries ({n_traj}, {n_blob})")
        else:
            raise IntegrityError(f"export file has an unknown entry type {entry_type}")
    return n_traj, n_blob


def _import_blob(store: SealedStore, tenant: TenantId, kind: str, head: dict[str, Any], body: bytes,
                 cursor_map: dict[str, str], fresh: bool) -> None:
    if kind == "snapshot":
        if fresh:  # an old snapshot would not cover the trajectories an existing tenant already has
            store.put_snapshot(tenant, body, cursor_map.get(head.get("cursor", ""), ""), head["name"])
    elif kind == "corpus":
        store.add_corpus_documents(tenant, decode_documents(body), head["name"])
    elif kind == "hidden":
        positions, states = decode_hidden_states(body)
        store.put_hidden_states(tenant, head["key"], positions, states)
    elif kind == "response":
        store.put_response(tenant, head["key"], body, head["expires_at"])
    else:
        raise IntegrityError(f"export file has an unknown blob kind {kind!r}")
