"""The import graph has no cycle and follows the layering of docs/architecture.md (tools/import_graph.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = import_graph
_spec.loader.exec_module(import_graph)


def test_the_project_has_no_cycle_and_no_forbidden_import() -> None:
    found = import_graph.problems()
    assert not found, "\n".join(found)


def test_a_cycle_and_an_upward_import_are_named(tmp_path) -> None:
    (tmp_path / "privacy").mkdir()
    (tmp_path / "privacy" / "__init__.py").write_text("")
    (tmp_path / "privacy" / "a.py").write_text("from privacy import b\n")
    (tmp_path / "privacy" / "b.py").write_text("def f():\n    import privacy.a\n")  # lazy: still an edge
    (tmp_path / "privacy" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from privacy import a\nimport grpc_api.x\n")
    (tmp_path / "grpc_api").mkdir()
    (tmp_path / "grpc_api" / "x.py").write_text("import os\n")
    found = import_graph.problems(tmp_path)
    assert "cycle: privacy.a -> privacy.b -> privacy.a" in found
    assert any(line.startswith("forbidden import: privacy.c imports grpc_api.x") for line in found)
    assert len(found) == 2  # the TYPE_CHECKING import (allowed: within privacy) closes no circle


def test_a_circle_through_type_checking_imports_is_named(tmp_path) -> None:
    """privacy.history calls rotation, which once named HistoryStore under TYPE_CHECKING: still a circle."""
    (tmp_path / "privacy").mkdir()
    (tmp_path / "privacy" / "history.py").write_text("from privacy import rotation\n")
    (tmp_path / "privacy" / "rotation.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from privacy.history import HistoryStore\n")
    (tmp_path / "privacy" / "sealed.py").write_text("class SealedStore: ...\n")
    assert import_graph.problems(tmp_path) == [
        "cycle through TYPE_CHECKING imports: privacy.history -> privacy.rotation -> privacy.history"]
    (tmp_path / "privacy" / "rotation.py").write_text("from privacy.sealed import SealedStore\n")
    assert import_graph.problems(tmp_path) == []


def test_the_config_and_the_server_import_nothing_of_the_cluster(tmp_path) -> None:
    (tmp_path / "reprise" / "server").mkdir(parents=True)
    (tmp_path / "reprise" / "cluster").mkdir()
    for name in ("config", "server/parts", "cluster/node", "engine", "backends", "drafters", "offline", "service",
                 "cluster/launch", "server/dashboard/http", "arguments", "benchmarks", "commands", "cli"):
        (tmp_path / "reprise" / f"{name}.py").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "reprise" / f"{name}.py").write_text("")
    (tmp_path / "reprise" / "config.py").write_text("def f():\n    from reprise.cluster import node\n")
    (tmp_path / "reprise" / "server" / "parts.py").write_text(  # an annotation is still a dependency
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from reprise.cluster.node import x\n")
    found = import_graph.problems(tmp_path)
    assert any(line.startswith("forbidden import: reprise.config imports reprise.cluster.node") for line in found)
    assert any(line.startswith("forbidden import: reprise.server.parts imports reprise.cluster.node") for line in found)
