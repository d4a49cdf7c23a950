"""Shared test setup: Triton's interpreter on CPU, one torch thread, the shared traces folder, and the
fixtures several folders use (the real Redis, tokenizers, a tiny target model)."""

from __future__ import annotations

import os
from pathlib import Path

# Must be set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import secrets
from collections.abc import Iterator

import pytest
import redis
import torch
from testkit.neural import VOCAB
from testkit.privacy import REDIS_DB, REDIS_HOST, REDIS_PORT
from testkit.replay import CharTokenizer

from replay_traces.tokenizer import CanonicalTokenizer
from replay_traces.traces import TRACES_DIR
from verifier.testing import tiny_model


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The trace files' folder (``replay_traces.traces.TRACES_DIR``); tests that need it skip cleanly
    when it is absent."""
    if not TRACES_DIR.is_dir():
        pytest.skip(f"the trace files are not present ({TRACES_DIR})")
    return TRACES_DIR


def pytest_configure(config) -> None:
    torch.set_num_threads(1)



@pytest.fixture(scope="session")
def redis_client():
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {REDIS_HOST}:{REDIS_PORT} (run `make redis`)")
    return client


@pytest.fixture
def redis_prefix(redis_client) -> Iterator[str]:
    """A key prefix no one else uses; every key under it is removed after the test."""
    prefix = f"reprise-test-{secrets.token_hex(6)}"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        redis_client.unlink(*keys)



@pytest.fixture
def char_tokenizer():
    """A one-token-per-character tokenizer (testkit/replay.py)."""
    return CharTokenizer()


@pytest.fixture(scope="session")
def tokenizer():
    """The canonical cl100k_base tokenizer (built once: loading the vocabulary takes a moment)."""
    return CanonicalTokenizer()


@pytest.fixture(scope="module")
def target():
    """A tiny random Llama (vocab 128, d 64, 2 layers) with peaked next-token distributions."""
    return tiny_model("llama", vocab_size=VOCAB, seed=3, init_range=0.3)
