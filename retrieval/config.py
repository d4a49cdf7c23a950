"""Drafting settings: one frozen record, validated at construction, tunable per tenant."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DraftingConfig:
    """Settings of the retrieval proposer.

    ``max_draft_tokens`` caps the nodes of one step's tree; ``max_depth`` is the suffix tree's depth;
    ``max_spec_factor``/``max_spec_offset`` let the draft length grow with the match length
    (length <= factor * match_len + offset); ``min_token_prob`` prunes unlikely nodes.
    """

    max_draft_tokens: int = 32
    max_depth: int = 64
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    use_tree: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_draft_tokens <= 1024:
            raise ValueError(f"max_draft_tokens must be in [1, 1024], got {self.max_draft_tokens}")
        if not 2 <= self.max_depth <= 4096:
            raise ValueError(f"max_depth must be in [2, 4096], got {self.max_depth}")
        if self.max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob < 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1), got {self.min_token_prob}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftingConfig:
        """Build from a mapping; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown drafting settings: {', '.join(unknown)}")
        return cls(**data)
