"""The package's import graph: no circle, ``install`` on top, ``ticks`` at the bottom (read from the source with ast).

Every import counts, also those inside functions and under ``TYPE_CHECKING``. The last test imports for
real: a circle through DeepSpeed's import hook does not show in the source.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
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
    assert graph["fdg_schedule.sched.ticks"] == set()
    importers = {name for name, edges in graph.items() if "fdg_schedule.runtime.install" in edges}
    assert importers <= {"fdg_schedule"}, importers  # only the package's __init__ re-exports it
    for low in (
        "fdg_schedule.sched.schedule",
        "fdg_schedule.observability.view",
        "fdg_schedule.corrections.tracking",
        "fdg_schedule.observability.timeline",
    ):
        assert "fdg_schedule.runtime.engine" not in graph[low], f"{low} imports the engine"
    assert graph["fdg_schedule.tools.launch"] == set()  # Note [a rank does not import the package]


def test_the_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# A circle through DeepSpeed, which the graph above cannot see: importing DeepSpeed runs the package's
# hook (install.guard), which imports modules of its own (Note [imported before deepspeed]). Were one of
# them importing DeepSpeed at its top, a program whose first import is that module would fail.
FIRST_IMPORT_PROBE = r"""
import json, os, sys
import torch  # shared by the forked children; DeepSpeed and the package are imported in each child

def in_child(job):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            message = json.dumps(job())
        except BaseException as error:
            message = json.dumps(f"{type(error).__name__}: {error}")
        os.write(w, message.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)

def loaded_by_the_hook():
    import deepspeed  # noqa: F401  (the hook runs here)
    return sorted(m for m in sys.modules if m.startswith("fdg_schedule"))

def first(name):
    def job():
        import importlib
        importlib.import_module(name)
        import deepspeed
        from deepspeed.runtime.pipe.module import PipelineModule
        guarded = getattr(deepspeed.initialize, "__fdg_schedule_guard__", False)
        patched = getattr(PipelineModule._partition_layers, "_fdg_original", None) is not None
        return "ok" if guarded and patched else f"imported, but guarded={guarded} partition methods={patched}"
    return job

import fdg_schedule  # noqa: F401  (registers the hook where the package is only on PYTHONPATH; it imports
                     # neither torch nor DeepSpeed, so each child still imports the module before DeepSpeed)
modules = in_child(loaded_by_the_hook)
print("REPORT" + json.dumps({name: in_child(first(name)) for name in modules}))
"""


def test_every_module_the_deepspeed_hook_loads_can_be_imported_first() -> None:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "DS_ACCELERATOR": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT_PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.split("REPORT")[-1])
    assert "fdg_schedule.partitioning.pipe_partition" in report, (
        f"the hook no longer loads pipe_partition: {sorted(report)}"
    )
    assert {name: result for name, result in report.items() if result != "ok"} == {}
