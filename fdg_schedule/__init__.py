"""fdg_schedule: fully decoupled learning with delayed gradients (FDG) as a DeepSpeed pipeline schedule.

Two ways in:

* ``import fdg_schedule`` before ``deepspeed.initialize``: a ``PipelineModule`` whose config says
  ``"pipeline": {"schedule": "fdg"}`` gets an :class:`FDGPipelineEngine`; any other config gets
  DeepSpeed's own engine, untouched. Set ``FDG_SCHEDULE_AUTO_INSTALL=0`` to skip this.
* ``fdg_schedule.initialize(...)`` instead of ``deepspeed.initialize(...)``: the same, without
  changing ``deepspeed`` for anyone else.
"""

from __future__ import annotations

import os

from fdg_schedule.config import FDGConfig, FDGConfigError
from fdg_schedule.engine import FDGPipelineEngine
from fdg_schedule.errors import DataExhausted, FDGRuntimeError
from fdg_schedule.install import SelectPipelineEngine, build_pipeline_engine, initialize, install, uninstall
from fdg_schedule.reference import fdg_reference

__all__ = [
    "DataExhausted",
    "FDGConfig",
    "FDGConfigError",
    "FDGPipelineEngine",
    "FDGRuntimeError",
    "SelectPipelineEngine",
    "build_pipeline_engine",
    "fdg_reference",
    "initialize",
    "install",
    "uninstall",
]
__version__ = "0.1.0"

if os.environ.get("FDG_SCHEDULE_AUTO_INSTALL", "1") != "0":
    install()
