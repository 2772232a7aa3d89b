"""The package's import graph: no circle, ``install`` on top, ``ticks`` at the bottom (read from the source with ast).

Every import counts, also those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fdg_schedule"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``fdg_schedule`` itself stands for ``__init__.py``)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name, edges = _module_name(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the list of modules along it, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once all below it are checked

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_no_import_circle() -> None:
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_install_is_on_top_and_ticks_at_the_bottom() -> None:
    graph = import_graph()
    assert graph["fdg_schedule.ticks"] == set()
    importers = {name for name, edges in graph.items() if "fdg_schedule.install" in edges}
    assert importers <= {"fdg_schedule"}, importers  # only the package's __init__ re-exports it
    for low in ("fdg_schedule.schedule", "fdg_schedule.view", "fdg_schedule.tracking", "fdg_schedule.timeline"):
        assert "fdg_schedule.engine" not in graph[low], f"{low} imports the engine"
    assert graph["fdg_schedule.launch"] == set()  # Note [a rank does not import the package]


def test_the_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
