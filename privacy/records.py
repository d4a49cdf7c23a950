"""What the store keeps, and the length-framed bytes each is encoded to before sealing.

Decoders check every length against what is left and that nothing trails, so a body that was cut or
padded is rejected (IntegrityError) even if it somehow authenticated. Token ids are written as uint16
when all fit (most vocabularies), else int32; little-endian either way.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from privacy.errors import IntegrityError
from privacy.tenants import TenantId

KIND_TENANT = "tenant"  # the sealed tenant record (its name and settings)
KIND_TRAJECTORY = "trajectory"
# Blob kinds (privacy.blobs): index snapshots, corpus parts, hidden-state sets, stored responses.
KIND_SNAPSHOT = "snapshot"
KIND_CORPUS = "corpus"
KIND_HIDDEN = "hidden"
KIND_RESPONSE = "response"
BLOB_KINDS = (KIND_SNAPSHOT, KIND_CORPUS, KIND_HIDDEN, KIND_RESPONSE)
TENANT_RECORD_ID = b"tenant-info"  # the tenant record's id in its associated data

_MAX_TOKEN_ID = 2**31 - 1
_MAX_SESSION_ID_BYTES = 4096
_TRAJ_VERSION = 1


def as_token_ids(token_ids: Sequence[int] | np.ndarray, what: str = "token_ids") -> np.ndarray:
    """A 1-D int32 copy of ``token_ids``; TypeError/ValueError naming the bad value."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_TOKEN_ID:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{what} must be in [0, 2^31), got {bad}")
    return arr.astype(np.int32, copy=True)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One request's tokens as recorded at its end: prompt then output (``num_prompt_tokens`` splits them).

    ``text`` is the decoded output (or whatever text the caller keeps); times are Unix seconds.
    """

    session_id: str
    token_ids: np.ndarray  # [num_tokens] int32
    text: str = ""
    num_prompt_tokens: int = 0
    started_at: float = 0.0
    finished_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str):
            raise TypeError(f"session_id must be a string, got {type(self.session_id).__name__}")
        if len(self.session_id.encode()) > _MAX_SESSION_ID_BYTES:
            raise ValueError(f"session_id is {len(self.session_id.encode())} bytes, at most {_MAX_SESSION_ID_BYTES}")
        if not isinstance(self.text, str):
            raise TypeError(f"text must be a string, got {type(self.text).__name__}")
        ids = as_token_ids(self.token_ids)
        object.__setattr__(self, "token_ids", ids)
        if not 0 <= self.num_prompt_tokens <= len(ids):
            raise ValueError(f"num_prompt_tokens must be in [0, {len(ids)}], got {self.num_prompt_tokens}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return (
            self.session_id == other.session_id
            and np.array_equal(self.token_ids, other.token_ids)
            and self.text == other.text
            and self.num_prompt_tokens == other.num_prompt_tokens
            and self.started_at == other.started_at
            and self.finished_at == other.finished_at
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class TrajectoryRecord:
    """A stored trajectory: ``cursor`` orders records (pass it back as ``after=``), ``record_id`` is hex."""

    cursor: str
    record_id: str
    trajectory: Trajectory


@dataclass(frozen=True, slots=True)
class IndexSnapshot:
    """Serialized index bytes (opaque here) and the cursor of the last trajectory they include."""

    name: str
    data: bytes
    cursor: str
    created_at: float


@dataclass(frozen=True, slots=True)
class CorpusInfo:
    """A named corpus: how many documents and tokens it holds across its parts."""

    name: str
    num_documents: int
    num_tokens: int
    num_parts: int


class _Reader:
    """Bounds-checked reads over a decoded body."""

    __slots__ = ("buf", "pos", "what")

    def __init__(self, buf: bytes, what: str) -> None:
        self.buf, self.pos, self.what = memoryview(buf), 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise IntegrityError(f"{self.what}: body is truncated or its lengths are inconsistent")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise IntegrityError(f"{self.what}: {len(self.buf) - self.pos} unexpected trailing bytes")


_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_TIMES = struct.Struct("<dd")


def _pack_ids(ids: np.ndarray) -> bytes:
    wide = ids.size and int(ids.max()) > 0xFFFF
    data = ids.astype("<i4" if wide else "<u2").tobytes()
    return _U8.pack(4 if wide else 2) + _U32.pack(ids.size) + data


def _unpack_ids(r: _Reader) -> np.ndarray:
    (width,) = r.unpack(_U8)
    (n,) = r.unpack(_U32)
    if width not in (2, 4):
        raise IntegrityError(f"{r.what}: bad token id width {width}")
    raw = r.take(n * width)
    return np.frombuffer(raw, dtype="<i4" if width == 4 else "<u2").astype(np.int32)


def _pack_str(s: str) -> bytes:
    b = s.encode()
    return _U32.pack(len(b)) + b


def _unpack_str(r: _Reader) -> str:
    (n,) = r.unpack(_U32)
    try:
        return bytes(r.take(n)).decode()
    except UnicodeDecodeError:
        raise IntegrityError(f"{r.what}: text is not UTF-8") from None


def encode_trajectory(t: Trajectory) -> bytes:
    """The framed body sealed for a trajectory."""
    return b"".join((
        _U8.pack(_TRAJ_VERSION),
        _pack_str(t.session_id),
        _TIMES.pack(t.started_at, t.finished_at),
        _U32.pack(t.num_prompt_tokens),
        _pack_ids(t.token_ids),
        _pack_str(t.text),
    ))


def decode_trajectory(body: bytes) -> Trajectory:
    """Inverse of :func:`encode_trajectory`; IntegrityError on any framing mismatch."""
    r = _Reader(body, "trajectory")
    (version,) = r.unpack(_U8)
    if version != _TRAJ_VERSION:
        raise IntegrityError(f"trajectory: unknown body version {version}")
    session_id = _unpack_str(r)
    started, finished = r.unpack(_TIMES)
    (num_prompt,) = r.unpack(_U32)
    ids = _unpack_ids(r)
    text = _unpack_str(r)
    r.done()
    return Trajectory(session_id, ids, text, num_prompt, started, finished)


def encode_documents(docs: Sequence[np.ndarray]) -> bytes:
    """Token sequences as: count, per-document lengths, then all ids."""
    lengths = np.array([len(d) for d in docs], dtype="<u4")
    flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int32)
    return _U32.pack(len(docs)) + lengths.tobytes() + _pack_ids(flat)


def decode_documents(body: bytes) -> list[np.ndarray]:
    """Inverse of :func:`encode_documents`."""
    r = _Reader(body, "corpus")
    (count,) = r.unpack(_U32)
    lengths = np.frombuffer(r.take(4 * count), dtype="<u4").astype(np.int64)
    flat = _unpack_ids(r)
    r.done()
    if int(lengths.sum()) != flat.size:
        raise IntegrityError("corpus: document lengths do not add up to the stored tokens")
    return np.split(flat, np.cumsum(lengths)[:-1]) if count else []


def encode_hidden_states(positions: np.ndarray, states: np.ndarray) -> bytes:
    """Count, hidden size, int32 positions, fp16 states (row-major)."""
    n, d = states.shape
    return _U32.pack(n) + _U32.pack(d) + positions.astype("<i4").tobytes() + states.astype("<f2").tobytes()


def decode_hidden_states(body: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_hidden_states`."""
    r = _Reader(body, "hidden states")
    (n,) = r.unpack(_U32)
    (d,) = r.unpack(_U32)
    positions = np.frombuffer(r.take(4 * n), dtype="<i4").astype(np.int32)
    states = np.frombuffer(r.take(2 * n * d), dtype="<f2").astype(np.float16).reshape(n, d)
    r.done()
    return positions, states


@dataclass(frozen=True, slots=True)
class TrajectoryRef:
    """Where an appended trajectory landed: its commit-order ``cursor`` and random ``record_id`` (hex)."""

    cursor: str
    record_id: str


@dataclass(frozen=True, slots=True)
class DeletionReport:
    """``num_records``: trajectories and blobs deleted (or that would be, with ``dry_run``)."""

    tenant: TenantId
    num_records: int
    deleted: bool


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A stored record that failed authentication or parsing. ``kind`` is ``trajectory`` or a blob kind
    (``snapshot``, ``corpus``, ``hidden``, ``response``); ``record_id`` the trajectory's record id or the
    blob's tag (hex); ``cursor`` the trajectory's commit-order position ("" for blobs)."""

    kind: str
    record_id: str
    cursor: str
    reason: str

    def describe(self) -> str:
        where = f" at cursor {self.cursor}" if self.cursor else ""
        return f"{self.kind} {self.record_id}{where}: {self.reason}"


BadRecordCallback = Callable[[BadRecord], None]
