"""The whole pipeline's plan: every stage's instructions tick by tick, checked and printed as one grid.

Each stage generates only its own instructions (:class:`~fdg_schedule.sched.schedule.FDGTrainSchedule`);
the grid puts all stages side by side, as the engines run them -- including how each stage learns
the end of the data at its own tick (Note [end of data]) -- so that one can check that every
message meets its counterpart and print the plan, with the offending cell marked, in an error::

    tick  stage 0                 stage 1
    0     L0 F0 sa0 X T+          pa0 L0 X T+
    1   > pg0 L1 F1 sa1 X T+ <    A0 pa1 L1 F0 B0 sg0 R S X T+

Rows are ticks, columns stages; a row ``+`` is K = 1's final partial step, which has no tick.
:meth:`Grid.actions` is the same grid in the one schedule vocabulary (:mod:`fdg_schedule.sched.actions`),
on which the messages are checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from deepspeed.runtime.pipe.schedule import PipeInstruction

from fdg_schedule.sched import actions
from fdg_schedule.sched.schedule import (
    Exchange,
    FDGBackward,
    FDGForward,
    FDGLoad,
    FDGTrainSchedule,
    LocalOptimizerStep,
    PostRecvActivation,
    PostRecvGrad,
    ReduceGrads,
    ScheduleRun,
    SendActivation,
    SendGrad,
    WaitActivation,
    WaitGrad,
    short,
)

Step = list[PipeInstruction]


@dataclasses.dataclass
class Problem:
    """A message without its counterpart: where it shows and what is wrong."""

    stage_id: int
    tick: int
    message: str


@dataclasses.dataclass
class Grid:
    """``rows[stage_id][i]``: what ``stage_id`` does at tick ``start_tick + i``."""

    start_tick: int
    rows: list[list[Step]]

    @property
    def stages(self) -> int:
        return len(self.rows)

    def validate(self) -> list[Problem]:
        """Every send meets the neighbour's receive at the next tick (checked on the actions,
        :func:`fdg_schedule.sched.actions.check_messages`), and every receive a stage posts is waited for
        at its next tick in the buffer it was posted for."""
        problems = [Problem(p.stage, p.tick, p.message) for p in actions.check_messages(self.actions())]
        for stage_id in range(self.stages):
            problems += self._waits(stage_id)
        return problems

    def actions(self) -> list[list[list[actions.Action]]]:
        """The grid in the one schedule vocabulary (:mod:`fdg_schedule.sched.actions`): each cell's
        instructions as placed actions, the exchange's sends numbered by the micro-batch they carry."""
        return [
            [as_actions(step, stage_id, self.start_tick + i) for i, step in enumerate(row)]
            for stage_id, row in enumerate(self.rows)
        ]

    def render_actions(self) -> str:
        """The grid as action text, one line per tick (``0B0@2 0R@2 0S@2 0L2@2 0F2@2 0sa2@2 | ...``)."""
        return actions.render(self.actions())

    def render(self, mark: tuple[int, int] | None = None) -> str:
        """The grid as text; ``mark=(stage_id, tick)`` brackets that cell with ``> <``."""
        ticks = max(len(row) for row in self.rows)
        cells = [
            [" ".join(short(c) for c in row[i]) if i < len(row) else "" for row in self.rows] for i in range(ticks)
        ]
        width = [max([len(f"stage {k}")] + [len(line[k]) + 4 for line in cells]) for k in range(self.stages)]
        lines = ["tick  " + "".join(f"{f'stage {k}':{width[k]}}" for k in range(self.stages)).rstrip()]
        for i, line in enumerate(cells):
            tick = self.start_tick + i
            label = str(tick) if any(i < len(row) and _is_tick(row[i]) for row in self.rows) else "+"
            parts = []
            for k, text in enumerate(line):
                marked = mark == (k, tick)
                parts.append(f"{f'> {text} <' if marked else f'  {text}':{width[k]}}")
            lines.append(f"{label:4}" + "".join(parts).rstrip())
        return "\n".join(lines)

    def _waits(self, stage_id: int) -> list[Problem]:
        """A receive posted at tick t is waited for at t+1, and a wait finds the receive posted at t-1."""
        out = []
        row = self.rows[stage_id]
        for i in range(1, len(row)):
            before, step = row[i - 1], row[i]
            if not _is_tick(before):
                continue
            for wait, post, what in (
                (WaitActivation, PostRecvActivation, "activation"),
                (WaitGrad, PostRecvGrad, "gradient"),
            ):
                buffers = [c.buffer_id for c in step if isinstance(c, wait)]
                expected = [c.buffer_id for c in before if isinstance(c, post)]
                if buffers != expected:
                    tick = self.start_tick + i
                    message = (
                        f"stage {stage_id} waits for {what} in buffers {buffers} but posted receives for {expected}"
                    )
                    out.append(Problem(stage_id, tick, message))
        return out


def plan(stages: int, micro_batches: int, data_end: int | None = None, **options: Any) -> Grid:
    """The grid of one call of every stage, as the engines run it.

    ``options`` are :class:`FDGTrainSchedule`'s (``start_tick``, ``accumulate``, ``drain``).
    ``data_end``: the data ran out at that micro-batch of the segment; a stage whose tick
    ``data_end + stage_id`` came before ``start_tick`` knew it when the call started, the others
    learn it at that tick (Note [end of data]).
    """
    start_tick = options.get("start_tick", 0)
    rows = []
    for stage_id in range(stages):
        known = data_end if data_end is not None and start_tick > data_end + stage_id else None
        schedule = FDGTrainSchedule(micro_batches, stages, stage_id, limit=known, **options)
        rows.append(run(schedule, None if known is not None or schedule.drain else data_end))
    return Grid(start_tick, rows)


def around(schedule: FDGTrainSchedule, tick: int, width: int = 2) -> str:
    """The plan of every stage for the ticks of ``schedule``'s call near ``tick``, this stage's cell marked."""
    start = max(schedule.start_tick, tick - width)
    end = min(schedule.start_tick + schedule.micro_batches, tick + width + 1)
    data_end = None if schedule.drain else schedule.limit
    options = {"start_tick": start, "accumulate": schedule.accumulate, "drain": schedule.drain}
    nearby = plan(schedule.stages, max(end - start, 0), data_end, **options)
    return f"the plan of every stage near tick {tick} (this stage's cell marked):\n" + nearby.render(
        mark=(schedule.stage_id, tick)
    )


def run(schedule: FDGTrainSchedule, data_end: int | None = None) -> list[Step]:
    """The steps of one stage, with the stage learning ``data_end`` where its engine would."""
    return run_call(schedule, data_end)[0]


def run_call(schedule: FDGTrainSchedule, data_end: int | None = None) -> tuple[list[Step], FDGTrainSchedule]:
    """:func:`run`'s steps and the schedule the call ended on (the shorter segment's, if it learned the end)."""
    steps = []
    running = ScheduleRun(schedule)
    for tick in running:
        step: Step = []
        for cmd in tick:
            step.append(cmd)
            if data_end is not None and _learns_end(cmd, schedule, data_end):
                running.end_data(data_end)
        steps.append(step)
    return steps, running.schedule


def _learns_end(cmd: PipeInstruction, schedule: FDGTrainSchedule, data_end: int) -> bool:
    # Stage 0 finds its iterator empty; a later stage receives the dummy where the activation would be.
    reads_inputs = isinstance(cmd, FDGLoad) and schedule.is_first_stage
    return (reads_inputs or isinstance(cmd, WaitActivation)) and cmd.micro_batch == data_end


# What each instruction is in the one vocabulary; posted receives are none (the action is the wait that reads
# the message), nor are the tick's end (Exchange) and AdvanceTick.
_ACTION_OPS: dict[type[PipeInstruction], actions.Op] = {
    FDGLoad: actions.Op.LOAD,
    WaitActivation: actions.Op.RECV_ACTIVATION,
    WaitGrad: actions.Op.RECV_GRAD,
    FDGForward: actions.Op.FORWARD,
    FDGBackward: actions.Op.BACKWARD,
    ReduceGrads: actions.Op.ALLREDUCE,
    LocalOptimizerStep: actions.Op.STEP,
    SendActivation: actions.Op.SEND_ACTIVATION,
    SendGrad: actions.Op.SEND_GRAD,
}


def as_actions(step: Step, stage_id: int, tick: int) -> list[actions.Action]:
    """One cell's instructions as actions of ``stage_id`` at ``tick`` (the end word is sent as the activation
    of the micro-batch where it stands)."""
    out = []
    for cmd in step:
        op = _ACTION_OPS.get(type(cmd))
        if op is not None:
            micro_batch = None if op in (actions.Op.ALLREDUCE, actions.Op.STEP) else cmd.micro_batch
            out.append(actions.Action(stage_id, op, micro_batch, tick))
    return out


def _exchange(step: Iterable[PipeInstruction]) -> Exchange | None:
    return next((c for c in step if isinstance(c, Exchange)), None)


def _is_tick(step: Step) -> bool:
    return _exchange(step) is not None
