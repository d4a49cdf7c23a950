"""Drafting settings: one frozen record, validated at construction, tunable per tenant."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_DRAFT_TOKENS = 1024  # the most nodes one step's draft may have (max_draft_tokens, a replay's budget)


@dataclass(frozen=True, slots=True)
class DraftingConfig:
    """Settings of the retrieval proposers.

    Shared: ``max_draft_tokens`` caps the nodes of one step's tree; ``max_depth`` is the suffix tries'
    depth.

    The full proposer ("reprise"): ``min_path_prob`` prunes nodes whose estimated probability of being
    accepted (the product along their path) is lower; ``levels`` is how many match lengths each source
    starts from (its longest match, then shorter ones with more occurrences); ``lead_in`` is how many
    prompt tokens are recorded before each response in the tenant's history, so that the start of a
    response can be matched; ``use_context``/``use_history``/``use_corpus`` choose the sources (the
    request's own prompt and output, the tenant's past responses, the tenant's corpus, and with
    ``use_prompts`` the tenant's past prompts, each session's conversation indexed once); ``canonical`` adds indexes where number tokens are replaced by a class id;
    ``learn`` lets the per-tenant calibration learn from committed tokens (``prior_strength`` is the
    weight of its prior, in observations); ``max_copy`` bounds how far a draft copies past the tries'
    depth; ``collapse_threshold``: a tenant whose drafts accept less than this share of what they were
    expected to stops drafting (with periodic probes) until they recover (0: never; retrieval.policy);
    ``canonical_below``: canonical indexes are consulted only when the real match is shorter (and a
    number token lies within it, or right before it: otherwise they would match the same strings);
    ``skip_below``/``skip_min``: when a source matches fewer than ``skip_below`` tokens, it also matches
    the context without its last token (at least ``skip_min`` tokens) and drafts past a stand-in for it;
    ``wide_node``: trie nodes with more children offer only their most frequent child; ``fallback``: the
    tenant's most frequent next tokens where its indexes' first guesses missed, by the shape of the
    context's last token (``retrieval.vocabulary.token_categories``), compete with the indexes' nodes for
    the budget; ``history_max_bytes`` is each tenant's history index budget (oldest trajectories are
    evicted first; 0: none); ``session_cache_bytes`` bounds the request indexes kept for a session's next call;
    ``live_history``: a running request's output joins the tenant's history as it is generated (its
    lead-in first), so that the tenant's other running requests draft from it (parallel trials, forks of
    one conversation); it is replaced by the recorded turn when the request ends.

    Hybrid proposer ("hybrid", neural_drafters/hybrid.py): a retrieval draft whose score (expected accepted
    tokens) reaches ``hybrid_threshold`` is used alone; below it hidden-state reuse and the neural head
    draft too (``reprise tune --hybrid`` picks it per tenant with the target model).

    SuffixDecoding-style proposer ("suffix"): the draft length may grow with the match length
    (length <= ``max_spec_factor`` * match_len + ``max_spec_offset``); ``min_token_prob`` prunes unlikely
    nodes; ``use_tree`` drafts trees rather than paths.
    """

    max_draft_tokens: int = 32
    max_depth: int = 64
    min_path_prob: float = 1e-4
    levels: int = 2
    lead_in: int = 16
    canonical: bool = True
    use_context: bool = True
    use_history: bool = True
    use_corpus: bool = True
    use_prompts: bool = False
    learn: bool = True
    prior_strength: float = 8.0
    max_copy: int = 256
    collapse_threshold: float = 0.2
    canonical_below: int = 16
    skip_below: int = 0
    skip_min: int = 3
    wide_node: int = 32
    fallback: bool = True
    history_max_bytes: int = 1 << 30
    session_cache_bytes: int = 256 << 20
    live_history: bool = True
    max_spec_factor: float = 16.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.01
    use_tree: bool = True
    hybrid_threshold: float = 2.0

    def __post_init__(self) -> None:
        _check_range("max_draft_tokens", self.max_draft_tokens, 1, MAX_DRAFT_TOKENS)
        _check_range("max_depth", self.max_depth, 2, 4096)
        if not 0.0 <= self.min_path_prob < 1.0:
            raise ValueError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")
        _check_range("levels", self.levels, 1, 8)
        if not (self.use_context or self.use_history or self.use_corpus):
            raise ValueError("at least one of use_context, use_history, use_corpus must be true")
        _check_range("lead_in", self.lead_in, 0, 4096)
        if not self.prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength}")
        _check_range("max_copy", self.max_copy, 0, 1 << 20)
        if not 0.0 <= self.collapse_threshold < 1.0:
            raise ValueError(f"collapse_threshold must be in [0, 1), got {self.collapse_threshold}")
        _check_range("canonical_below", self.canonical_below, 0, 4096)
        _check_range("wide_node", self.wide_node, 1, 1 << 20)
        _check_range("skip_below", self.skip_below, 0, 4096)
        _check_range("skip_min", self.skip_min, 1, 4096)
        _check_range("history_max_bytes", self.history_max_bytes, 0, 1 << 50)
        _check_range("session_cache_bytes", self.session_cache_bytes, 0, 1 << 50)
        if self.max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob < 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1), got {self.min_token_prob}")
        if not self.hybrid_threshold >= 0.0:  # inf: never draft with the head
            raise ValueError(f"hybrid_threshold must be >= 0, got {self.hybrid_threshold}")

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


def _check_range(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
