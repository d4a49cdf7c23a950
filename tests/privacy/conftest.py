"""Fixtures for the privacy tests: a store per backend (SQLite in tmp_path, the real Redis under a
unique key prefix that is removed afterwards), master keys, and raw dumps of everything stored."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from testkit.privacy import REDIS_DB, REDIS_HOST, REDIS_PORT

from privacy import HistoryStore, RedisConfig, StoreConfig, open_store

BACKENDS = ["sqlite", pytest.param("redis", marks=pytest.mark.redis)]


def new_master_env() -> dict[str, str]:
    return {"REPRISE_MASTER_KEY": base64.b64encode(os.urandom(32)).decode()}


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def make_config(tmp_path: Path, backend: str, request) -> Callable[..., StoreConfig]:
    """``make_config(**store_settings)`` for this test's backend; always the same data dir and prefix."""
    prefix = request.getfixturevalue("redis_prefix") if backend == "redis" else None

    def make(**kwargs) -> StoreConfig:
        kwargs.setdefault("data_dir", tmp_path / "data")
        if backend == "sqlite":
            return StoreConfig(**kwargs)
        return StoreConfig.for_redis(
            RedisConfig(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB, key_prefix=prefix), **kwargs
        )

    return make


@pytest.fixture
def master_env() -> dict[str, str]:
    return new_master_env()


@pytest.fixture
def store(make_config, master_env) -> Iterator[HistoryStore]:
    s = open_store(make_config(), env=master_env)
    yield s
    s.close()
