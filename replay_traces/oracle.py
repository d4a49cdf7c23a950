"""The copy-limit oracle (docs/replay.md): the ceiling of every retrieval drafter.

At every step it drafts the longest continuation of the *recorded* response (up to ``max_len`` = 32
tokens) that occurs anywhere in what a retrieval drafter may see: the tenant's earlier prompts and
responses, this prompt, and the output so far. Every path of a suffix-tree or exact-key draft is such a
copy, so no retrieval drafter passes its tau.

What is visible, exactly (one contiguous occurrence, never across two of these sequences):
- each earlier request of the tenant as the one sequence ``prompt + response``;
- this request as ``prompt + output so far`` (an occurrence must end before the current position).

How it is computed (offline, for the whole trace before the replay): a prompt is its trajectory's
message stream up to the call plus the assistant header, so each trajectory is stored once, each of its
tokens stamped with the first call whose prompt contains it; each request adds a short segment (the
last ``max_len - 1`` prompt tokens, the header, the response). For m = 1 .. max_len, every window of m
tokens is hashed (a cyclic-polynomial "buzhash" over a random 64-bit table, salted per tenant); sorting
the hashes gives, per distinct window, the first call that may see it, and, inside a request, where it
first occurs (the sort packs that value into the hash's low bits, keeping >= 40 hash bits). A response position copies m tokens when the window there was visible at that call. Cost:
``max_len`` sorts of the trace's distinct tokens (tens of seconds for 3000 swe_gemini calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replay_traces.tokenizer import CanonicalTokenizer
from replay_traces.traces import Call
from retrieval.draft_tree import DraftTree
from retrieval.prompt_lookup import chain_tree

DEFAULT_MAX_LEN = 32
SOURCE = "oracle"
_NEVER = np.iinfo(np.int64).max


def _rotl1(h: np.ndarray) -> np.ndarray:
    return (h << np.uint64(1)) | (h >> np.uint64(63))


_MAX_VALUE_BITS = 24  # values packed under the hash keep >= 40 bits of hash


def _group_min(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Distinct ``keys`` (sorted), the minimum of ``values`` (>= 0) per key, and the number of low
    key bits dropped: look keys up with ``_lookup(..., shift)``.

    Small values are packed into the low bits of their key so one plain sort (several times faster than
    an argsort) groups the keys and orders each group by value.
    """
    if len(keys) == 0:
        return keys, values, 0
    shift = max(int(values.max()).bit_length(), 1)
    if shift <= _MAX_VALUE_BITS:
        s = np.uint64(shift)
        packed = ((keys >> s) << s) | values.astype(np.uint64)
        packed.sort()
        groups = packed >> s
        starts = np.flatnonzero(np.concatenate(([True], groups[1:] != groups[:-1])))
        low = packed[starts] & np.uint64((1 << shift) - 1)
        return groups[starts], low.astype(np.int64), shift
    order = np.argsort(keys)
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1])))
    return sorted_keys[starts], np.minimum.reduceat(values[order], starts), 0


def _lookup(table: tuple[np.ndarray, np.ndarray, int], keys: np.ndarray, missing: int) -> np.ndarray:
    """The table's value at each of ``keys`` (``missing`` where absent)."""
    table_keys, table_values, shift = table
    out = np.full(len(keys), missing, dtype=np.int64)
    if len(table_keys) == 0 or len(keys) == 0:
        return out
    keys = keys >> np.uint64(shift)
    idx = np.minimum(np.searchsorted(table_keys, keys), len(table_keys) - 1)
    found = table_keys[idx] == keys
    out[found] = table_values[idx[found]]
    return out


@dataclass(frozen=True, slots=True)
class _Layout:
    """All visible token sequences of a trace, concatenated, with per-token metadata."""

    tokens: np.ndarray  # [n] int64 token ids
    seg_end: np.ndarray  # [n] int64 exclusive end of each token's sequence
    visible_from: np.ndarray  # [n] int64 first call that may see a window ending at this token
    tenant: np.ndarray  # [n] int64 tenant number
    request: np.ndarray  # [n] int64 call number of a request segment, -1 in trajectory streams
    response_start: np.ndarray  # [calls] int64 index of each response's first token
    response_len: np.ndarray  # [calls] int64


def _layout(calls: Sequence[Call], tokenizer: CanonicalTokenizer, responses: Sequence[np.ndarray],
            max_len: int) -> _Layout:
    tenants: dict[str, int] = {}
    # A trajectory is one trace line: its calls' prompts are prefixes of one message list.
    lines: dict[tuple[str, int], list[int]] = {}
    for k, call in enumerate(calls):
        lines.setdefault((call.path, call.line_no), []).append(k)
        tenants.setdefault(call.tenant, len(tenants))
    parts: list[np.ndarray] = []
    seg_end: list[np.ndarray] = []
    visible: list[np.ndarray] = []
    tenant_of: list[np.ndarray] = []
    request_of: list[np.ndarray] = []
    response_start = np.zeros(len(calls), dtype=np.int64)
    response_len = np.zeros(len(calls), dtype=np.int64)
    offset = 0
    header = tokenizer.prompt_ids(())
    tail_len = max_len - 1
    seen_messages: set[tuple[int, str, str]] = set()

    def add(ids: np.ndarray, vis: np.ndarray | int, tenant: int, request: int) -> int:
        nonlocal offset
        n = len(ids)
        parts.append(ids.astype(np.int64))
        seg_end.append(np.full(n, offset + n, dtype=np.int64))
        visible.append(np.broadcast_to(np.asarray(vis, dtype=np.int64), (n,)))
        tenant_of.append(np.full(n, tenant, dtype=np.int64))
        request_of.append(np.full(n, request, dtype=np.int64))
        start = offset
        offset += n
        return start

    for ks in lines.values():
        last = calls[ks[-1]]
        tenant = tenants[last.tenant]
        # Message j becomes visible with the first call whose prompt holds it (prompts grow).
        message_ids = [tokenizer.message_ids(m.role, m.content) for m in last.messages]
        first_call = np.empty(len(message_ids), dtype=np.int64)
        j = 0
        for k in ks:
            while j < calls[k].message_index and j < len(message_ids):
                first_call[j] = k
                j += 1
        stream = np.concatenate(message_ids) if message_ids else header[:0]
        stream_vis = np.repeat(first_call, [len(m) for m in message_ids])
        ends = np.cumsum([0] + [len(m) for m in message_ids])
        # A message the tenant already showed (same role and content, earlier or as early) adds no new
        # window except where it meets its neighbours: keep its first and last max_len - 1 tokens and
        # cut the stream in between (agents resend the same system prompt and examples every session).
        piece_start = 0
        for j, m in enumerate(last.messages):
            key = (tenant, m.role, m.content)
            if key not in seen_messages:
                seen_messages.add(key)
                continue
            lo, hi = int(ends[j]) + tail_len, int(ends[j + 1]) - tail_len
            if hi - lo > 0:
                add(stream[piece_start:lo], stream_vis[piece_start:lo], tenant, -1)
                piece_start = hi
        add(stream[piece_start:], stream_vis[piece_start:], tenant, -1)
        for k in ks:
            end = int(ends[calls[k].message_index])
            tail = stream[max(0, end - tail_len) : end]
            request_ids = np.concatenate((tail, header, responses[k]))
            start = add(request_ids, k + 1, tenant, k)
            response_start[k] = start + len(tail) + len(header)
            response_len[k] = len(responses[k])
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt))
    return _Layout(
        tokens=cat(parts, np.int64), seg_end=cat(seg_end, np.int64), visible_from=cat(visible, np.int64),
        tenant=cat(tenant_of, np.int64), request=cat(request_of, np.int64),
        response_start=response_start, response_len=response_len,
    )


def _segment_starts(seg_end: np.ndarray) -> np.ndarray:
    """[n] start index of each token's sequence, from the sequences' exclusive ends."""
    if len(seg_end) == 0:
        return seg_end
    new = np.concatenate(([True], seg_end[1:] != seg_end[:-1]))
    first = np.flatnonzero(new)
    return np.repeat(first, np.diff(np.concatenate((first, [len(seg_end)]))))


def copy_limits(calls: Sequence[Call], tokenizer: CanonicalTokenizer, *, max_len: int = DEFAULT_MAX_LEN,
                seed: int = 0) -> list[np.ndarray]:
    """Per call, ``limits[k][p]`` = the longest copy (<= ``max_len``) of ``response[p:]`` visible when
    position p of call k is decoded. ``calls`` must be in file order (as the replay sees them)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    responses = [tokenizer.response_ids(c.response) for c in calls]
    lay = _layout(calls, tokenizer, responses, max_len)
    n = len(lay.tokens)
    num_queries = int(lay.response_len.sum())
    if num_queries == 0:
        return [np.zeros(0, dtype=np.int64) for _ in calls]
    rng = np.random.default_rng(seed)
    top = np.iinfo(np.uint64).max
    table = rng.integers(0, top, size=int(lay.tokens.max()) + 1, dtype=np.uint64, endpoint=True)
    tenant_salt = rng.integers(0, top, size=int(lay.tenant.max()) + 1, dtype=np.uint64, endpoint=True)
    request_salt = rng.integers(0, top, size=len(calls), dtype=np.uint64, endpoint=True)
    # Queries: every response token: its call, its position in the layout, the end of its response.
    q_call = np.repeat(np.arange(len(calls), dtype=np.int64), lay.response_len)
    q_pos = np.repeat(lay.response_start - np.concatenate(([0], np.cumsum(lay.response_len)[:-1])),
                      lay.response_len) + np.arange(num_queries, dtype=np.int64)
    q_end = (lay.response_start + lay.response_len)[q_call]
    positions = np.arange(n, dtype=np.int64)
    room = lay.seg_end - positions  # tokens from here to the end of the sequence
    in_request = lay.request >= 0
    offset_in_seg = positions - _segment_starts(lay.seg_end)
    t_salt = tenant_salt[lay.tenant]
    r_salt = np.where(in_request, request_salt[np.maximum(lay.request, 0)], np.uint64(0))
    limit = np.zeros(num_queries, dtype=np.int64)
    alive = np.arange(num_queries)  # queries whose every shorter window matched
    h = np.zeros(n, dtype=np.uint64)
    hashed = table[lay.tokens]
    for m in range(1, max_len + 1):
        count = n - m + 1
        if count <= 0:
            break
        h = _rotl1(h[:count]) ^ hashed[m - 1 :]
        valid = room[:count] >= m
        # History: the first call that may see each distinct window of this tenant.
        history = _group_min(h[valid] ^ t_salt[:count][valid], lay.visible_from[m - 1 :][valid])
        # This request: where each distinct window of the request segment first starts (relative to
        # the segment, which keeps the packed values small).
        own = valid & in_request[:count]
        own_table = _group_min(h[own] ^ r_salt[:count][own], offset_in_seg[:count][own])
        qi = alive[q_pos[alive] + m <= q_end[alive]]
        qp = q_pos[qi]
        hq = h[qp]
        seen_before = _lookup(history, hq ^ t_salt[qp], _NEVER) <= q_call[qi]
        first_here = _lookup(own_table, hq ^ r_salt[qp], _NEVER)
        seen_here = (first_here != _NEVER) & (first_here + m <= offset_in_seg[qp])
        alive = qi[seen_before | seen_here]
        limit[alive] = m
        if len(alive) == 0:
            break
    bounds = np.cumsum(lay.response_len)[:-1]
    return list(np.split(limit, bounds))


class _OracleSession:
    __slots__ = ("_limits", "_pos", "_response")

    def __init__(self, response: np.ndarray, limits: np.ndarray) -> None:
        self._response = response
        self._limits = limits
        self._pos = 0

    def propose(self, budget: int) -> DraftTree:
        pos = self._pos
        if pos >= len(self._limits):
            return DraftTree.empty(SOURCE)
        n = min(int(self._limits[pos]), budget)
        return chain_tree(self._response[pos : pos + n], SOURCE)

    def commit(self, verified) -> None:
        self._pos += len(verified.token_ids)

    def finish(self, record: bool = True) -> None:
        pass


class CopyLimitOracle:
    """A ``Proposer`` that replays precomputed copy limits; its calls must arrive in the given order."""

    def __init__(self, calls: Sequence[Call], tokenizer: CanonicalTokenizer, *, max_len: int = DEFAULT_MAX_LEN) -> None:
        self._calls = list(calls)
        self._limits = copy_limits(self._calls, tokenizer, max_len=max_len)
        self._responses = [tokenizer.response_ids(c.response) for c in self._calls]
        self._prompt_lens = [len(tokenizer.prompt_ids(c.messages)) for c in self._calls]
        self._next = 0

    def begin(self, tenant: str, session_id: str, prompt_ids, request_id: str = "") -> _OracleSession:
        k = self._next
        if k >= len(self._calls):
            raise ValueError(f"oracle: request beyond the {len(self._calls)} calls it was built for")
        call = self._calls[k]
        if (tenant, session_id, len(prompt_ids)) != (call.tenant, call.session, self._prompt_lens[k]):
            raise ValueError(f"oracle: request {k} does not match {call.path}:{call.line_no}: out of order")
        self._next += 1
        return _OracleSession(self._responses[k], self._limits[k])
