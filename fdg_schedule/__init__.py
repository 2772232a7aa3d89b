"""fdg_schedule: fully decoupled learning with delayed gradients (FDG) as a DeepSpeed pipeline schedule.

The config switches a job: with the package installed, ``deepspeed.initialize`` builds an
:class:`FDGPipelineEngine` for a ``PipelineModule`` whose config says
``"pipeline": {"schedule": "fdg"}``, and DeepSpeed's own engine, untouched, for any other config
(see Note [the start-up hook] in :mod:`fdg_schedule.runtime.install`). ``import fdg_schedule`` does the same
where the package is only on ``PYTHONPATH``. ``fdg_schedule.initialize(...)`` builds the FDG engine
even with ``FDG_SCHEDULE_AUTO_INSTALL=0``, which makes ``deepspeed.initialize`` refuse FDG configs.

Importing the package loads neither torch nor DeepSpeed; the engine and the reference load on first use.
``__all__`` is the public API of this module; docs/api.md lists it with the public modules, the ``python -m``
entry points and the promise. The module paths from before 0.4.0 (``fdg_schedule.timeline``, ...) still
work with a ``DeprecationWarning`` naming the new path (Note [old module paths] in :mod:`fdg_schedule._moved`).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from fdg_schedule import _moved
from fdg_schedule.base.config import FDGConfig, FDGConfigError
from fdg_schedule.base.errors import DataExhausted, FDGRuntimeError
from fdg_schedule.runtime.install import initialize, install, uninstall, watch_deepspeed

if TYPE_CHECKING:
    from fdg_schedule.corrections.reference import fdg_reference
    from fdg_schedule.runtime.engine import FDGPipelineEngine

__all__ = [
    "DataExhausted",
    "FDGConfig",
    "FDGConfigError",
    "FDGPipelineEngine",
    "FDGRuntimeError",
    "fdg_reference",
    "initialize",
    "install",
    "uninstall",
]
__version__ = "0.5.0"  # = pyproject.toml's version and CHANGELOG.md's newest release

_LAZY = {"FDGPipelineEngine": "fdg_schedule.runtime.engine", "fdg_reference": "fdg_schedule.corrections.reference"}


def __getattr__(name: str) -> Any:
    # else an old module path, with a DeprecationWarning at the caller's line (once), or AttributeError
    value = getattr(importlib.import_module(_LAZY[name]), name) if name in _LAZY else _moved.resolve(__name__, name)
    globals()[name] = value
    return value


_moved.keep_old_paths(sys.modules[__name__])
watch_deepspeed()
