"""Arms fdg_schedule's guard on ``deepspeed.initialize`` the moment a program imports DeepSpeed.

``fdg_schedule_autoinstall.pth``, installed with the package, runs :func:`watch` at every interpreter
start. That puts a :class:`DeepSpeedImportWatcher` first on ``sys.meta_path``: it answers no import
but ``deepspeed``'s, and once ``deepspeed/__init__.py`` has run it hands the module to
``fdg_schedule.runtime.install.guard`` and leaves ``sys.meta_path``. Until a program imports DeepSpeed,
nothing of fdg_schedule, torch or DeepSpeed is loaded: this module uses only ``sys``, already loaded
(see Note [the start-up hook] in fdg_schedule/runtime/install.py).
"""

import sys


def watch():
    """Guard DeepSpeed now if it is imported already, else as soon as it is (idempotent)."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "initialize"):
        _guard(deepspeed)
    elif not any(isinstance(finder, DeepSpeedImportWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportWatcher())


def unwatch():
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, DeepSpeedImportWatcher)]


class DeepSpeedImportWatcher:
    """A meta-path finder that finds nothing itself: it makes DeepSpeed's own loader guard the module."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        for finder in sys.meta_path:  # the finders that would have found DeepSpeed without us
            find_spec = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find_spec(name, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _GuardAfterExec(spec.loader)
                return spec
        return None


class _GuardAfterExec:
    """DeepSpeed's loader, which guards the package once ``deepspeed/__init__.py`` has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # DeepSpeed runs (and keeps) its own loader: importlib.resources, inspect and pickle see no trace of us.
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        unwatch()
        _guard(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


# The guard to run on DeepSpeed, as an entry point ("module:function") resolved only once DeepSpeed is
# imported: this hook is the bottom layer (it imports nothing of fdg_schedule; fdg_schedule.runtime.install
# imports it), so there is no import circle between the two.
GUARD = "fdg_schedule.runtime.install:guard"


def _guard(deepspeed):
    from importlib import import_module

    module, _, function = GUARD.partition(":")
    guard = getattr(import_module(module), function, None)
    if guard is not None:  # None: an older fdg_schedule shadows this one on sys.path; it hooks in when imported
        guard(deepspeed)
