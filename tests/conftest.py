"""Shared test setup: Triton's interpreter on CPU, one torch thread, the shared traces folder."""

from __future__ import annotations

import os
from pathlib import Path

# Must be set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
TRACES = SHARED / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """../shared/traces; tests that need it skip cleanly when it is absent."""
    if not TRACES.is_dir():
        pytest.skip("../shared/traces is not present")
    return TRACES


def pytest_configure(config) -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
