"""A tenant-scoped prefix cache: the KV of finished requests, kept in fixed-size blocks for later requests
of the same tenant whose prompts start with the same tokens (SGLang's RadixAttention and vLLM's automatic
prefix caching, scoped so that no tenant ever starts from KV another tenant's request wrote).

    store [num_blocks, 2, num_layers, num_kv_heads, block_size, head_dim]   (torch.empty: untouched pages
                                                                            cost nothing)

A block holds the KV of ``block_size`` consecutive tokens. Blocks form chains: a block's key is
``(scope, parent block id, its tokens)``, the first block's parent is -1. Keys are exact (the dict hashes
the tuple and compares the tokens), so a chain matches only the very tokens and the very scope that wrote
it; a lookup starts at the scope's first blocks and can reach no other scope's blocks.

The runner copies a matched chain into the request's own slot (``load``) and, when the request ends,
copies the rows that are not cached yet out of the slot into new blocks (``insert``): running requests
never read the store, so the slot pool and its attention stay as they are.

Eviction: whole blocks, leaves first, never a pinned one, and each scope keeps its share. With ``n``
scopes holding blocks (the inserting one counted), each is guaranteed ``num_blocks // n``: a block
another scope needs is taken from the scope holding the most blocks beyond its share, its least
recently used leaf; a scope within its share loses blocks only to its own inserts. So one tenant's
traffic cannot evict another's entries below that share, and what a tenant can learn from its own
evictions is no more than that: its blocks beyond the share may go when others insert. A request pins
the chain it started from (``Lease``) until it ends, so the chain its insert extends is still there. A
chain is touched deepest block first, so a parent is always more recent than its children and a
scope's least recent unpinned block is a leaf.

Thread-safe: the engine thread looks up and inserts; a tenant deletion (``drop``) may come from any
thread. A lease taken before its scope was dropped inserts nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True, eq=False)
class _Block:
    """One cached block (internal). ``refs``: leases pinning it; ``children``: cached blocks after it."""

    index: int  # row of the store
    key: tuple[str, int, tuple[int, ...]]
    parent: _Block | None
    refs: int = 0
    children: int = 0
    live: bool = True  # False once dropped with its scope; freed when the last lease lets go


@dataclass(slots=True)
class Lease:
    """The blocks a running request started from, pinned until ``insert`` or ``release``."""

    scope: str
    epoch: int
    blocks: list[_Block] = field(default_factory=list)
    published: list[_Block] = field(default_factory=list)  # blocks this lease's ``publish`` added

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True, slots=True)
class ScopeStats:
    """One scope's (tenant's) figures: blocks held, and prompt tokens looked up and found."""

    scope: str
    num_blocks: int
    bytes: int
    query_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The whole cache's figures since it was made (token-weighted hit rate, as vLLM's prefix-cache
    counters; dropping a scope leaves the totals as they were)."""

    capacity_bytes: int
    bytes: int
    num_blocks: int
    block_size: int
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    """Blocks of cached KV keyed by scope and tokens, within ``capacity_bytes``."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity_bytes: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.block_size = block_size
        element = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = 2 * num_layers * num_kv_heads * block_size * head_dim * element
        self.num_blocks = capacity_bytes // self.bytes_per_block
        self.capacity_bytes = self.num_blocks * self.bytes_per_block
        shape = (self.num_blocks, 2, num_layers, num_kv_heads, block_size, head_dim)
        self.store = torch.empty(shape, dtype=dtype, device=device)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._index: dict[tuple[str, int, tuple[int, ...]], _Block] = {}
        # scope -> its live blocks by store index, least recent first
        self._scopes: dict[str, OrderedDict[int, _Block]] = {}
        self._num_live = 0
        self._epochs: dict[str, int] = {}
        self._queries: dict[str, list[int]] = {}  # scope -> [query tokens, hit tokens]
        self._totals = [0, 0]  # [query tokens, hit tokens] of every scope ever (never decrease: counters)
        self._evicted = 0
        self._lock = threading.Lock()

    # ---- lookup --------------------------------------------------------------------------------------
    def match(self, scope: str, token_ids: Sequence[int], *, count: int | None = None) -> Lease:
        """Pin and return the longest cached chain of ``scope`` that ``token_ids`` starts with (whole
        blocks only). ``count``: the prompt tokens this lookup stands for in the hit rate (default
        ``len(token_ids)``; 0 for a lookup that is no prompt's, a parked request resuming: not counted)."""
        bs = self.block_size
        with self._lock:
            lease = Lease(scope, self._epochs.get(scope, 0))
            parent = -1
            for start in range(0, len(token_ids) - bs + 1, bs):
                block = self._index.get((scope, parent, tuple(token_ids[start : start + bs])))
                if block is None:
                    break
                block.refs += 1
                lease.blocks.append(block)
                parent = block.index
            self._touch(lease.blocks)
            asked, found = len(token_ids) if count is None else count, len(lease.blocks) * bs
            for figures in (self._queries.setdefault(scope, [0, 0]), self._totals) if asked else ():
                figures[0] += asked
                figures[1] += found
        return lease

    def load(self, lease: Lease, kv: torch.Tensor, slot: int) -> int:
        """Copy the lease's blocks into rows ``[0, n)`` of ``slot`` of the runner's pool
        ``kv [2, L, S, H, R, D]``; returns ``n``, the tokens loaded."""
        bs = self.block_size
        for j, block in enumerate(lease.blocks):  # one copy a block: a gather first would copy twice
            kv[:, :, slot, :, j * bs : (j + 1) * bs].copy_(self.store[block.index])  # [2, L, H, bs, D]
        return lease.num_blocks * bs

    # ---- the end of a request -------------------------------------------------------------------------
    def insert(self, lease: Lease, token_ids: Sequence[int], kv: torch.Tensor, slot: int) -> int:
        """Cache the whole blocks of ``token_ids``, whose KV is in rows ``[0, len)`` of ``slot``, then let
        go of the lease. Blocks already cached are shared, not copied; when the budget is full the least
        recently used unpinned leaves make room, and if none can, the rest is not cached. Returns the
        number of blocks added. Nothing is added for a scope dropped since the lease was taken."""
        with self._lock:
            if self._epochs.get(lease.scope, 0) != lease.epoch:
                self._unpin(lease.blocks)
                return 0
            chain = list(lease.blocks)
            added = self._extend(lease.scope, chain, token_ids)
            self._copy_in(chain, added, kv, slot)
            self._touch(chain)
            self._unpin(chain)
        return len(added)

    def publish(self, lease: Lease, token_ids: Sequence[int], kv: torch.Tensor, slot: int) -> Lease:
        """Cache the whole blocks of a running request's prompt ``token_ids`` (KV in rows ``[0, len)``
        of ``slot``) as ``insert`` does, but keep them pinned: the returned lease holds the chain, and
        ``insert`` at the request's end adds what follows. Requests of the same scope that start while
        this one runs (an agent's parallel trials, a fan-out) then reuse its prompt instead of prefilling
        it again. A scope dropped since the lease was taken publishes nothing."""
        with self._lock:
            if self._epochs.get(lease.scope, 0) != lease.epoch:
                return lease
            chain = list(lease.blocks)
            added = self._extend(lease.scope, chain, token_ids)
            self._copy_in(chain, added, kv, slot)
            self._touch(chain)
            lease.blocks = chain  # the lease's pins and the new ones, one each
            lease.published = added
        return lease

    def release(self, lease: Lease) -> None:
        """Let go of a lease without caching anything (a request that failed, or one whose KV is not to
        be kept): the blocks its ``publish`` added go too, unless another request holds or extends them."""
        with self._lock:
            self._unpin(lease.blocks)
            for block in reversed(lease.published):  # leaves first
                if block.live and block.refs == 0 and block.children == 0:
                    self._forget(block)
                    self._free.append(block.index)
            lease.blocks, lease.published = [], []

    def drop(self, scope: str) -> int:
        """Forget every block of ``scope`` (a deleted tenant): no later lookup finds them, leases taken
        before insert nothing, and pinned blocks are freed when their lease lets go. Returns the blocks
        dropped."""
        with self._lock:
            self._epochs[scope] = self._epochs.get(scope, 0) + 1
            self._queries.pop(scope, None)
            blocks = self._scopes.pop(scope, OrderedDict())
            for index, block in blocks.items():
                del self._index[block.key]
                block.live = False
                if block.refs == 0:
                    self._free.append(index)
            self._num_live -= len(blocks)
            return len(blocks)

    # ---- figures ---------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """The whole cache's figures (Prometheus reads them)."""
        with self._lock:
            return CacheStats(self.capacity_bytes, self._num_live * self.bytes_per_block, self._num_live,
                              self.block_size, self._totals[0], self._totals[1], self._evicted)  # fmt: skip

    def scope_stats(self, scope: str) -> ScopeStats:
        """One scope's figures (the admin plane and the dashboard, per tenant)."""
        with self._lock:
            blocks = len(self._scopes.get(scope, ()))
            queries, hits = self._queries.get(scope, (0, 0))
            return ScopeStats(scope, blocks, blocks * self.bytes_per_block, queries, hits)

    @property
    def bytes_used(self) -> int:
        """Bytes of the store that hold cached blocks."""
        return self._num_live * self.bytes_per_block

    def check_integrity(self) -> None:
        """Assert the invariants (tests): every live block is indexed once, its parent is live, children
        counts are exact, the free list and the live blocks partition the store."""
        with self._lock:
            live = {index: block for blocks in self._scopes.values() for index, block in blocks.items()}
            children: dict[int, int] = {}
            for scope, blocks in self._scopes.items():
                for index, block in blocks.items():
                    assert block.index == index and block.live and self._index[block.key] is block
                    assert block.key[0] == scope
                    if block.parent is not None:
                        assert block.parent.live and block.key[1] == block.parent.index
                        children[block.parent.index] = children.get(block.parent.index, 0) + 1
                    else:
                        assert block.key[1] == -1
            for index, block in live.items():
                assert block.children == children.get(index, 0), (index, block.children)
            assert len(self._index) == len(live) == self._num_live
            assert not set(self._free) & set(live)

    # ---- internals (lock held) ---------------------------------------------------------------------------
    def _extend(self, scope: str, chain: list[_Block], token_ids: Sequence[int]) -> list[_Block]:
        """Append to ``chain`` (in place) the blocks of ``token_ids`` past it, shared where cached,
        allocated where not (until the budget runs out), each pinned once; returns the allocated ones,
        whose KV the caller copies in. Under the lock."""
        bs = self.block_size
        added: list[_Block] = []
        parent = chain[-1].index if chain else -1
        for start in range(len(chain) * bs, len(token_ids) - bs + 1, bs):
            key = (scope, parent, tuple(token_ids[start : start + bs]))
            block = self._index.get(key)
            if block is None:
                index = self._allocate(scope)
                if index is None:
                    break
                block = _Block(index, key, chain[-1] if chain else None)
                if block.parent is not None:
                    block.parent.children += 1
                self._index[key] = block
                self._scopes.setdefault(scope, OrderedDict())[index] = block
                self._num_live += 1
                added.append(block)
            block.refs += 1  # pinned while this insert may still evict
            chain.append(block)
            parent = block.index
        return added

    def _copy_in(self, chain: list[_Block], added: list[_Block], kv: torch.Tensor, slot: int) -> None:
        """Copy the KV of ``added`` (the last blocks of ``chain``) from their rows of ``slot``."""
        bs = self.block_size
        first_row = (len(chain) - len(added)) * bs
        for j, block in enumerate(added):
            rows = slice(first_row + j * bs, first_row + (j + 1) * bs)
            self.store[block.index].copy_(kv[:, :, slot, :, rows])  # [2, L, H, bs, D]

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):  # deepest first: parents end up more recent than their children
            if block.live:
                self._scopes[block.key[0]].move_to_end(block.index)

    def _unpin(self, chain: list[_Block]) -> None:
        for block in chain:
            block.refs -= 1
            if not block.live and block.refs == 0:
                self._free.append(block.index)

    def _allocate(self, scope: str) -> int | None:
        """A store row for a new block of ``scope``: a free one, else the least recently used unpinned
        leaf of the scope most beyond its share (``_victims``); None when every candidate is pinned."""
        if self._free:
            return self._free.pop()
        for victim in self._victims(scope):
            for index, block in self._scopes[victim].items():  # least recent first; leaves before their parents
                if block.refs == 0 and block.children == 0:
                    self._forget(block)
                    self._evicted += 1
                    return index
        return None

    def _victims(self, scope: str) -> list[str]:
        """The scopes ``scope``'s insert may take a block from, the first to lose one first: every scope
        beyond its share (``num_blocks // n`` for the ``n`` scopes holding blocks, ``scope`` counted),
        most beyond first, and ``scope`` itself (first among equals: evicting its own blocks tells no
        one anything)."""
        held = {name: len(blocks) for name, blocks in self._scopes.items() if blocks}
        share = self.num_blocks // len(held.keys() | {scope})
        over = [name for name, n in held.items() if n > share and name != scope]
        return sorted([scope, *over], key=lambda name: (-(held.get(name, 0) - share), name != scope))

    def _forget(self, block: _Block) -> None:
        """Take a live block out of the index (its store row is the caller's to reuse)."""
        blocks = self._scopes[block.key[0]]
        del blocks[block.index]
        if not blocks:
            del self._scopes[block.key[0]]
        del self._index[block.key]
        self._num_live -= 1
        if block.parent is not None:
            block.parent.children -= 1
        block.live = False
