"""What a handler found out that changes the rest of the call: it returns an outcome, the dispatch loop hands it on.

DeepSpeed's schedule is the only source of control, and no handler calls it back: a handler that
learns something the schedule depends on (the data ended) returns one of these, and the dispatch
loop (:func:`fdg_schedule.base.dispatch.execute`) gives it to the call's
:meth:`~fdg_schedule.sched.schedule.ScheduleRun.tell`, which runs on with the schedule that follows
from it (Note [end of data] in :mod:`fdg_schedule.sched.schedule`). Torch-free.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataEnded:
    """The segment has ``limit`` micro-batches, learned at the current tick: stage 0's iterator ran out at
    micro-batch ``limit``, or the dummy activation carrying ``limit`` arrived where that micro-batch would have."""

    limit: int


@dataclasses.dataclass(frozen=True)
class LabelsEnded:
    """The last stage of K > 1 holds no labels for micro-batch ``limit``: its label iterator ran out (learned in
    the forward of micro-batch ``limit - 1``)."""

    limit: int


Outcome = DataEnded | LabelsEnded
