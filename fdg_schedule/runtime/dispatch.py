"""DeepSpeed's dispatch loop, ``for cmds in schedule: for cmd in cmds: handler(cmd)``, with each instruction timed.

FDG's engine runs its ticks and ``eval_batch()`` through it;
:func:`fdg_schedule.observability.timeline.trace_one_f_one_b`
runs a stock 1F1B engine through it to record a trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from fdg_schedule.runtime.errors import FDGRuntimeError


def execute(engine: Any, schedule: PipeSchedule, after: Callable[[PipeInstruction, float, float], None]) -> None:
    """Run ``schedule`` on a ``PipelineEngine``; ``after(cmd, start, end)`` follows every instruction."""
    engine._reserve_pipe_buffers(schedule.num_pipe_buffers())
    engine.fwd_outputs = []
    for cmds in schedule:
        for cmd in cmds:
            handler = engine._INSTRUCTION_MAP.get(type(cmd))
            if handler is None:
                raise FDGRuntimeError(f"{type(engine).__name__} does not understand instruction {cmd!r}")
            start = time.perf_counter()
            handler(engine, **cmd.kwargs)
            after(cmd, start, time.perf_counter())
