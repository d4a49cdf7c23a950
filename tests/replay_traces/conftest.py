"""Fixtures of the replay tests (helpers live in replay_helpers.py)."""

from __future__ import annotations

import pytest
from replay_helpers import CharTokenizer


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="session")
def tokenizer():
    """The canonical cl100k_base tokenizer (built once: loading the vocabulary takes a moment)."""
    from replay_traces.tokenizer import CanonicalTokenizer

    return CanonicalTokenizer()
