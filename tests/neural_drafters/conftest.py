"""Fixtures of the neural drafter tests: a tiny random Llama target."""

from __future__ import annotations

import pytest
from nd_helpers import VOCAB

from verifier.testing import tiny_model


@pytest.fixture(scope="module")
def target():
    """A tiny random Llama (vocab 128, d 64, 2 layers) with peaked next-token distributions."""
    return tiny_model("llama", vocab_size=VOCAB, seed=3, init_range=0.3)
