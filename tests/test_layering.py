"""docs/architecture.md's layering rule, read from its layer table and checked on the source (ast).

A module imports only its own layer or layers below it; no two subpackages import each other; the ground
floor (``fdg_schedule.base``) imports nothing of the package outside itself. Every import counts, also those
inside functions and under ``TYPE_CHECKING`` (the graph of tests/test_imports.py). The layer order lives in
one place, the table under ``<!-- layers: ... -->`` in docs/architecture.md; this file only reads it.
"""

from __future__ import annotations

import re

from test_imports import PACKAGE, import_graph

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
GROUND_FLOOR = "base"

# (importer, imported) -> why the edge may break the rule for now: one list, empty when the house is in order.
ALLOWED: dict[tuple[str, str], str] = {}


def layers() -> list[tuple[str, list[str]]]:
    """docs/architecture.md's layer table, top to bottom: (layer, its groups)."""
    text = ARCHITECTURE.read_text()
    start = text.index("<!-- layers:")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [(row[0], re.findall(r"`([^`]+)`", row[1])) for row in rows[2:]]  # past the header and rule


def group(module: str) -> str:
    """The group a module belongs to: its subpackage, a top-level module's own name, or the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def level() -> dict[str, int]:
    """group -> its layer's height (0 = the ground floor)."""
    table = layers()
    return {name: len(table) - 1 - i for i, (_, groups) in enumerate(table) for name in groups}


def upward(graph: dict[str, set[str]], heights: dict[str, int]) -> set[tuple[str, str]]:
    """Every import of a module from a layer above the importer's own."""
    return {(src, dst) for src, dsts in graph.items() for dst in dsts if heights[group(dst)] > heights[group(src)]}


def mutual(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every pair of groups (a, b), a < b, in which each imports the other."""
    edges = {(group(src), group(dst)) for src, dsts in graph.items() for dst in dsts if group(src) != group(dst)}
    return {(a, b) for a, b in edges if a < b and (b, a) in edges}


def test_every_group_has_exactly_one_layer() -> None:
    named = [name for _, groups in layers() for name in groups]
    assert len(named) == len(set(named)), f"docs/architecture.md names a group twice: {named}"
    present = {group(module) for module in import_graph()}
    assert present == set(named), f"groups without a layer: {present - set(named)}; gone: {set(named) - present}"
    assert layers()[-1][1][0] == GROUND_FLOOR, "the ground floor is the table's last row"


def test_no_module_imports_a_layer_above_its_own() -> None:
    found = upward(import_graph(), level())
    broken = sorted(found - set(ALLOWED))
    assert not broken, "imports against docs/architecture.md's layers:\n" + "\n".join(f"{a} -> {b}" for a, b in broken)
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"ALLOWED lists edges that no longer exist; drop them: {stale}"


def test_no_two_subpackages_import_each_other() -> None:
    excused = {tuple(sorted((group(src), group(dst)))) for src, dst in ALLOWED}  # an allowed edge explains its pair
    pairs = mutual(import_graph()) - excused
    assert not pairs, f"subpackages that import each other: {sorted(pairs)}"


def test_the_ground_floor_imports_nothing_else_of_the_package() -> None:
    graph = import_graph()
    for name, edges in graph.items():
        if group(name) == GROUND_FLOOR or name == "fdg_schedule._moved":
            outside = {edge for edge in edges if group(edge) != GROUND_FLOOR}
            assert not outside, f"{name} is on the ground floor but imports {outside}"


def test_the_checks_find_what_breaks_the_rule() -> None:
    heights = {"top": 2, "mid": 1, "base": 0}
    graph = {"p.top.a": {"p.mid.b"}, "p.mid.b": {"p.base.c", "p.top.a"}, "p.base.c": set()}
    assert upward(graph, heights) == {("p.mid.b", "p.top.a")}
    assert mutual(graph) == {("mid", "top")}
    assert [name for _, groups in layers() for name in groups][:1] == ["tools"]  # the table is read, top first
