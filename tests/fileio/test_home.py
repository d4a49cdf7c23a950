"""``fileio.reprise_home``: the one place that says where Reprise keeps its local files."""

from __future__ import annotations

from pathlib import Path

from fileio import reprise_home


def test_env_names_the_home_else_the_user_folder(monkeypatch, tmp_path) -> None:
    assert reprise_home({"REPRISE_HOME": str(tmp_path)}) == tmp_path
    assert reprise_home({"REPRISE_HOME": "~/elsewhere"}) == Path.home() / "elsewhere"
    assert reprise_home({}) == Path.home() / ".reprise"
    monkeypatch.setenv("REPRISE_HOME", str(tmp_path / "p"))
    assert reprise_home() == tmp_path / "p"  # the process's environment by default
    monkeypatch.delenv("REPRISE_HOME")
    assert reprise_home() == Path.home() / ".reprise"
