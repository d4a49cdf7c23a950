"""Every drafter the application can run, by name: the retrieval proposers (``retrieval.registry``)
and the neural ones (``neural_drafters.proposers``: the trained head, hidden-state reuse, the hybrid).

The neural factories import torch, so ``neural_drafters.proposers`` is imported only when one of them is
made: listing names (``--help``, config validation) stays fast.
"""

from __future__ import annotations

import dataclasses

from retrieval import registry
from retrieval.chain import DEFAULT_TREE_FACTOR, ChainProposer
from retrieval.config import MAX_DRAFT_TOKENS, DraftingConfig
from retrieval.registry import DEFAULT_DRAFTER
from retrieval.session import Proposer

__all__ = ["DEFAULT_DRAFTER", "describe_proposers", "make_proposer", "proposer_names"]

# name -> (factory in neural_drafters.proposers, description)
NEURAL = {
    "hybrid": ("make_hybrid_proposer",
               "retrieval, then hidden-state reuse and the neural head below a score threshold"),
    "neural": ("make_neural_proposer",
               "the trained draft head alone (EAGLE/Medusa/MTP on the target's hidden states)"),
    "hidden_reuse": ("make_reuse_proposer",
                     "hidden-state keyed reuse (Oilbird): copy what followed the most similar past state"),
}


def proposer_names() -> list[str]:
    """Every drafter name, sorted."""
    return sorted([*registry.proposer_names(), *NEURAL])


def describe_proposers() -> dict[str, str]:
    """Name -> one-line description, sorted by name."""
    described = {**registry.describe_proposers(), **{n: d for n, (_, d) in NEURAL.items()}}
    return {name: described[name] for name in proposer_names()}


def make_proposer(name: str, config: DraftingConfig | None = None) -> Proposer:
    """A fresh proposer of the named kind; unknown names raise ``ValueError`` listing the known ones."""
    if name in NEURAL:
        from neural_drafters import proposers  # torch: see the module docstring

        factory = getattr(proposers, NEURAL[name][0])
        return factory(config if config is not None else DraftingConfig())
    if name not in registry.proposer_names():
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(proposer_names())}")
    return registry.make_proposer(name, config)


def make_chain_proposer(name: str, config: DraftingConfig | None = None) -> ChainProposer:
    """``make_proposer(name, config)`` sending one path per step, as a chain verifier (vLLM) is sent:
    the best path, within ``config.max_draft_tokens``, of a tree ``DEFAULT_TREE_FACTOR`` times as wide
    (``retrieval.chain``)."""
    config = config if config is not None else DraftingConfig()
    wide = dataclasses.replace(config, max_draft_tokens=min(config.max_draft_tokens * DEFAULT_TREE_FACTOR,
                                                                 MAX_DRAFT_TOKENS))
    return ChainProposer(make_proposer(name, wide))
