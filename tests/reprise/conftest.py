"""Fixtures of the tests of reprise/ (helpers in testkit/service.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.service import start_service


@pytest.fixture
def running(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("REPRISE_MASTER_KEY", raising=False)
    r = start_service(tmp_path / "home")
    yield r
    r.stop()
