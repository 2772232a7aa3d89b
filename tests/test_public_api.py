"""The public API (docs/api.md): ``fdg_schedule.__all__``, the public modules and entry points, the old module paths.

Each table of docs/api.md is checked against the code; every path that moved (0.4.0, 0.6.0) still imports, runs with
``python -m`` and resolves as an attribute, each with a ``DeprecationWarning`` that names the new path.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import fdg_schedule
from fdg_schedule import _moved

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"


def table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``## <heading>`` in docs/api.md, each row's cells stripped."""
    text = API.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    rows = [line for line in text[start : end if end > 0 else None].splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # past the header and rule


def code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@pytest.fixture
def fresh_old_paths() -> Iterator[None]:
    """Forget every old path imported so far, so that a test sees its own first use (and its warning)."""

    def forget() -> None:
        for old in _moved.MOVED:
            sys.modules.pop(old, None)
            parent, _, short = old.rpartition(".")
            package = sys.modules.get(parent)
            if package is not None and short not in getattr(package, "__all__", ()):
                package.__dict__.pop(short, None)

    forget()
    yield
    forget()


def test_every_name_in_all_resolves() -> None:
    for name in fdg_schedule.__all__:
        assert getattr(fdg_schedule, name) is not None, name
    assert len(set(fdg_schedule.__all__)) == len(fdg_schedule.__all__)


def test_the_page_lists_exactly_all() -> None:
    listed = [code_names(row[0])[0] for row in table("Importable from `fdg_schedule`")]
    assert sorted(listed) == sorted(fdg_schedule.__all__), "docs/api.md's first table must list fdg_schedule.__all__"


def test_every_public_module_and_name_resolves() -> None:
    rows = table("Public modules")
    assert rows, "docs/api.md lists no public module"
    for row in rows:
        module = importlib.import_module(code_names(row[0])[0])
        names = code_names(row[1])
        if "__all__" in row[1]:
            names = list(module.__all__)
        assert names, f"{module.__name__}: docs/api.md names nothing of it"
        missing = [name for name in names if not hasattr(module, name)]
        assert not missing, f"docs/api.md lists {missing} in {module.__name__}, which has no such name"


def test_every_entry_point_runs_as_a_module() -> None:
    for row in table("Entry points"):
        command = code_names(row[0])[0]
        assert command.startswith("python -m "), command
        name = command.removeprefix("python -m ")
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, f"{command}: no such module"
        if spec.submodule_search_locations is not None:
            assert importlib.util.find_spec(f"{name}.__main__") is not None, f"{command}: a package without __main__"
        else:
            assert 'if __name__ == "__main__":' in Path(spec.origin).read_text(), f"{command}: no main block"


def test_the_old_paths_table_is_the_code_table() -> None:
    listed = {code_names(old)[0]: code_names(new)[0] for old, new, _ in table("Old paths")}
    assert listed == _moved.MOVED
    assert {code_names(old)[0]: since for old, _, since in table("Old paths")} == _moved.SINCE


def test_every_old_path_is_free_and_every_new_path_exists() -> None:
    for old, new in _moved.MOVED.items():
        assert old.rpartition(".")[2] == new.rpartition(".")[2], f"{old} -> {new}: a move keeps the module's name"
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} is a real module again; drop its alias"
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no module {new}"


@pytest.mark.usefixtures("fresh_old_paths")
@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_imports_the_new_module_with_a_warning(old: str) -> None:
    new = _moved.MOVED[old]
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")) as caught:
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) is sys.modules[old]
    assert module.__name__ == new and module.__spec__.name == new  # the new module, its own spec given back
    assert [w.filename for w in caught if issubclass(w.category, DeprecationWarning)][0] != _moved.__file__


@pytest.mark.usefixtures("fresh_old_paths")
def test_from_the_package_import_an_old_module() -> None:
    """README before 0.4.0: ``from fdg_schedule import pipe_partition``; the warning points at the importing line."""
    with pytest.warns(DeprecationWarning, match=r"import fdg_schedule\.partitioning\.pipe_partition") as caught:
        from fdg_schedule import pipe_partition
    assert pipe_partition is importlib.import_module("fdg_schedule.partitioning.pipe_partition")
    assert {w.filename for w in caught if "moved to" in str(w.message)} == {__file__}
    with pytest.warns(DeprecationWarning, match=r"fdg_schedule\.observability\.timeline"):
        assert fdg_schedule.timeline is importlib.import_module("fdg_schedule.observability.timeline")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        fdg_schedule.no_such_module  # noqa: B018


@pytest.mark.usefixtures("fresh_old_paths")
def test_a_subpackage_gives_the_modules_that_left_it() -> None:
    """0.6.0's ground floor: ``from fdg_schedule.runtime import config`` and ``fdg_schedule.runtime.config``."""
    import fdg_schedule.runtime

    moved = r"fdg_schedule\.runtime\.config moved to fdg_schedule\.base\.config; .* since fdg_schedule 0\.6\.0"
    with pytest.warns(DeprecationWarning, match=moved) as caught:
        from fdg_schedule.runtime import config
    assert config is importlib.import_module("fdg_schedule.base.config")
    assert {w.filename for w in caught if "moved to" in str(w.message)} == {__file__}
    fdg_schedule.runtime.__dict__.pop("config", None)
    with pytest.warns(DeprecationWarning, match=r"fdg_schedule\.base\.host_memory"):
        assert fdg_schedule.runtime.host_memory is importlib.import_module("fdg_schedule.base.host_memory")
    with pytest.warns(DeprecationWarning, match=r"fdg_schedule\.observability\.tracking"):
        from fdg_schedule.corrections.tracking import read_offline_run
    assert read_offline_run is importlib.import_module("fdg_schedule.observability.tracking").read_offline_run
    with pytest.raises(AttributeError, match="'fdg_schedule.runtime' has no attribute 'no_such_module'"):
        fdg_schedule.runtime.no_such_module  # noqa: B018


@pytest.mark.usefixtures("fresh_old_paths")
def test_import_statements_of_old_paths() -> None:
    moved = r"fdg_schedule\.timeline moved to fdg_schedule\.observability\.timeline"
    with pytest.warns(DeprecationWarning, match=moved):
        import fdg_schedule.timeline
    assert fdg_schedule.timeline is sys.modules["fdg_schedule.observability.timeline"]
    with pytest.warns(DeprecationWarning, match=r"fdg_schedule\.install moved to fdg_schedule\.runtime\.install"):
        from fdg_schedule.install import TESTED_DEEPSPEED, guard
    from fdg_schedule.runtime import install as new_install

    assert (guard, TESTED_DEEPSPEED) == (new_install.guard, new_install.TESTED_DEEPSPEED)
    assert fdg_schedule.install is new_install.install  # the public function, not rebound to the old module


def test_python_m_an_old_path_runs_the_new_module_with_a_warning() -> None:
    """``python -m fdg_schedule.timeline`` (the observability guide before 0.4.0), default warning filters."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FDG_SCHEDULE_AUTO_INSTALL": "0"}
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run(
        [sys.executable, "-m", "fdg_schedule.timeline", "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "usage: python -m fdg_schedule.observability.timeline" in run.stdout, run.stdout
    assert "DeprecationWarning: fdg_schedule.timeline moved to fdg_schedule.observability.timeline" in run.stderr
    assert run.stderr.count("DeprecationWarning") == 1, run.stderr


def test_no_code_outside_the_runtime_touches_the_instruction_map() -> None:
    """Issue 65 part 5: the engine's ``_INSTRUCTION_MAP`` is read and written by fdg_schedule.runtime and the dispatch
    loop (fdg_schedule.base.dispatch: ``execute`` runs it, ``observe`` times a stock engine's) only; others use
    ``fdg_schedule.base.dispatch.observe`` (tests of the engine itself excepted)."""
    paths = [*(ROOT / "fdg_schedule").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    paths += [*(ROOT / "recipes").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    runtime, loop = ROOT / "fdg_schedule" / "runtime", ROOT / "fdg_schedule" / "base" / "dispatch.py"
    touching = [p.relative_to(ROOT) for p in paths if runtime not in p.parents and p != loop]
    touching = [p for p in touching if "_INSTRUCTION_MAP" in (ROOT / p).read_text()]
    assert not touching, f"{touching} touch the engine's _INSTRUCTION_MAP; use fdg_schedule.base.dispatch.observe"


def test_the_version_is_the_newest_release() -> None:
    version = re.findall(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[0]  # [project]'s
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases, "CHANGELOG.md has no release section (## [x.y.z] - yyyy-mm-dd)"
    assert version == releases[0][0] == fdg_schedule.__version__, (version, releases[0], fdg_schedule.__version__)
    numbers = [tuple(int(part) for part in number.split(".")) for number, _ in releases]
    assert numbers == sorted(numbers, reverse=True), "release sections must run newest first"
    assert [date for _, date in releases] == sorted((date for _, date in releases), reverse=True)
