"""The module paths that moved (the subpackages of 0.4.0, the ground floor of 0.6.0), kept working with a warning.

Note [old module paths]: before 0.4.0 every module sat at the package's top (``fdg_schedule.timeline``,
``fdg_schedule.pipe_partition``, ...), and the README and the guides told users to import or run them
there; in 0.6.0 the leaf helpers left ``fdg_schedule.runtime`` for the ground floor ``fdg_schedule.base``
(``fdg_schedule.runtime.config`` -> ``fdg_schedule.base.config``, ...), the W&B tracker went to
``fdg_schedule.observability``. Each old path still works, once per use site with a ``DeprecationWarning``
that names the new path:

- ``from fdg_schedule import pipe_partition`` and ``fdg_schedule.pipe_partition``: the package's
  ``__getattr__`` (:func:`resolve`), and likewise each subpackage's that a module left
  (``fdg_schedule.runtime.config``);
- ``import fdg_schedule.timeline``, ``from fdg_schedule.install import guard``: :class:`OldPathFinder`
  on ``sys.meta_path`` gives the old name the new module itself (one module object, not a copy);
- ``python -m fdg_schedule.timeline``: the same finder's loader runs the new module as ``__main__``.

Nothing here imports a module of the package at its top: the new path is imported only when an old
one is asked for, so the layering of docs/architecture.md holds. docs/api.md lists the table and the
promise (an old path works until 1.0).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

# old path -> new path, one line per module the 0.4.0 relayout moved (git mv, f55f065), to where it is now
RELAYOUT: dict[str, str] = {
    "fdg_schedule.auto_corrections": "fdg_schedule.corrections.auto_corrections",
    "fdg_schedule.checkpoint": "fdg_schedule.checkpointing.checkpoint",
    "fdg_schedule.comm": "fdg_schedule.exchange.comm",
    "fdg_schedule.config": "fdg_schedule.base.config",
    "fdg_schedule.delayed": "fdg_schedule.corrections.delayed",
    "fdg_schedule.dispatch": "fdg_schedule.base.dispatch",
    "fdg_schedule.engine": "fdg_schedule.runtime.engine",
    "fdg_schedule.engine_checkpoints": "fdg_schedule.runtime.engine_checkpoints",
    "fdg_schedule.errors": "fdg_schedule.base.errors",
    "fdg_schedule.flat_state": "fdg_schedule.exchange.flat_state",
    "fdg_schedule.fp16": "fdg_schedule.precision.fp16",
    "fdg_schedule.fp16_optimizer": "fdg_schedule.precision.fp16_optimizer",
    "fdg_schedule.grid": "fdg_schedule.sched.grid",
    "fdg_schedule.guards": "fdg_schedule.base.guards",
    "fdg_schedule.host_memory": "fdg_schedule.base.host_memory",
    "fdg_schedule.install": "fdg_schedule.runtime.install",
    "fdg_schedule.launch": "fdg_schedule.tools.launch",
    "fdg_schedule.loading": "fdg_schedule.runtime.loading",
    "fdg_schedule.loss_scale": "fdg_schedule.precision.loss_scale",
    "fdg_schedule.observe": "fdg_schedule.observability.observe",
    "fdg_schedule.optim": "fdg_schedule.base.optim",
    "fdg_schedule.partition": "fdg_schedule.partitioning.partition",
    "fdg_schedule.pipe_partition": "fdg_schedule.partitioning.pipe_partition",
    "fdg_schedule.profile": "fdg_schedule.partitioning.profile",
    "fdg_schedule.reference": "fdg_schedule.corrections.reference",
    "fdg_schedule.replicas": "fdg_schedule.checkpointing.replicas",
    "fdg_schedule.report": "fdg_schedule.observability.report",
    "fdg_schedule.rng": "fdg_schedule.base.rng",
    "fdg_schedule.schedule": "fdg_schedule.sched.schedule",
    "fdg_schedule.shm_link": "fdg_schedule.exchange.shm_link",
    "fdg_schedule.stage_backward": "fdg_schedule.runtime.stage_backward",
    "fdg_schedule.stage_state": "fdg_schedule.runtime.stage_state",
    "fdg_schedule.stage_times": "fdg_schedule.tools.stage_times",
    "fdg_schedule.staging": "fdg_schedule.runtime.staging",
    "fdg_schedule.staleness": "fdg_schedule.corrections.staleness",
    "fdg_schedule.staleness_log": "fdg_schedule.tools.staleness_log",
    "fdg_schedule.tensors": "fdg_schedule.base.tensors",
    "fdg_schedule.ticks": "fdg_schedule.sched.ticks",
    "fdg_schedule.tied": "fdg_schedule.exchange.tied",
    "fdg_schedule.timeline": "fdg_schedule.observability.timeline",
    "fdg_schedule.tracking": "fdg_schedule.observability.tracking",
    "fdg_schedule.view": "fdg_schedule.observability.view",
    "fdg_schedule.watchdog": "fdg_schedule.base.watchdog",
}

# old path -> new path, one line per module the ground floor moved (issue 65, part 2; git mv): the leaf helpers
# from runtime/ into base/, the W&B tracker into observability/, the tied copies' flat layout beside the tied sync
GROUND_FLOOR: dict[str, str] = {
    "fdg_schedule.runtime.config": "fdg_schedule.base.config",
    "fdg_schedule.runtime.dispatch": "fdg_schedule.base.dispatch",
    "fdg_schedule.runtime.errors": "fdg_schedule.base.errors",
    "fdg_schedule.runtime.guards": "fdg_schedule.base.guards",
    "fdg_schedule.runtime.host_memory": "fdg_schedule.base.host_memory",
    "fdg_schedule.runtime.optim": "fdg_schedule.base.optim",
    "fdg_schedule.runtime.rng": "fdg_schedule.base.rng",
    "fdg_schedule.runtime.tensors": "fdg_schedule.base.tensors",
    "fdg_schedule.runtime.watchdog": "fdg_schedule.base.watchdog",
    "fdg_schedule.corrections.tracking": "fdg_schedule.observability.tracking",
    "fdg_schedule.checkpointing.flat_state": "fdg_schedule.exchange.flat_state",
}

MOVED: dict[str, str] = {**RELAYOUT, **GROUND_FLOOR}
# old path -> the release from which it is deprecated
SINCE: dict[str, str] = {**dict.fromkeys(RELAYOUT, "0.4.0"), **dict.fromkeys(GROUND_FLOOR, "0.6.0")}


def message(old: str, new: str) -> str:
    since = SINCE[old]
    return f"{old} moved to {new}; import {new} (the old path is deprecated since fdg_schedule {since}, removed in 1.0)"


def resolve(package: str, name: str) -> types.ModuleType:
    """``<package>.<name>`` for an old path, with the warning at the caller's line; AttributeError otherwise."""
    new = MOVED.get(f"{package}.{name}")
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(message(f"{package}.{name}", new), DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` only (last on ``sys.meta_path``: a real module always wins)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        new_spec = importlib.util.find_spec(new)
        origin = new_spec.origin if new_spec is not None else None
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new), origin=origin)


class _Alias(importlib.abc.Loader):
    """The old name bound to the new module: ``sys.modules[old] is sys.modules[new]``."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # stacklevel 2: the first frame outside importlib's own, the line that imported the old path
        warnings.warn(message(self.old, self.new), DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set the old name's spec on the new module; give it back

    def get_code(self, fullname: str) -> types.CodeType:
        """``python -m <old>``: warn in ``__main__`` (shown by default) and run the new module as ``__main__``."""
        source = (
            "import runpy, warnings\n"
            f"warnings.warn({message(self.old, self.new)!r}, DeprecationWarning)\n"
            f"runpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{self.old}, moved to {self.new}>", "exec")


class _Package(types.ModuleType):
    """The package's module type: importing an old module path never rebinds a public name.

    ``from fdg_schedule.install import guard`` would otherwise set the package's ``install`` (the
    function in ``__all__``) to the module, as it did before 0.4.0 too only until ``__init__`` rebound it.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in getattr(self, "__all__", ()):
            return
        super().__setattr__(name, value)


def keep_old_paths(package: types.ModuleType) -> None:
    """Make the old paths of :data:`MOVED` work under ``package`` (called once, by its ``__init__``)."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
    package.__class__ = _Package
