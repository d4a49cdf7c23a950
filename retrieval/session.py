"""Request-scoped drafting: the lifecycle every decode loop (the engine, replay) drives.

    session = proposer.begin(tenant, session_id, prompt_ids)
    while not done:
        tree = session.propose(budget)      # DraftTree continuing prompt + committed tokens
        ...verify...
        session.commit(Verified(token_ids, accepted))   # once per step: what the verifier committed
    session.finish(record=True)             # prompt + output join the tenant's in-memory history

A session sees only its tenant's history and corpus and its own request (docs/architecture.md,
"Contracts"). The verifier decides which draft nodes were accepted; a session is told, never recounts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from retrieval.draft_tree import DraftTree

_NO_NODES = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class Verified:
    """One step's verification as the session that drafted it sees it (handed to ``commit`` once).

    ``token_ids`` [n] int32: the committed tokens, the accepted draft tokens then the bonus token (a stop
    condition may cut the end; never empty). ``accepted`` [k] int32, ``k <= n``: the accepted nodes of
    the tree the session's last ``propose`` returned, root to leaf; their tokens are ``token_ids[:k]``.
    ``draft_verified``: whether any of that tree was verified this step (False when the session did not
    propose, its tree was empty, or the budget or a hybrid's choice kept none of it): a draft nobody
    checked teaches the session nothing about its acceptance. ``hidden_states`` [n, d]: the target's
    top hidden states at the rows that produced ``token_ids``, for sessions that draft from them (neural
    drafters); None unless the engine keeps them.
    """

    token_ids: np.ndarray
    accepted: np.ndarray = field(default_factory=lambda: _NO_NODES)
    draft_verified: bool = False
    hidden_states: Any = None

    def __post_init__(self) -> None:
        if len(self.accepted) > len(self.token_ids):
            raise ValueError(
                f"{len(self.accepted)} accepted nodes but only {len(self.token_ids)} committed tokens")

    @classmethod
    def tokens(cls, token_ids: Sequence[int] | np.ndarray) -> Verified:
        """Tokens committed without the session's draft being verified (a plain step)."""
        return cls(np.asarray(token_ids, dtype=np.int32))

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


class DraftSession(Protocol):
    """Drafting state of one request: its prompt, the tokens committed so far, its tenant's indexes."""

    def propose(self, budget: int) -> DraftTree:  # pragma: no cover - protocol
        """A draft tree of at most ``budget`` nodes continuing the committed context."""
        ...

    def commit(self, verified: Verified) -> None:  # pragma: no cover - protocol
        """What the verifier committed this step, for the tree the last ``propose`` returned."""
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
