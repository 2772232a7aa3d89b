"""dispatch.execute: what a handler returns reaches the schedule run before the next instruction."""

from __future__ import annotations

from typing import Any

import pytest
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import PipeInstruction, TrainSchedule

from fdg_schedule.base import dispatch
from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.sched import lowering
from fdg_schedule.sched.outcomes import DataEnded, LabelsEnded
from fdg_schedule.sched.schedule import (
    INSTRUCTIONS,
    AdvanceTick,
    FDGLoad,
    FDGTrainSchedule,
    ScheduleRun,
    WaitActivation,
    short,
)


class _Loop:
    """What the loop uses of a PipelineEngine: its instruction map and ``_reserve_pipe_buffers``."""

    def __init__(self, handlers: dict[type[PipeInstruction], Any]) -> None:
        self._INSTRUCTION_MAP = handlers

    def _reserve_pipe_buffers(self, num_buffers: int) -> None:
        pass


def _ran(plan: FDGTrainSchedule, learns: type[PipeInstruction], data_end: int) -> list[PipeInstruction]:
    """The instructions a stage runs when the handler of ``learns`` for micro-batch ``data_end`` returns the end."""
    handlers: dict[type[PipeInstruction], Any] = {cls: lambda engine, **kw: None for cls, _ in INSTRUCTIONS.values()}
    handlers[learns] = lambda engine, micro_batch, **kwargs: DataEnded(data_end) if micro_batch == data_end else None
    ran: list[PipeInstruction] = []
    dispatch.execute(_Loop(handlers), ScheduleRun(plan), lambda cmd, start, end: ran.append(cmd))
    return ran


@pytest.mark.parametrize("stages", [2, 3])
def test_a_returned_end_of_data_runs_the_shorter_segment_as_the_grid_plans_it(stages: int) -> None:
    for stage_id in range(stages):
        plan = FDGTrainSchedule(12, stages, stage_id, accumulate=2)
        learns = FDGLoad if stage_id == 0 else WaitActivation  # Note [end of data]
        planned = [action.short() for step in lowering.run_call(plan, data_end=5)[0] for action in step]
        ran = _ran(plan, learns, 5)
        assert [short(cmd) for cmd in ran] == planned
        # the tick ends: only the segment's last says so, also where the stage learns the end in it (K = 2, stage 1)
        assert [cmd.last for cmd in ran if isinstance(cmd, AdvanceTick)][-3:] == [False, False, True]
        assert "se5" in planned or stage_id == stages - 1  # the end is passed on


def test_an_outcome_for_a_schedule_that_takes_none_is_an_error_naming_it() -> None:
    handlers = {cls: lambda engine, **kwargs: LabelsEnded(1) for cls in PipelineEngine._INSTRUCTION_MAP}
    with pytest.raises(
        FDGRuntimeError, match=r"TrainSchedule takes no outcome, yet .* returned LabelsEnded\(limit=1\)"
    ):
        dispatch.execute(_Loop(handlers), TrainSchedule(2, 2, 0), lambda cmd, start, end: None)


def test_the_run_refuses_what_is_no_outcome() -> None:
    with pytest.raises(FDGRuntimeError, match="does not take 'finished'"):
        ScheduleRun(FDGTrainSchedule(4, 2, 0)).tell("finished")  # type: ignore[arg-type]
