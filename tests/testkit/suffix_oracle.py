"""Brute-force model of SuffixIndex for property tests: substring counts by enumeration, drafts by the
definitions in suffix_index.index, the exact-key rules, and the arena order that decides "newest".

Only for small inputs (tens to hundreds of tokens, small max_depth).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter

MIN_EXTEND_CAPACITY = 64


class Oracle:
    def __init__(self, max_depth: int, key_lengths: tuple[int, ...]) -> None:
        self.depth = max_depth
        self.keys = tuple(sorted(set(key_lengths)))
        self.seqs: dict[int, list[int]] = {}
        self.created: list[int] = []  # ids, creation order
        # Arena order decides the "newest" occurrence: a sequence moves to the end of the arena when it
        # outgrows its reserved room (add: its length + 1; extend: doubling, at least 64).
        self.arena: list[int] = []
        self.cap: dict[int, int] = {}
        self._counts: Counter | None = None

    # ---- mutations ----
    def add(self, seq_id: int, tokens: list[int]) -> None:
        assert seq_id not in self.seqs
        self.seqs[seq_id] = list(tokens)
        self.created.append(seq_id)
        self.arena.append(seq_id)
        self.cap[seq_id] = len(tokens) + 1
        self._counts = None

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        n = len(tokens)
        if seq_id not in self.seqs:
            self.seqs[seq_id] = []
            self.created.append(seq_id)
            self.arena.append(seq_id)
            self.cap[seq_id] = max(MIN_EXTEND_CAPACITY, 2 * n + 1)
        if n == 0:
            return
        cur = len(self.seqs[seq_id])
        if cur + n + 1 > self.cap[seq_id]:
            self.cap[seq_id] = max(MIN_EXTEND_CAPACITY, 2 * (cur + n) + 1)
            self.arena.remove(seq_id)
            self.arena.append(seq_id)
        self.seqs[seq_id].extend(tokens)
        self._counts = None

    def remove(self, seq_id: int) -> None:
        del self.seqs[seq_id]
        self.created.remove(seq_id)
        self.arena.remove(seq_id)
        del self.cap[seq_id]
        self._counts = None

    # ---- substrings ----
    @property
    def counts(self) -> Counter:
        """count(s) for every indexed string s (1 <= len(s) <= max_depth)."""
        if self._counts is None:
            c: Counter = Counter()
            for seq in self.seqs.values():
                for i in range(len(seq)):
                    for L in range(1, min(self.depth, len(seq) - i) + 1):
                        c[tuple(seq[i : i + L])] += 1
            self._counts = c
        return self._counts

    def count(self, s: tuple[int, ...]) -> int:
        return self.counts.get(tuple(s), 0)

    def children(self, s: tuple[int, ...]) -> dict[int, int]:
        """Next token -> count(s + token), for len(s) < max_depth."""
        if len(s) >= self.depth:
            return {}
        out: dict[int, int] = {}
        for seq in self.seqs.values():
            for i in range(len(seq) - len(s)):
                if tuple(seq[i : i + len(s)]) == s:
                    out[seq[i + len(s)]] = out.get(seq[i + len(s)], 0) + 1
        return out

    def num_nodes(self) -> int:
        """Nodes of the canonical trie besides the root and the inline (count-1) leaves: strings with
        >= 2 occurrences that branch or are the whole suffix of some position."""
        n = 0
        for s, c in self.counts.items():
            if c < 2:
                continue
            kids = self.children(s)
            ends = c - sum(kids.values())
            if len(kids) >= 2 or ends > 0:
                n += 1
        return n

    def num_keys(self, k: int) -> int:
        return sum(1 for s in self.counts if len(s) == k)

    # ---- drafting ----
    def _draft_path(self, s0: tuple[int, ...], budget: int, min_prob: float) -> list[tuple[int, int, float]]:
        c0 = self.count(s0)
        s, out = s0, []
        while len(out) < budget and len(s) < self.depth:
            kids = self.children(s)
            if not kids:
                break
            t = min(kids, key=lambda tok: (-kids[tok], tok))
            p = kids[t] / c0
            if p < min_prob:
                break
            out.append((t, len(out) - 1, p))
            s = s + (t,)
        return out

    def _draft_tree(self, s0: tuple[int, ...], budget: int, min_prob: float) -> list[tuple[int, int, float]]:
        c0 = self.count(s0)
        heap: list = []
        seq = 0

        def expand(s: tuple[int, ...], parent: int) -> None:
            nonlocal seq
            if len(s) >= self.depth:
                return
            for t, c in sorted(self.children(s).items(), key=lambda kv: (-kv[1], kv[0])):
                p = c / c0
                if p < min_prob:
                    break
                heapq.heappush(heap, (-p, seq, s + (t,), parent, t))
                seq += 1

        expand(s0, -1)
        out: list[tuple[int, int, float]] = []
        while heap and len(out) < budget:
            negp, _, s, parent, t = heapq.heappop(heap)
            out.append((t, parent, -negp))
            expand(s, len(out) - 1)
        return out

    def speculate(
        self,
        context: list[int],
        max_tokens: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_prob: float = 0.1,
        use_tree: bool = False,
    ) -> tuple[list[tuple[int, int, float]], float, int]:
        """(nodes as (token, parent, prob), score, match_len) per the SuffixIndex.speculate docstring."""
        ctx = tuple(context)
        longest = 0
        for m in range(1, min(len(ctx), self.depth) + 1):
            if self.count(ctx[len(ctx) - m :]) > 0:
                longest = m
        best: tuple[list, float, int] = ([], 0.0, longest)
        for m in range(longest, 0, -1):
            raw = math.floor(m * factor + offset)
            budget = 0 if not raw > 0 else min(max_tokens, raw)
            if budget == 0:
                continue
            s0 = ctx[len(ctx) - m :]
            nodes = (self._draft_tree if use_tree else self._draft_path)(s0, budget, min_prob)
            score = 0.0
            for _, _, p in nodes:
                score += p
            if score > best[1]:
                best = (nodes, score, m)
        return best

    def _arena_rank(self, seq_id: int) -> int:
        return self.arena.index(seq_id)

    def speculate_exact(
        self, context: list[int], max_tokens: int, min_key_len: int = 0
    ) -> tuple[list[int], list[float], float, int]:
        """(token_ids, probs, score, match_len) per the SuffixIndex.speculate_exact docstring."""
        ctx = tuple(context)
        for k in sorted(self.keys, reverse=True):
            if k > len(ctx) or k < min_key_len:
                continue
            key = ctx[len(ctx) - k :]
            occ = [
                (self._arena_rank(q), i, q)
                for q, seq in self.seqs.items()
                for i in range(len(seq) - k)
                if tuple(seq[i : i + k]) == key
            ]
            if not occ:
                continue
            _, i, q = max(occ)
            seq = self.seqs[q]
            cont = seq[i + k : i + k + max_tokens]
            c_cont = len(occ)
            probs: list[float] = []
            exact = 0
            first = last = 0.0
            rate = 1.0
            for j in range(len(cont)):
                if exact == j and k + j + 1 <= self.depth:
                    p = self.count(key + tuple(cont[: j + 1])) / c_cont
                    first = p if exact == 0 else first
                    last = p
                    exact += 1
                else:
                    if exact == j and exact >= 2 and first > 0:
                        rate = math.pow(last / first, 1.0 / (exact - 1))
                    p = last * math.pow(rate, j + 1 - exact)
                probs.append(p)
            score = 0.0
            for p in probs:
                score += p
            return cont, probs, score, k
        return [], [], 0.0, 0
