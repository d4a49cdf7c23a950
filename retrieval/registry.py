"""Proposers by name, for the CLI (``reprise replay --drafter NAME``, ``reprise tune``) and the service.

Each entry maps a name to ``"module:function"``, a factory ``(config: DraftingConfig) -> Proposer``,
imported only when that proposer is made, so listing names stays cheap. Add a proposer with one line in
``_ENTRIES`` (or ``register_proposer`` at run time, e.g. from a test or a plugin).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from retrieval.config import DraftingConfig
from retrieval.session import Proposer

Factory = Callable[[DraftingConfig], Proposer]


@dataclass(frozen=True, slots=True)
class _Entry:
    target: str | Factory  # "module:function" or the factory itself
    description: str


_ENTRIES: dict[str, _Entry] = {
    "reprise": _Entry(
        "retrieval.registry:_reprise",
        "the full proposer: request + tenant history + corpus, canonical numbers, calibrated merge (default)",
    ),
    "suffix": _Entry(
        "retrieval.registry:_suffix",
        "suffix trees of the request and the tenant's past responses, merged into one tree by calibrated score",
    ),
    "corpus": _Entry(
        "retrieval.registry:_corpus",
        "REST-style: the tenant's corpus (documentation, code, tool schemas) alone",
    ),
    "exact_key": _Entry(
        "retrieval.registry:_exact_key",
        "exact-key index: the newest occurrence of the longest matching key, copied past the trie's depth",
    ),
    "suffixdecoding": _Entry(
        "retrieval.registry:_suffixdecoding",
        "SuffixDecoding's semantics on Reprise's index (request or past responses, either-or): the anchor",
    ),
    "suffixdecoding_vllm": _Entry(
        "retrieval.registry:_suffixdecoding_vllm",
        "SuffixDecoding as vLLM's `suffix` method runs it by default: depth 24, one path, spec factor 1.0, "
        "min token prob 0.1 (the chain anchor)",
    ),
    "prompt_lookup": _Entry(
        "retrieval.registry:_prompt_lookup_2_5",
        "n-gram lookup over the request's own prompt and output, n 2-5 (the baseline in the figures)",
    ),
    "prompt_lookup_vllm": _Entry(
        "retrieval.registry:_prompt_lookup_vllm",
        "n-gram lookup with vLLM's defaults (prompt_lookup_min = prompt_lookup_max = 5)",
    ),
    # Neural fallbacks: their factories live in the application (they need torch and a head checkpoint).
    "hybrid": _Entry("neural_drafters.proposers:make_hybrid_proposer",
                     "retrieval, then hidden-state reuse and the neural head below a score threshold"),
    "neural": _Entry("neural_drafters.proposers:make_neural_proposer",
                     "the trained draft head alone (EAGLE/Medusa/MTP on the target's hidden states)"),
    "hidden_reuse": _Entry("neural_drafters.proposers:make_reuse_proposer",
                           "hidden-state keyed reuse (Oilbird): copy what followed the most similar past state"),
}


def _reprise(config: DraftingConfig) -> Proposer:
    from retrieval.proposer import RepriseProposer

    return RepriseProposer(config)


def _suffix(config: DraftingConfig) -> Proposer:
    from dataclasses import replace

    from retrieval.proposer import RepriseProposer

    return RepriseProposer(replace(config, canonical=False, use_corpus=False))


def _corpus(config: DraftingConfig) -> Proposer:
    from dataclasses import replace

    from retrieval.proposer import RepriseProposer

    return RepriseProposer(replace(config, use_context=False, use_history=False, use_corpus=True))


def _exact_key(config: DraftingConfig) -> Proposer:
    from retrieval.drafters import ExactKeyProposer

    return ExactKeyProposer(config)


def _suffixdecoding(config: DraftingConfig) -> Proposer:
    from retrieval.drafters import SuffixDecodingProposer

    return SuffixDecodingProposer(config)


def _suffixdecoding_vllm(config: DraftingConfig) -> Proposer:
    from dataclasses import replace

    from retrieval.drafters import SuffixDecodingProposer

    return SuffixDecodingProposer(replace(config, max_depth=24, use_tree=False, max_spec_factor=1.0,
                                          max_spec_offset=0.0, min_token_prob=0.1))


def _prompt_lookup_2_5(config: DraftingConfig) -> Proposer:
    from retrieval.prompt_lookup import PromptLookupProposer

    return PromptLookupProposer(min_n=2, max_n=5)


def _prompt_lookup_vllm(config: DraftingConfig) -> Proposer:
    from retrieval.prompt_lookup import VLLM_MAX_N, VLLM_MIN_N, PromptLookupProposer

    return PromptLookupProposer(min_n=VLLM_MIN_N, max_n=VLLM_MAX_N)


def proposer_names() -> list[str]:
    """The registered proposer names, sorted."""
    return sorted(_ENTRIES)


def describe_proposers() -> dict[str, str]:
    """Name -> one-line description, sorted by name."""
    return {name: _ENTRIES[name].description for name in proposer_names()}


def register_proposer(name: str, factory: str | Factory, description: str = "") -> None:
    """Add (or replace) a proposer: ``factory`` is ``"module:function"`` or a callable."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"proposer name must be letters, digits, '_' or '-', got {name!r}")
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(f"factory must be 'module:function' or a callable, got {factory!r}")
    _ENTRIES[name] = _Entry(factory, description)


def make_proposer(name: str, config: DraftingConfig | None = None) -> Proposer:
    """A fresh proposer (no history) of the named kind, configured by ``config`` (defaults if None).

    Unknown names raise ``ValueError`` listing the known ones.
    """
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(proposer_names())}")
    config = config if config is not None else DraftingConfig()
    factory = entry.target
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
    return factory(config)
