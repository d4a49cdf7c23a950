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

import numpy as np

from retrieval.config import DraftingConfig
from retrieval.draft_tree import DraftTree
from retrieval.session import Verified
from suffix_index import SuffixIndex, as_tokens


class _TenantResponses:
    """A tenant's past responses in one index (sequence per response)."""

    def __init__(self, config: DraftingConfig) -> None:
        self.index = SuffixIndex(max_depth=config.max_depth, max_bytes=config.history_max_bytes)
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


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

    def __init__(self, config: DraftingConfig | None = None) -> None:
        self.config = config if config is not None else DraftingConfig()
        self._tenants: dict[str, _TenantResponses] = {}

    def _tenant(self, tenant: str) -> _TenantResponses:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _TenantResponses(self.config)
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
