"""DeepSpeed's dispatch loop, ``for cmds in schedule: for cmd in cmds: handler(cmd)``, with each instruction timed.

A handler never calls the schedule back: what it found out that changes the rest of the call (the data
ended) it returns as an outcome (:mod:`fdg_schedule.sched.outcomes`), and the loop hands that to the
schedule's ``tell``. FDG's engine runs its ticks and ``eval_batch()`` through it;
:func:`fdg_schedule.observability.timeline.trace_one_f_one_b`
runs a stock 1F1B engine through it to record a trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deepspeed.runtime.pipe.schedule import PipeInstruction, PipeSchedule

from fdg_schedule.base.errors import FDGRuntimeError


def execute(engine: Any, schedule: PipeSchedule, after: Callable[[PipeInstruction, float, float], None]) -> None:
    """Run ``schedule`` on a ``PipelineEngine``; ``after(cmd, start, end)`` follows every instruction, and what a
    handler returns (None, or an outcome) goes to ``schedule.tell`` before the next one."""
    engine._reserve_pipe_buffers(schedule.num_pipe_buffers())
    engine.fwd_outputs = []
    for cmds in schedule:
        for cmd in cmds:
            handler = engine._INSTRUCTION_MAP.get(type(cmd))
            if handler is None:
                raise FDGRuntimeError(f"{type(engine).__name__} does not understand instruction {cmd!r}")
            start = time.perf_counter()
            outcome = handler(engine, **cmd.kwargs)
            if outcome is not None:
                _tell(schedule, outcome, cmd)
            after(cmd, start, time.perf_counter())


def _tell(schedule: PipeSchedule, outcome: object, cmd: PipeInstruction) -> None:
    tell = getattr(schedule, "tell", None)
    if tell is None:
        raise FDGRuntimeError(f"{type(schedule).__name__} takes no outcome, yet {cmd!r} returned {outcome!r}")
    tell(outcome)


InstructionCallback = Callable[[Any, PipeInstruction, float, float], None]


def observe(engine: Any, on_instruction: InstructionCallback) -> None:
    """Call ``on_instruction(view, cmd, start, end)`` after every instruction ``engine`` runs: the public hook.

    An FDG engine calls its observers itself (``engine.observers``; the view is a
    :class:`~fdg_schedule.observability.view.StageView` built per call, never the engine). DeepSpeed's own
    ``PipelineEngine`` has no hook: this is the one place that gives it one, by timing each handler
    through a copy of the instruction map on that engine instance (its class and other engines keep
    theirs). Observers never patch ``_INSTRUCTION_MAP`` themselves.
    """
    if hasattr(engine, "fdg_stats"):
        engine.observers.append(_Callback(on_instruction))
        return
    callbacks: list[InstructionCallback] | None = engine.__dict__.get("_fdg_instruction_observers")
    if callbacks is None:
        callbacks = engine.__dict__["_fdg_instruction_observers"] = []
        table = dict(type(engine)._INSTRUCTION_MAP)
        engine._INSTRUCTION_MAP = {cls: _observed(cls, handler, callbacks) for cls, handler in table.items()}
    callbacks.append(on_instruction)


class _Callback:
    """A function as an FDG engine's observer (instruction events only)."""

    def __init__(self, on_instruction: InstructionCallback) -> None:
        self._on_instruction = on_instruction

    def on_instruction(self, view: Any, cmd: PipeInstruction, start: float, end: float) -> None:
        self._on_instruction(view, cmd, start, end)

    def on_call_end(self, view: Any, seconds: float) -> None:
        pass


def _observed(
    cls: type[PipeInstruction], handler: Callable[..., Any], callbacks: list[InstructionCallback]
) -> Callable[..., Any]:
    def observed(engine: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return handler(engine, **kwargs)
        finally:
            end = time.perf_counter()
            cmd = cls(**kwargs)  # a copy of the instruction the loop ran (DeepSpeed's take their kwargs)
            for callback in callbacks:
                callback(engine, cmd, start, end)

    return observed
