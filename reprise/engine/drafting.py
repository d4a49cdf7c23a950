"""A request's drafting session as the engine holds it: failures degrade to "no more drafts".

The contract (docs/architecture.md, "Contracts"): a failing drafter means an empty draft, never a wrong
token or a lost request. ``GuardedSession`` logs the first failure of a request's session and drafts
nothing for the rest of that request.
"""

from __future__ import annotations

import logging
from typing import Any

from retrieval.draft_tree import DraftTree
from retrieval.session import DraftSession, Proposer, Verified
from serving.records import Request

log = logging.getLogger(__name__)


class GuardedSession:
    """One request's drafting session; ``session`` is None once it failed (or never began)."""

    __slots__ = ("request_id", "session")

    def __init__(self, proposer: Proposer, request: Request, request_id: str) -> None:
        self.request_id = request_id
        self.session: DraftSession | None = None
        try:
            self.session = proposer.begin(request.tenant, request.session_id, list(request.prompt_ids), request_id)
        except Exception:  # noqa: BLE001 - logged by _failed
            self._failed("begin")

    def _failed(self, what: str) -> None:
        log.exception("drafter %s failed for request %s; it drafts nothing more", what, self.request_id)
        self.session = None

    def propose(self, budget: int) -> DraftTree:
        if self.session is not None:
            try:
                tree = self.session.propose(budget)
                tree.validate()
                return tree
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("propose")
        return DraftTree.empty()

    def observe_hidden(self, states: Any) -> None:
        """The prompt's hidden states, for a session that drafts from them (neural drafters)."""
        observe = getattr(self.session, "observe_hidden", None)
        if observe is not None:
            try:
                observe(states)
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("observe_hidden")

    def commit(self, verified: Verified) -> None:
        if self.session is not None:
            try:
                self.session.commit(verified)
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("commit")

    def finish(self, record: bool) -> None:
        if self.session is not None:
            try:
                self.session.finish(record=record)
            except Exception:  # noqa: BLE001 - logged by _failed
                self._failed("finish")
