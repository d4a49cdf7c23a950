"""Test-side verification for drafting sessions: what a verifier would hand ``commit``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from replay_traces.replay import accepted_path
from retrieval.draft_tree import DraftTree
from retrieval.session import Verified


def verified_along(tree: DraftTree, tokens: Sequence[int] | np.ndarray) -> Verified:
    """``tokens`` committed after ``tree`` was verified: its accepted nodes are the deepest root path
    that ``tokens`` follow (greedy verification against known tokens, as replay does)."""
    ids = [int(t) for t in tokens]
    path = accepted_path(tree.token_ids.tolist(), tree.parents.tolist(), ids, 0) if len(tree) else []
    return Verified(np.asarray(ids, dtype=np.int32), np.asarray(path, dtype=np.int32), len(tree) > 0)
