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


HOOK = PACKAGE.parent / "_fdg_schedule_autoinstall.py"
RUNTIME = (
    "base",
    "sched",
    "runtime",
    "exchange",
    "checkpointing",
    "corrections",
    "partitioning",
    "precision",
    "observability",
)


def full_graph() -> dict[str, set[str]]:
    """The package's graph plus the start-up hook, whose ``import_module("...")`` strings count as imports."""
    graph = import_graph()
    edges: set[str] = set()
    for node in ast.walk(ast.parse(HOOK.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            edges |= {n for n in names if n and n.split(".")[0] == "fdg_schedule"}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in graph:
            edges.add(node.value)
    graph["_fdg_schedule_autoinstall"] = edges
    for name, mods in graph.items():
        if name != "_fdg_schedule_autoinstall" and "_fdg_schedule_autoinstall" in _imported_names(name):
            mods.add("_fdg_schedule_autoinstall")
    return graph


def _imported_names(module: str) -> set[str]:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_import_circle() -> None:
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])
    assert find_cycle(full_graph()) is None, " -> ".join(find_cycle(full_graph()) or [])


def test_the_start_up_hook_imports_nothing_of_the_package() -> None:
    assert full_graph()["_fdg_schedule_autoinstall"] == set()


def test_the_runtime_never_imports_the_tools_the_zoo_or_the_planner() -> None:
    graph = import_graph()
    above = ("fdg_schedule.tools", "fdg_schedule.zoo", "fdg_schedule.plan")
    for name, edges in graph.items():
        if name.split(".")[1:2] and name.split(".")[1] in RUNTIME:
            upward = {e for e in edges if e.startswith(above)}
            assert not upward, f"{name} imports {upward}"


def test_the_planner_imports_only_torch_free_modules() -> None:
    graph = import_graph()
    allowed = {
        "fdg_schedule",
        "fdg_schedule.sched",
        "fdg_schedule.sched.actions",
        "fdg_schedule.sched.kinds",
        "fdg_schedule.sched.lowering",
        "fdg_schedule.sched.ticks",
        "fdg_schedule.partitioning",
        "fdg_schedule.partitioning.contiguous_split",
        "fdg_schedule.partitioning.profile_format",
        "fdg_schedule.partitioning.stage_memory",
        "fdg_schedule.zoo",
    }
    allowed |= {"fdg_schedule.zoo.resnet", "fdg_schedule.zoo.resnet_shapes"}  # resnet: inside estimate_resnet only
    allowed |= {"fdg_schedule.observability.timeline"}  # inside --trace only (a trace is read with the runtime's tools)
    for name, edges in graph.items():
        if name.startswith("fdg_schedule.plan"):
            outside = {e for e in edges if not e.startswith("fdg_schedule.plan")} - allowed
            assert not outside, f"{name} imports {outside}"


# Importing torch or DeepSpeed fails in this process: the planner must not need them.
NO_TORCH = """
import sys


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "deepspeed", "torchvision"):  # numpy is allowed: the split solver's
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, _Blocker())
"""


def test_the_planner_and_the_grid_run_without_torch(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PACKAGE.parent)])}
    env["FDG_SCHEDULE_AUTO_INSTALL"] = "0"
    check = "import torch"
    blocked = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert "torch is blocked" in blocked.stderr, blocked.stderr  # the blocker works
    plan = ["-m", "fdg_schedule.plan", "--model", "gpt-1.3b", "--gpu", "H100", "--micro-batch", "1"]
    plan += ["--cluster", "h100-ib", "--stages", "4"]  # a whole plan: every schedule's streams simulated
    grid = "from fdg_schedule.sched import grid; g = grid.plan(3, 8, 5); assert g.validate() == []; print(g.render())"
    for argv in (
        ["-c", grid],  # the whole pipeline's plan, an end of data included, checked and printed (issue 65)
        ["-c", "import fdg_schedule.plan, fdg_schedule.plan.__main__"],
        ["-m", "fdg_schedule.plan", "--help"],
        plan,
    ):
        run = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
    assert "Recommendation" in run.stdout, run.stdout


def test_install_is_on_top_and_ticks_at_the_bottom() -> None:
    graph = import_graph()
    assert graph["fdg_schedule.sched.ticks"] == set()
    importers = {name for name, edges in graph.items() if "fdg_schedule.runtime.install" in edges}
    assert importers <= {"fdg_schedule"}, importers  # only the package's __init__ re-exports it
    for low in (
        "fdg_schedule.sched.schedule",
        "fdg_schedule.observability.view",
        "fdg_schedule.observability.tracking",
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


def test_architecture_lists_every_module() -> None:
    """docs/architecture.md's module table names every module of the package (item 7 of issue 43)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    files = [path for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"]
    modules = {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts) for path in files}
    missing = sorted(name for name in modules if f"`{name}`" not in text)
    assert not missing, f"docs/architecture.md does not list {missing}"


def test_the_engine_class_stays_within_400_lines() -> None:
    source = (PACKAGE / "runtime" / "engine.py").read_text().splitlines()
    start = next(i for i, line in enumerate(source) if line.startswith("class FDGPipelineEngine"))
    end = next((i for i in range(start + 1, len(source)) if source[i] and not source[i][0].isspace()), len(source))
    assert end - start <= 400, f"FDGPipelineEngine is {end - start} lines; move a concern out (issue 43, item 8)"


def test_no_package_file_is_over_500_lines_unless_its_docstring_says_why() -> None:
    """Issue 65, item 8: a module over ~500 lines says in its docstring why it stays one file ("Long because ...")."""
    import ast

    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 500 and "Long because" not in (ast.get_docstring(ast.parse(source)) or ""):
            long.append(f"{path.relative_to(PACKAGE)} ({len(source.splitlines())} lines)")
    assert not long, f"split these, or say in the module docstring why they are long ('Long because ...'): {long}"
