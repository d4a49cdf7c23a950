"""Fixtures of the cluster tests (helpers in testkit/cluster.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from testkit.cluster import RedisServer, master_env, require_redis_server, store_config

from privacy import open_store


@dataclass
class Deployment:
    """One private Redis, the master key every replica shares, an admin key and two tenants' API keys."""

    redis: RedisServer
    env: dict[str, str]
    admin_key: str
    tenants: dict[str, tuple[str, str]]  # name -> (tenant id, API key)
    workdir: Path

    def store(self) -> Any:
        return open_store(store_config(self.redis.url, self.workdir / "checker"), env=self.env)


@pytest.fixture
def deployment(tmp_path: Path):
    require_redis_server()
    redis = RedisServer(tmp_path / "redis", appendfsync="always").start()
    env = master_env()
    try:
        with open_store(store_config(redis.url, tmp_path / "setup"), env=env) as store:
            admin_key = store.create_admin_key().secret
            tenants = {}
            for name in ("acme", "globex"):
                t = store.create_tenant(name)
                tenants[name] = (t.id.value, store.create_api_key(t.id).secret)
        yield Deployment(redis, env, admin_key, tenants, tmp_path)
    finally:
        redis.stop()
