"""One real `reprise serve` (a subprocess with a tiny random Llama saved to a temp dir, loopback ports,
a temp $REPRISE_HOME) shared by the hostile-client tests: every test attacks it, then checks that a
normal tenant still gets answers on both APIs and that health on both fronts tells the truth. Sharing
the process is part of the point: each attack must leave it as it found it for the next test.

Its limits are the defaults scaled down, so that floods of a few hundred reach them in a test's time:
header deadline 2 s, body deadline 3 s, 64 connections per client address and 400 in all, 32 anonymous
gRPC streams in all and 4 per connection, a gRPC call's message within 2 s of its headers."""

from __future__ import annotations

from pathlib import Path

import pytest

from reprise.benchmarks.hostile import Served, raise_fd_limit, save_tiny_model

LIMITS = ("--http-header-timeout-s", "2", "--http-body-timeout-s", "3", "--http-max-connections-per-client", "64",
          "--http-max-connections", "400", "--public-streams-total", "32", "--public-streams-per-connection", "4",
          "--max-requests-per-tenant", "8", "--max-concurrent-requests", "16", "--grpc-message-timeout-s", "2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("hostile-model"))


@pytest.fixture(scope="session")
def served(tmp_path_factory, tiny_model_dir):
    raise_fd_limit()
    with Served.start(tmp_path_factory.mktemp("hostile") / "home", tiny_model_dir, *LIMITS) as s:
        yield s


@pytest.fixture(scope="session")
def tenant(served) -> str:
    """A normal tenant's API key."""
    return served.create_tenant("normal")


@pytest.fixture(scope="session")
def attacker(served) -> str:
    """The hostile tenant's API key."""
    return served.create_tenant("mallory")

