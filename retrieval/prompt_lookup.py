"""Prompt lookup: the n-gram baseline over the request's own prompt and output (no history).

Semantics are vLLM's ``method: "ngram"`` proposer (vllm/v1/spec_decode/ngram_proposer.py): find the
longest n in ``[min_n, max_n]`` such that the context's last n tokens occur earlier in the context
(the occurrence must end before the last token; it may overlap the suffix); of the occurrences of that
n-gram take the earliest; propose the up to ``k`` tokens that follow it, cut at the end of the context.
Prompt lookup decoding: Saxena 2023 (apoorvumang/prompt-lookup-decoding); vLLM runs KMP on the reversed
context, we run the equivalent vectorised scan (one numpy comparison over the context per step, then
at most ``max_n - 1`` filters of the candidates), O(context) per step like vLLM.

Defaults: ``min_n = max_n = 5`` are vLLM's when neither ``prompt_lookup_min`` nor ``prompt_lookup_max``
is set; vLLM has no default for ``k`` (``num_speculative_tokens``), here it is the step's budget. The
project baseline in the figures (docs/replay.md, "prompt lookup (n 2-5)") is min_n 2,
max_n 5: that is the registry's ``prompt_lookup``; ``prompt_lookup_vllm`` keeps vLLM's 5-5.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from retrieval.draft_tree import DraftTree
from retrieval.session import Verified

VLLM_MIN_N = 5
VLLM_MAX_N = 5
SOURCE = "prompt_lookup"

_EMPTY = np.zeros(0, dtype=np.int32)
_MAX_CHAIN = 4096
# Shared read-only arrays for chain trees: parents of node i is i-1; every prob is 1.0 (a copy from the
# context has no confidence model; the verifier decides).
_CHAIN_PARENTS = np.arange(-1, _MAX_CHAIN - 1, dtype=np.int32)
_CHAIN_PARENTS.flags.writeable = False
_ONES = np.ones(_MAX_CHAIN, dtype=np.float32)
_ONES.flags.writeable = False


_EMPTY_TREE = DraftTree.empty(SOURCE)  # frozen and shared: most steps of a miss-heavy trace return it


def _check_n(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def ngram_continuation(context: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to ``k`` tokens vLLM's n-gram proposer drafts after ``context`` (empty if no match).

    ``context``: [num_tokens] integer array. Returns a view into ``context``.
    """
    num_tokens = len(context)
    if k <= 0 or num_tokens < max(min_n, 2):
        return context[:0]
    # Occurrences of the last token, identified by where they end (always before the last position).
    ends = (context[: num_tokens - 1] == context[num_tokens - 1]).nonzero()[0]
    if ends.size == 0:
        return context[:0]
    n = 1
    # Grow the match leftwards while some occurrence still agrees; candidates stay sorted by position.
    while n < max_n and n < num_tokens - 1:
        fits = ends[ends >= n]  # the longer occurrence must start inside the context
        longer = fits[context[fits - n] == context[num_tokens - 1 - n]]
        if longer.size == 0:
            break
        ends = longer
        n += 1
    if n < min_n:
        return context[:0]
    start = int(ends[0]) + 1  # earliest occurrence of the longest matching n-gram
    return context[start : start + k]


def chain_tree(token_ids: np.ndarray, source: str = SOURCE) -> DraftTree:
    """A chain DraftTree over ``token_ids`` (copied) with probs 1 and score = its length."""
    n = len(token_ids)
    if n == 0:
        return _EMPTY_TREE if source == SOURCE else DraftTree.empty(source)
    if n > _MAX_CHAIN:
        return DraftTree.chain(token_ids, source=source)
    return DraftTree(
        np.array(token_ids, dtype=np.int32), _CHAIN_PARENTS[:n], _ONES[:n], float(n), source
    )


class PromptLookupSession:
    """One request: prompt plus committed tokens in a growing buffer, looked up every step."""

    __slots__ = ("_buf", "_len", "finished", "max_n", "min_n")

    def __init__(self, prompt_ids: Sequence[int] | np.ndarray, min_n: int, max_n: int) -> None:
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        self._buf = np.empty(max(2 * len(prompt), 1024), dtype=np.int32)
        self._buf[: len(prompt)] = prompt
        self._len = len(prompt)
        self.min_n = min_n
        self.max_n = max_n
        self.finished = False

    def propose(self, budget: int) -> DraftTree:
        """The n-gram continuation of prompt + committed tokens, at most ``budget`` nodes."""
        return chain_tree(ngram_continuation(self._buf[: self._len], self.min_n, self.max_n, budget))

    def commit(self, verified: Verified) -> None:
        ids = np.asarray(verified.token_ids, dtype=np.int32)
        end = self._len + len(ids)
        if end > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), end), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : end] = ids
        self._len = end

    def finish(self, record: bool = True) -> None:
        """Nothing to record: prompt lookup keeps no history."""
        self.finished = True

    @property
    def context(self) -> np.ndarray:
        """Prompt plus committed tokens (a read-only view)."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view


class PromptLookupProposer:
    """``Proposer`` for prompt lookup: each request drafts from its own prompt and output only."""

    def __init__(self, min_n: int = VLLM_MIN_N, max_n: int = VLLM_MAX_N) -> None:
        _check_n(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def begin(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray, request_id: str = ""
    ) -> PromptLookupSession:
        return PromptLookupSession(prompt_ids, self.min_n, self.max_n)
