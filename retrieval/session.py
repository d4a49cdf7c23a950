"""Request-scoped drafting: the lifecycle every decode loop (pipeline, replay) drives.

    session = proposer.begin(tenant, session_id, prompt_ids)
    while not done:
        tree = session.propose(budget)      # DraftTree continuing prompt + committed tokens
        ...verify...
        session.commit(accepted_ids)        # accepted draft tokens plus the bonus token
    session.finish(record=True)             # prompt + output join the tenant's in-memory history

A session sees only its tenant's history and corpus and its own request (DESIGN.md, Contracts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from retrieval.draft_tree import DraftTree


class DraftSession(Protocol):
    """Drafting state of one request: its prompt, the tokens committed so far, its tenant's indexes."""

    def propose(self, budget: int) -> DraftTree:  # pragma: no cover - protocol
        """A draft tree of at most ``budget`` nodes continuing the committed context."""
        ...

    def commit(self, token_ids: Sequence[int] | np.ndarray) -> None:  # pragma: no cover - protocol
        """Tokens the verifier committed this step (accepted draft tokens, then the bonus token)."""
        ...

    def finish(self, record: bool = True) -> None:  # pragma: no cover - protocol
        """End the request; with ``record`` its prompt and output join the tenant's history."""
        ...


class Proposer(Protocol):
    """Hands out drafting sessions, each scoped to one tenant."""

    def begin(
        self, tenant: str, session_id: str, prompt_ids: Sequence[int] | np.ndarray, request_id: str = ""
    ) -> DraftSession:  # pragma: no cover - protocol
        ...
