"""Retrieval proposers by name (``reprise replay --drafter NAME``, ``reprise tune``, the service).

Each entry maps a name to a factory ``(config: DraftingConfig) -> Proposer`` and a one-line description.
The application's registry (``reprise.drafters``) adds the neural drafters on top of these; add a
retrieval proposer with one entry in ``_ENTRIES`` or ``register_proposer`` at run time (a plugin).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from retrieval.config import DraftingConfig
from retrieval.drafters import ExactKeyProposer, SuffixDecodingProposer, vllm_suffix_proposer
from retrieval.prompt_lookup import VLLM_MAX_N, VLLM_MIN_N, PromptLookupProposer
from retrieval.proposer import RepriseProposer
from retrieval.session import Proposer

Factory = Callable[[DraftingConfig], Proposer]

#: The proposer the service, replay and tuning use when none is named.
DEFAULT_DRAFTER = "reprise"


@dataclass(frozen=True, slots=True)
class _Entry:
    factory: Factory
    description: str


_ENTRIES: dict[str, _Entry] = {
    "reprise": _Entry(
        RepriseProposer,
        "the full proposer: request + tenant history + corpus, canonical numbers, calibrated merge (default)",
    ),
    "suffix": _Entry(
        lambda c: RepriseProposer(replace(c, canonical=False, use_corpus=False)),
        "suffix trees of the request and the tenant's past responses, merged into one tree by calibrated score",
    ),
    "corpus": _Entry(
        lambda c: RepriseProposer(replace(c, use_context=False, use_history=False, use_corpus=True)),
        "REST-style: the tenant's corpus (documentation, code, tool schemas) alone",
    ),
    "exact_key": _Entry(
        ExactKeyProposer,
        "exact-key index: the newest occurrence of the longest matching key, copied past the trie's depth",
    ),
    "suffixdecoding": _Entry(
        SuffixDecodingProposer,
        "SuffixDecoding's semantics on Reprise's index (request or past responses, either-or): the anchor",
    ),
    "suffixdecoding_vllm": _Entry(
        vllm_suffix_proposer,
        "SuffixDecoding as vLLM's `suffix` method runs it by default: depth 24, one path, spec factor 1.0, "
        "min token prob 0.1, the 10,000 newest responses (the chain anchor)",
    ),
    "prompt_lookup": _Entry(
        lambda c: PromptLookupProposer(min_n=2, max_n=5),
        "n-gram lookup over the request's own prompt and output, n 2-5 (the baseline in the figures)",
    ),
    "prompt_lookup_vllm": _Entry(
        lambda c: PromptLookupProposer(min_n=VLLM_MIN_N, max_n=VLLM_MAX_N),
        "n-gram lookup with vLLM's defaults (prompt_lookup_min = prompt_lookup_max = 5)",
    ),
}


def proposer_names() -> list[str]:
    """The registered proposer names, sorted."""
    return sorted(_ENTRIES)


def describe_proposers() -> dict[str, str]:
    """Name -> one-line description, sorted by name."""
    return {name: _ENTRIES[name].description for name in proposer_names()}


def register_proposer(name: str, factory: Factory, description: str = "") -> None:
    """Add (or replace) a proposer made by ``factory(config)``."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"proposer name must be letters, digits, '_' or '-', got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {factory!r}")
    _ENTRIES[name] = _Entry(factory, description)


def make_proposer(name: str, config: DraftingConfig | None = None) -> Proposer:
    """A fresh proposer (no history) of the named kind, configured by ``config`` (defaults if None).

    Unknown names raise ``ValueError`` listing the known ones.
    """
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(proposer_names())}")
    return entry.factory(config if config is not None else DraftingConfig())
