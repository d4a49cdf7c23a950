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
    assert len(found) == 2  # the TYPE_CHECKING import is no edge
