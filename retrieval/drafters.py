"""The single-source drafters, for comparison and for tenants that want only one kind of draft.

``RepriseProposer`` (retrieval/proposer.py) is the one the service uses: it merges every source below
into one calibrated tree. These proposers keep one mechanism each, with the same session lifecycle:

- ``SuffixDecodingProposer``: SuffixDecoding's semantics (arXiv 2411.04975; arctic-inference 0.3.0's
  ``SuffixDecodingCache``) on Reprise's index, as the in-project anchor: a tree over the request's
  prompt and output and one over the tenant's past responses, each speculated with count-ratio
  probabilities, the higher score of the two wins (either-or). It matches every context length (the
  anchor's loop stops one short).
- ``ExactKeyProposer``: the exact-key index alone: the longest of the last k tokens (k in the index's
  key lengths) found in the request or the tenant's responses, and a copy of what followed its newest
  occurrence, past the trie's depth.

The corpus-only (REST-style) and suffix-only (request + history, merged by score) drafters are
``RepriseProposer`` configurations (see ``retrieval.registry``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np

from retrieval.config import DraftingConfig
from retrieval.draft_tree import DraftTree
from retrieval.session import Verified
from suffix_index import SuffixIndex, as_tokens

#: vLLM 0.32.0's `suffix` method as it runs by default (``vllm/config/speculative.py``): tree depth 24,
#: spec factor 1.0, min token prob 0.1, 10,000 cached requests, one path per step.
VLLM_SUFFIX_DEPTH = 24
VLLM_SUFFIX_MAX_SPEC_FACTOR = 1.0
VLLM_SUFFIX_MIN_TOKEN_PROB = 0.1
VLLM_SUFFIX_MAX_CACHED_REQUESTS = 10_000


class _TenantResponses:
    """A tenant's past responses in one index (sequence per response), at most ``max_requests`` of
    them (the oldest leave first, as arctic's ``max_cached_requests``; 0: no limit)."""

    def __init__(self, config: DraftingConfig, max_requests: int = 0) -> None:
        self.index = SuffixIndex(max_depth=config.max_depth, max_bytes=config.history_max_bytes)
        self.next_id = 0
        self._max_requests = max_requests
        self._ids: deque[int] = deque()

    def new_id(self) -> int:
        seq = self.next_id
        self.next_id += 1
        if self._max_requests:
            self._ids.append(seq)
            while len(self._ids) > self._max_requests:
                oldest = self._ids.popleft()
                if oldest in self.index:
                    self.index.remove(oldest)
        return seq


class _Session:
    """Shared lifecycle: the request's own index (prompt + output) and its tenant's responses."""

    def __init__(self, owner: _BaseProposer, tenant: str, prompt: np.ndarray) -> None:
        self._owner = owner
        self._history = owner._tenant(tenant)
        self._local = SuffixIndex(max_depth=owner.config.max_depth)
        self._local.add(0, prompt)
        self._context = [prompt]
        self._output: list[np.ndarray] = []
        self._seq = self._history.new_id() if owner.live_history else -1

    def context(self) -> np.ndarray:
        if len(self._context) > 1:
            self._context = [np.concatenate(self._context)]
        return self._context[0]

    def commit(self, verified: Verified) -> None:
        tokens = as_tokens(verified.token_ids, "token_ids")
        if not len(tokens):
            return
        self._local.extend(0, tokens)
        self._context.append(tokens)
        self._output.append(tokens)
        if self._seq >= 0:  # the anchor adds a response to the shared tree as it is generated
            self._history.index.extend(self._seq, tokens)

    def finish(self, record: bool = True) -> None:
        output = np.concatenate(self._output) if self._output else np.zeros(0, dtype=np.int32)
        if self._seq >= 0:
            if not record and self._seq in self._history.index:
                self._history.index.remove(self._seq)
        elif record and len(output):
            self._history.index.add(self._history.new_id(), output)
        self._output = []


class _BaseProposer:
    live_history = False

    def __init__(self, config: DraftingConfig | None = None, *, max_cached_requests: int = 0) -> None:
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0 (0: no limit), got {max_cached_requests}")
        self.config = config if config is not None else DraftingConfig()
        self.max_cached_requests = max_cached_requests
        self._tenants: dict[str, _TenantResponses] = {}

    def _tenant(self, tenant: str) -> _TenantResponses:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _TenantResponses(self.config, self.max_cached_requests)
        return t


class _SuffixDecodingSession(_Session):
    def propose(self, budget: int) -> DraftTree:
        if budget <= 0:
            return DraftTree.empty("suffixdecoding")
        c = self._owner.config
        ctx = self.context()[-c.max_depth:]
        best = None
        for index in (self._local, self._history.index):  # local first: it wins ties, as in the anchor
            if not index.num_tokens:
                continue
            d = index.speculate(ctx, budget, max_spec_factor=c.max_spec_factor, max_spec_offset=c.max_spec_offset,
                                min_token_prob=c.min_token_prob, use_tree=c.use_tree)
            if best is None or d.score > best.score:
                best = d
        if best is None or not len(best):
            return DraftTree.empty("suffixdecoding")
        return _to_tree(best, "suffixdecoding")


class SuffixDecodingProposer(_BaseProposer):
    """SuffixDecoding's drafting on Reprise's index (the in-project anchor); see the module docstring."""

    live_history = True

    def begin(self, tenant: str, session_id: str, prompt_ids, request_id: str = "") -> _SuffixDecodingSession:
        return _SuffixDecodingSession(self, tenant, as_tokens(prompt_ids, "prompt_ids"))


def vllm_suffix_proposer(config: DraftingConfig | None = None, *, tree: bool = False) -> SuffixDecodingProposer:
    """SuffixDecoding with vLLM's `suffix` defaults (the constants above), one path per step; with
    ``tree`` the same settings draft trees (ArcticInference's tree speculation), for tree verifiers.
    vLLM's draft length cap (`num_speculative_tokens`, by default the depth) never binds: a path of
    depth 24 that matched m tokens drafts at most min(m, 24 - m) <= 12."""
    config = config if config is not None else DraftingConfig()
    settings = replace(config, max_depth=VLLM_SUFFIX_DEPTH, use_tree=tree, max_spec_factor=VLLM_SUFFIX_MAX_SPEC_FACTOR,
                       max_spec_offset=0.0, min_token_prob=VLLM_SUFFIX_MIN_TOKEN_PROB)
    return SuffixDecodingProposer(settings, max_cached_requests=VLLM_SUFFIX_MAX_CACHED_REQUESTS)


class _ExactKeySession(_Session):
    def propose(self, budget: int) -> DraftTree:
        if budget <= 0:
            return DraftTree.empty("exact_key")
        ctx = self.context()
        best = None
        for index in (self._local, self._history.index):
            if not index.num_tokens:
                continue
            d = index.speculate_exact(ctx, budget)
            if len(d) and (best is None or d.match_len > best.match_len or
                           (d.match_len == best.match_len and d.score > best.score)):
                best = d
        if best is None:
            return DraftTree.empty("exact_key")
        return _to_tree(best, "exact_key")


class ExactKeyProposer(_BaseProposer):
    """Exact-key drafting alone (longest key, newest occurrence, copy past the trie's depth)."""

    def begin(self, tenant: str, session_id: str, prompt_ids, request_id: str = "") -> _ExactKeySession:
        return _ExactKeySession(self, tenant, as_tokens(prompt_ids, "prompt_ids"))


def _to_tree(d, source: str) -> DraftTree:
    """A suffix_index.Draft (path probabilities) as a DraftTree (conditional probabilities)."""
    parents = d.parents
    path = d.probs.astype(np.float64)
    parent_path = np.where(parents >= 0, path[np.maximum(parents, 0)], 1.0)
    cond = np.divide(path, parent_path, out=np.ones_like(path), where=parent_path > 0).astype(np.float32)
    return DraftTree(d.token_ids, parents, np.minimum(cond, 1.0), float(d.score), source, int(d.match_len))
