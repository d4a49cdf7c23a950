"""What a start leaves behind: the data directory is private, and a start that fails writes no keys."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest
from testkit.service import start_service

from reprise.config import load_config
from reprise.service import Service


def test_the_data_directory_is_created_private(tmp_path: Path) -> None:
    home = tmp_path / "new" / "home"
    running = start_service(home)
    try:
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert stat.S_IMODE((home / "admin.key").stat().st_mode) == 0o600
    finally:
        running.stop()


def test_a_start_without_its_model_writes_no_key_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    home = tmp_path / "home"
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    config = load_config({"home": str(home), "model.path": str(empty), "server.grpc_port": "0",
                          "server.http_port": "0"}, env={})

    async def start() -> None:
        await Service(config).start()

    with pytest.raises(FileNotFoundError, match="has no config.json"):
        asyncio.run(start())
    assert sorted(p.name for p in home.iterdir()) == []  # no master.key, no admin.key, no store
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
