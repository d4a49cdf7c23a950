"""Typed facade over the native suffix index (``suffix_index._native``).

``SuffixIndex`` holds token sequences (a tenant's past trajectories, or one request's prompt and
output) in a depth-capped suffix trie with occurrence counts (SuffixDecoding, arXiv 2411.04975) plus an
exact-key index, and drafts continuations of a context from them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from suffix_index import _native

_INT32 = np.dtype(np.int32)
_MAX_TOKEN_ID = 2**31 - 1
_MAX_TOKENS_PER_DRAFT = 2**31 - 1
DEFAULT_KEY_LENGTHS = (4, 8, 16)
MAX_DEPTH_LIMIT: int = _native.MAX_DEPTH_LIMIT

TokenArray = np.ndarray  # 1-D int32
TokensLike = TokenArray | Sequence[int] | Iterable[int]


def _empty(dtype: type) -> np.ndarray:
    a: np.ndarray = np.zeros(0, dtype=dtype)
    a.flags.writeable = False
    return a


_EMPTY_I32 = _empty(np.int32)
_EMPTY_F32 = _empty(np.float32)


@dataclass(frozen=True, slots=True, eq=False)
class Draft:
    """A draft tree continuing a context (the ``DraftTree`` contract of docs/architecture.md).

    ``parents[i]`` is -1 (child of the context's last token) or an index ``< i``; ``probs[i]`` is the
    estimated probability that node i is accepted (its string's share of the matched context's
    occurrences); ``score`` = ``sum(probs)``, the expected number of accepted tokens; ``match_len`` is
    how many context tokens the draft's match used (for an empty draft: the longest match found, 0 when
    nothing matched). Empty drafts share read-only empty arrays.
    """

    token_ids: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # [n] int32
    parents: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # [n] int32
    probs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)  # [n] float32
    score: float = 0.0
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)


def as_tokens(values: TokensLike, name: str = "tokens") -> np.ndarray:
    """``values`` as a 1-D C-contiguous int32 array, without a copy when it already is one.

    Raises TypeError for non-integer data (floats, bools, strings) and ValueError naming the first id
    outside [0, 2**31) or a shape that is not 1-D.
    """
    if (
        type(values) is np.ndarray
        and values.dtype == _INT32
        and values.ndim == 1
        and values.flags.c_contiguous
    ):
        return values  # negative ids are rejected natively
    if isinstance(values, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(values).__name__}")
    if isinstance(values, np.ndarray):
        arr = values
    else:
        try:
            arr = np.asarray(values if hasattr(values, "__len__") else list(values))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be a sequence of int token ids: {exc}") from None
        if arr.size == 0 and arr.ndim == 1:
            return np.zeros(0, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "O":
        ints = []
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"{name}[{i}] = {v!r} is not an int token id")
            ints.append(operator.index(v))
        for i, v in enumerate(ints):
            if not 0 <= v <= _MAX_TOKEN_ID:
                raise ValueError(f"token id {v} at index {i} of {name} is outside [0, 2**31)")
        return np.array(ints, dtype=np.int32)
    if kind not in "iu":
        if not isinstance(values, np.ndarray):  # name the first element that is not an int
            for i, v in enumerate(values if hasattr(values, "__len__") else arr.tolist()):
                if isinstance(v, (bool, np.bool_)) or not hasattr(v, "__index__"):
                    raise TypeError(f"{name}[{i}] = {v!r} is not an int token id")
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.size:
        bad = (arr < 0) | (arr > _MAX_TOKEN_ID) if arr.dtype.itemsize >= 4 else None
        if bad is not None and bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"token id {int(arr[i])} at index {i} of {name} is outside [0, 2**31)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _check_real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _check_int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    v = operator.index(value)  # type: ignore[arg-type]
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _check_id(seq_id: object) -> int:
    return _check_int(seq_id, "seq_id", 0, 2**63 - 1)


class SuffixIndex:
    """Token sequences indexed for drafting: a suffix trie with counts plus an exact-key index.

    ``max_depth`` caps the indexed substring length (a draft plus its match never exceeds it);
    ``max_bytes`` is a memory budget (0: none): after an ``add``/``extend`` pushes ``memory_bytes()``
    over it, the oldest sequences (creation order) are evicted, never the one just written;
    ``key_lengths`` are the exact-key lengths k (each in [1, max_depth - 1]; None: (4, 8, 16) without
    those >= max_depth; () disables the exact-key index).

    Threading: every method may be called from any thread. The native index holds a reader-writer
    lock and releases the GIL: any number of ``speculate``/``speculate_exact``/read calls run in
    parallel; ``add``/``extend``/``remove`` (and eviction) run alone.
    """

    __slots__ = ("_ix",)

    def __init__(
        self, max_depth: int = 64, max_bytes: int = 0, key_lengths: Iterable[int] | None = None
    ) -> None:
        max_depth = _check_int(max_depth, "max_depth", 1, MAX_DEPTH_LIMIT)
        max_bytes = _check_int(max_bytes, "max_bytes", 0, 2**63 - 1)
        if key_lengths is None:
            keys = [k for k in DEFAULT_KEY_LENGTHS if k < max_depth]
        else:
            if isinstance(key_lengths, (str, bytes)) or not hasattr(key_lengths, "__iter__"):
                raise TypeError(f"key_lengths must be a sequence of ints, got {type(key_lengths).__name__}")
            keys = [_check_int(k, "key length", 1, max(1, max_depth - 1)) for k in key_lengths]
            if max_depth == 1 and keys:
                raise ValueError("max_depth 1 leaves no room for exact keys; pass key_lengths=()")
        if len(set(keys)) > _native.MAX_KEY_LENGTHS:
            raise ValueError(f"at most {_native.MAX_KEY_LENGTHS} key lengths, got {sorted(set(keys))}")
        self._ix = _native.SuffixIndex(max_depth, max_bytes, sorted(set(keys)))

    @classmethod
    def _wrap(cls, native: _native.SuffixIndex) -> SuffixIndex:
        obj = cls.__new__(cls)
        obj._ix = native
        return obj

    # ---- mutations ----
    def add(self, seq_id: int, tokens: TokensLike) -> int:
        """Index a new sequence; ValueError if ``seq_id`` exists. Returns how many sequences the byte
        budget evicted."""
        return self._ix.add(seq_id if type(seq_id) is int else _check_id(seq_id), tokens)

    def extend(self, seq_id: int, tokens: TokensLike) -> int:
        """Append tokens to a sequence (a request growing), creating it when new. Returns how many
        sequences the byte budget evicted."""
        return self._ix.extend(seq_id if type(seq_id) is int else _check_id(seq_id), tokens)

    def remove(self, seq_id: int) -> None:
        """Forget a sequence entirely (the index is then exactly as if it had never been added);
        ValueError naming the id when it is unknown or already removed."""
        self._ix.remove(seq_id if type(seq_id) is int else _check_id(seq_id))

    # ---- drafting ----
    def speculate(
        self,
        context: TokensLike,
        max_tokens: int,
        *,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        use_tree: bool = False,
    ) -> Draft:
        """Draft a continuation of ``context`` from the trie (SuffixDecoding's speculation).

        Every match length m = 1 .. min(len(context), max_depth) of the context's end is tried with
        at most ``min(max_tokens, floor(m * max_spec_factor + max_spec_offset))`` tokens: a path along
        the most frequent child (``use_tree=False``) or a best-first tree by probability; tokens below
        ``min_token_prob`` stop it. The highest score wins, ties to the longer match. ValueError for
        ``max_tokens < 1``, a negative or non-finite factor, a non-finite offset, or
        ``min_token_prob`` outside [0, 1].
        """
        if type(max_tokens) is not int:
            max_tokens = _check_int(max_tokens, "max_tokens", 1, _MAX_TOKENS_PER_DRAFT)
        if type(max_spec_factor) is not float:
            max_spec_factor = _check_real(max_spec_factor, "max_spec_factor")
        if type(max_spec_offset) is not float:
            max_spec_offset = _check_real(max_spec_offset, "max_spec_offset")
        if type(min_token_prob) is not float:
            min_token_prob = _check_real(min_token_prob, "min_token_prob")
        return self._ix.speculate(
            context, max_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree is True
        )

    def speculate_exact(
        self, context: TokensLike, max_tokens: int, *, min_key_len: int | None = None
    ) -> Draft:
        """Draft from the exact-key index: the longest key length k (>= ``min_key_len``) whose key, the
        context's last k tokens, is indexed with a continuation; copy up to ``max_tokens`` tokens that
        followed the key's newest occurrence (a chain, not limited by ``max_depth``).

        ``probs[i]`` = count(key + draft[:i+1]) / (occurrences of the key followed by a token), exact
        while k + i + 1 <= max_depth; past the trie's depth the last exact value decays geometrically
        at the mean per-token rate of the exact part (no decay when the exact part never dropped).
        """
        if type(max_tokens) is not int:
            max_tokens = _check_int(max_tokens, "max_tokens", 1, _MAX_TOKENS_PER_DRAFT)
        lo = 0 if min_key_len is None else _check_int(min_key_len, "min_key_len", 1, 2**31 - 1)
        return self._ix.speculate_exact(context, max_tokens, lo)

    # ---- inspection ----
    @property
    def num_sequences(self) -> int:
        return self._ix.num_sequences

    @property
    def num_tokens(self) -> int:
        """Indexed tokens over all sequences."""
        return self._ix.num_tokens

    @property
    def max_depth(self) -> int:
        return self._ix.max_depth

    @property
    def max_bytes(self) -> int:
        return self._ix.max_bytes

    @property
    def key_lengths(self) -> tuple[int, ...]:
        return tuple(self._ix.key_lengths)

    def count(self, tokens: TokensLike) -> int:
        """Occurrences of the token string in the indexed sequences (never across two of them);
        ValueError for strings longer than ``max_depth``, which the trie does not count. The empty
        string occurs once per indexed token."""
        arr = as_tokens(tokens)
        if len(arr) > self.max_depth:
            raise ValueError(
                f"strings longer than max_depth={self.max_depth} are not counted, got {len(arr)} tokens"
            )
        return self._ix.count(arr)

    def memory_bytes(self) -> int:
        """Bytes of live index data (nodes, child arrays, tokens, exact keys at their nominal load);
        the quantity ``max_bytes`` bounds. Freed capacity the index reuses is not counted."""
        return self._ix.memory_bytes()

    def check_integrity(self) -> None:
        """Recompute every invariant (counts, canonical shape, newest occurrences, exact keys);
        RuntimeError naming the first violation. O(nodes + tokens * max_depth)."""
        self._ix.check_integrity()

    def stats(self) -> dict[str, int]:
        """Internal counters (nodes, child slots, keys per length, arena size, ...)."""
        return dict(self._ix.stats())

    def sequence_ids(self) -> np.ndarray:
        """Ids of the indexed sequences, oldest (creation order) first, as int64."""
        return self._ix.sequence_ids()

    def get_sequence(self, seq_id: int) -> np.ndarray:
        """A copy of a sequence's tokens (int32); ValueError naming the id when unknown."""
        return self._ix.get_sequence(_check_id(seq_id))

    def __contains__(self, seq_id: object) -> bool:
        if isinstance(seq_id, bool) or not hasattr(seq_id, "__index__"):
            return False
        v = operator.index(seq_id)  # type: ignore[arg-type]
        return v >= 0 and self._ix.contains(v)

    def __len__(self) -> int:
        return self._ix.num_sequences

    def __repr__(self) -> str:
        return (
            f"SuffixIndex(max_depth={self.max_depth}, max_bytes={self.max_bytes}, key_lengths={self.key_lengths}, "
            f"sequences={self.num_sequences}, tokens={self.num_tokens})"
        )

    # ---- persistence ----
    def serialize(self) -> bytes:
        """Versioned, checksummed bytes; ``SuffixIndex.deserialize`` rebuilds an identical index."""
        return self._ix.serialize()

    @classmethod
    def deserialize(cls, data: bytes | bytearray | memoryview) -> SuffixIndex:
        """Rebuild an index from ``serialize()`` output. ValueError for corrupt, truncated or
        wrong-version bytes; TypeError for non-bytes."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        return cls._wrap(_native.SuffixIndex.deserialize(bytes(data)))

    def __reduce__(self):
        return (SuffixIndex.deserialize, (self.serialize(),))


_native._register(Draft, as_tokens, _EMPTY_I32, _EMPTY_F32)
