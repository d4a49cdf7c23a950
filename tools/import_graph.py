"""Check the project's import graph: no cycle among its modules, no import against the layering of
docs/architecture.md. Static: it reads the source with ``ast`` and runs none of it.

    python tools/import_graph.py          # exit 0 when clean, else 1 with one line per problem
    python tools/import_graph.py --edges  # print every project-internal edge

An edge is every ``import``/``from ... import`` of a project module, at module top or inside a
function (a lazy import is still a dependency). Imports under ``if TYPE_CHECKING:`` never run, but
they count too, for the layering and for cycles (reported apart): an annotation that names a module
above is still a dependency on it, and an annotation-only circle is still two modules that cannot be
read, or changed, one without the other. ``from pkg import name`` is an edge to ``pkg.name`` when that
is a module, else to ``pkg``; importing ``a.b`` also runs ``a/__init__.py``, but that implicit edge is
not counted (it would make every package's ``__init__`` part of a cycle with its own submodules).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fileio", "suffix_index", "retrieval", "privacy", "serving", "grpc_api", "http_api", "verifier",
            "neural_drafters", "replay_traces", "reprise")
FRONTS = ("grpc_api", "http_api")

# Top-level package -> the project packages it may import (docs/architecture.md, "Layers").
MAY_IMPORT: dict[str, frozenset[str]] = {
    "fileio": frozenset(),
    "suffix_index": frozenset(),
    "retrieval": frozenset({"suffix_index", "fileio"}),
    "privacy": frozenset({"fileio"}),
    "serving": frozenset(),
    "grpc_api": frozenset({"serving", "fileio"}),
    "http_api": frozenset({"serving"}),
    "verifier": frozenset({"retrieval", "fileio"}),
    "neural_drafters": frozenset({"retrieval", "verifier", "fileio"}),
    "replay_traces": frozenset({"retrieval", "suffix_index", "fileio"}),
    "reprise": frozenset(PACKAGES),
}

# Inside reprise, no part imports the parts above it. The most specific prefix that names a module
# decides. reprise.service, the wiring, sits above server and cluster; the engine, the backends, the
# server's parts and the cluster import neither front (grpc_api, http_api): only the wiring and the
# command line reach them.
_FRONT = ("reprise.cli", "reprise.commands", "reprise.benchmarks")
MUST_NOT_IMPORT: dict[str, tuple[str, ...]] = {
    "reprise.engine": ("reprise.backends", "reprise.server", "reprise.cluster", "reprise.offline",
                       "reprise.service", *FRONTS, *_FRONT),
    "reprise.backends": ("reprise.server", "reprise.cluster", "reprise.offline", "reprise.service", *FRONTS,
                         *_FRONT),
    "reprise.server": ("reprise.cluster", "reprise.offline", "reprise.service", *FRONTS, *_FRONT),
    "reprise.server.dashboard.http": ("reprise.cluster", "reprise.offline", "reprise.service", "grpc_api", *_FRONT),
    "reprise.service": ("reprise.offline", *_FRONT),
    "reprise.cluster": ("reprise.service", *FRONTS, *_FRONT),
    "reprise.cluster.launch": _FRONT,  # a replica process: it runs the service
    "reprise.offline": ("reprise.server", "reprise.cluster", *_FRONT),
    "reprise.drafters": ("reprise.engine", "reprise.backends", "reprise.server", "reprise.cluster",
                         "reprise.offline", "reprise.service", *FRONTS, *_FRONT),
    "reprise.config": ("reprise.engine", "reprise.backends", "reprise.server", "reprise.cluster", "reprise.offline",
                       "reprise.service", *FRONTS, *_FRONT),
    "reprise.arguments": ("reprise",),
    "reprise.benchmarks": ("reprise.cli", "reprise.commands"),
    "reprise.commands": ("reprise.cli",),
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every project module by dotted name (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
        for stub in (root / package).rglob("*.pyi"):  # a compiled extension has its stub here: a leaf
            parts = list(stub.relative_to(root).with_suffix("").parts)
            found.setdefault(".".join(parts), stub)
    return found


def _imports(tree: ast.Module, annotations: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that runs, and with ``annotations`` those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if not annotations and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            else:
                stack.append(child)


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The project module ``name`` lives in (itself, or its closest known parent)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(known: dict[str, Path], annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``annotations``: ``TYPE_CHECKING`` imports too)."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        if path.suffix != ".py":
            continue
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), annotations):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package of this module, up level - 1
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join([*package, base] if base else package)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            for target in targets:
                owner = _owner(target, known)
                if owner is not None and owner != name:
                    graph[name].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (deep graphs)
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                return [*paths[node], start]
            if child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    return sorted(component)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The edges the layering rules forbid: (importer, imported)."""
    bad = []
    for source, targets in sorted(graph.items()):
        top = source.split(".")[0]
        prefixes = [prefix for prefix in MUST_NOT_IMPORT if _within(source, prefix)]
        rules = [MUST_NOT_IMPORT[max(prefixes, key=len)]] if prefixes else []
        for target in sorted(targets):
            target_top = target.split(".")[0]
            across = target_top != top and target_top not in MAY_IMPORT[top]
            upward = any(_within(target, b) and not _within(target, source) for banned in rules for b in banned)
            if across or upward:
                bad.append((source, target))
    return bad


def problems(root: Path = ROOT) -> list[str]:
    """One line per cycle and per forbidden import; empty when the graph is clean."""
    known = modules(root)
    graph = edges(known)
    annotated = edges(known, annotations=True)
    lines = [f"cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    runtime = {frozenset(cycle) for cycle in cycles(graph)}
    lines += [f"cycle through TYPE_CHECKING imports: {' -> '.join(cycle)}" for cycle in cycles(annotated)
              if frozenset(cycle) not in runtime]
    lines += [f"layering rule for {prefix} names no module (moved? update MUST_NOT_IMPORT)"
              for prefix in MUST_NOT_IMPORT if (root / "reprise").is_dir() and not any(_within(m, prefix) for m in known)]
    lines += [f"forbidden import: {source} imports {target} (docs/architecture.md, Layers)"
              for source, target in forbidden(annotated)]
    return lines


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", action="store_true", help="print every project-internal import edge")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.edges:
        for source, targets in sorted(edges(modules()).items()):
            for target in sorted(targets):
                print(f"{source} -> {target}")
        return 0
    found = problems()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
