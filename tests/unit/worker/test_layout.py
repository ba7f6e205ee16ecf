"""The worker's layout: rooms of a readable size, and imports that point one way.

``services/worker/README.md`` draws the rooms and the order they import each other in; these checks
keep the drawing true: no file grows past ``MAX_LINES``, and the modules' imports (at module level or
inside a function: a lazy import that closes a cycle is still a cycle) form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[3] / "services" / "worker"
PACKAGE = "services.worker"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(WORKER.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(WORKER.rglob("*.py"))}


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The worker modules ``path`` imports (``from pkg import module`` counts as the module)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        if _under_type_checking(node, parents):
            continue
        found.update(n for n in names if n.startswith(PACKAGE) and n in modules)
    found.discard(_module_name(path))
    return found


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (the modules along it, the first repeated last), or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_no_worker_file_is_longer_than_the_limit():
    long = {str(p.relative_to(WORKER)): n for p in WORKER.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_worker_imports_form_no_cycle():
    modules = _modules()
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert graph[f"{PACKAGE}.service.service"], "the import graph was read (the service imports the engine)"
    assert import_cycle(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
