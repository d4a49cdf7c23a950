"""The Drafter protocol: everything that proposes draft trees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from retrieval.draft_tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    """Proposes a draft tree continuing ``context`` with at most ``budget`` nodes.

    A drafter that fails or finds nothing returns an empty tree, never raises on a well-formed context.
    """

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:  # pragma: no cover - protocol
        ...
