"""The proposer registry."""

from __future__ import annotations

import pytest

from retrieval import registry
from retrieval.config import DraftingConfig
from retrieval.prompt_lookup import PromptLookupProposer
from retrieval.registry import describe_proposers, make_proposer, proposer_names, register_proposer


def test_prompt_lookup_is_registered_with_the_figures_n_range():
    assert {"prompt_lookup", "prompt_lookup_vllm"} <= set(proposer_names())
    assert proposer_names() == sorted(proposer_names())
    proposer = make_proposer("prompt_lookup")
    assert isinstance(proposer, PromptLookupProposer)
    assert (proposer.min_n, proposer.max_n) == (2, 5)
    vllm = make_proposer("prompt_lookup_vllm", DraftingConfig(max_draft_tokens=8))
    assert (vllm.min_n, vllm.max_n) == (5, 5)
    assert all(describe_proposers().values())


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown drafter 'nope'; known: .*prompt_lookup"):
        make_proposer("nope")


def test_register_a_factory(monkeypatch):
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    seen = []

    def factory(config):
        seen.append(config)
        return PromptLookupProposer(1, 3)

    register_proposer("mine", factory, "a test proposer")
    config = DraftingConfig(max_draft_tokens=4)
    assert make_proposer("mine", config).max_n == 3 and seen == [config]
    make_proposer("mine")
    assert seen[-1] == DraftingConfig()  # None means the defaults
    for bad_name in ("", "a b"):
        with pytest.raises(ValueError):
            register_proposer(bad_name, factory)
    with pytest.raises(TypeError):
        register_proposer("x", "module:function")
