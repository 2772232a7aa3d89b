"""The whole pipeline's plan: every stage's actions tick by tick, checked and printed as one grid.

Torch-free. Each stage's actions come from the one lowering (:mod:`fdg_schedule.sched.lowering`), which the
engine executes as DeepSpeed instructions; the grid puts all stages side by side, as the engines run them --
including how each stage learns the end of the data at its own tick (Note [end of data] in
:mod:`fdg_schedule.sched.schedule`) -- so that one can check that every message meets its counterpart and
print the plan, with the offending cell marked, in an error::

    tick  stage 0                 stage 1
    0     L0 F0 sa0 X T+          pa0 L0 X T+
    1   > pg0 L1 F1 sa1 X T+ <    A0 pa1 L1 F0 B0 sg0 R S X T+

Rows are ticks, columns stages; a row ``+`` is K = 1's final partial step, which has no tick.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fdg_schedule.sched import actions, lowering
from fdg_schedule.sched.actions import Action, Op, Problem
from fdg_schedule.sched.lowering import StageSchedule

Step = list[Action]


@dataclasses.dataclass
class Grid:
    """``rows[stage_id][i]``: what ``stage_id`` does at tick ``start_tick + i``."""

    start_tick: int
    rows: list[list[Step]]

    @property
    def stages(self) -> int:
        return len(self.rows)

    def validate(self) -> list[Problem]:
        """Every send meets the neighbour's receive at the next tick
        (:func:`fdg_schedule.sched.actions.check_messages`), and every receive a stage posts is waited for at
        its next tick, for the micro-batch it was posted for."""
        problems = actions.check_messages(self.rows)
        for stage_id in range(self.stages):
            problems += self._waits(stage_id)
        return problems

    def render_actions(self) -> str:
        """The grid as action text, one line per tick (``0G0@2 0pg1@2 0B0@2 0R@2 0S@2 ... | ...``)."""
        return actions.render(self.rows)

    def render(self, mark: tuple[int, int] | None = None) -> str:
        """The grid as text; ``mark=(stage_id, tick)`` brackets that cell with ``> <``."""
        ticks = max(len(row) for row in self.rows)
        cells = [
            [" ".join(a.short() for a in row[i]) if i < len(row) else "" for row in self.rows] for i in range(ticks)
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
                (Op.RECV_ACTIVATION, Op.POST_RECV_ACTIVATION, "activation"),
                (Op.RECV_GRAD, Op.POST_RECV_GRAD, "gradient"),
            ):
                waited = [a.micro_batch for a in step if a.op is wait]
                expected = [a.micro_batch for a in before if a.op is post]
                if waited != expected:
                    tick = self.start_tick + i
                    message = (
                        f"stage {stage_id} waits for the {what} of micro-batches {waited} but posted receives "
                        f"for {expected}"
                    )
                    out.append(Problem(stage_id, tick, message))
        return out


def plan(stages: int, micro_batches: int, data_end: int | None = None, **options: Any) -> Grid:
    """The grid of one call of every stage, as the engines run it.

    ``options`` are :class:`~fdg_schedule.sched.lowering.StageSchedule`'s (``start_tick``, ``accumulate``,
    ``drain``). ``data_end``: the data ran out at that micro-batch of the segment; a stage whose tick
    ``data_end + stage_id`` came before ``start_tick`` knew it when the call started, the others
    learn it at that tick (Note [end of data]).
    """
    start_tick = options.get("start_tick", 0)
    rows = []
    for stage_id in range(stages):
        known = data_end if data_end is not None and start_tick > data_end + stage_id else None
        schedule = StageSchedule(micro_batches, stages, stage_id, limit=known, **options)
        rows.append(lowering.run_call(schedule, None if known is not None or schedule.drain else data_end)[0])
    return Grid(start_tick, rows)


def around(schedule: StageSchedule, tick: int, width: int = 2) -> str:
    """The plan of every stage for the ticks of ``schedule``'s call near ``tick``, this stage's cell marked."""
    start = max(schedule.start_tick, tick - width)
    end = min(schedule.start_tick + schedule.micro_batches, tick + width + 1)
    data_end = None if schedule.drain else schedule.limit
    options = {"start_tick": start, "accumulate": schedule.accumulate, "drain": schedule.drain}
    nearby = plan(schedule.stages, max(end - start, 0), data_end, **options)
    return f"the plan of every stage near tick {tick} (this stage's cell marked):\n" + nearby.render(
        mark=(schedule.stage_id, tick)
    )


def _is_tick(step: Step) -> bool:
    return any(action.op is Op.EXCHANGE for action in step)
