"""The schedule's outputs, recorded in tests/golden/schedule.json.

``python tests/schedule_golden.py`` rewrites the file; tests/test_schedule_golden.py compares against it,
so a refactoring of the schedule representation provably keeps every stage's instructions, every
grid (end of data included) and the planner's FDG streams. Recorded for the two-vocabulary code (issue 43);
rewritten once when each message moved to where it exists (issue 46: Note [each message when it exists]),
after checking that with the exchange's tokens (sa sg pa pg se X) taken out every instruction stream and
grid was unchanged and the planner's streams differed only in where the gradient is sent.
"""

from __future__ import annotations

import itertools
import json
import pathlib
from typing import Any

from fdg_schedule.plan import streams
from fdg_schedule.sched import grid
from fdg_schedule.sched.schedule import FDGTrainSchedule, render

PATH = pathlib.Path(__file__).parent / "golden" / "schedule.json"


def cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stages, micro_batches, start_tick, accumulate in itertools.product(
        (1, 2, 3, 4), (1, 3, 8), (0, 2, 5), (1, 2, 3)
    ):
        for stage_id in range(stages):
            for limit in (None, start_tick, start_tick + 2):
                key = f"render K={stages} k={stage_id} n={micro_batches} t={start_tick} a={accumulate} limit={limit}"
                out[key] = render(
                    FDGTrainSchedule(micro_batches, stages, stage_id, start_tick, accumulate, limit=limit)
                )
            key = f"render K={stages} k={stage_id} n={micro_batches} t={start_tick} a={accumulate} drain"
            out[key] = render(FDGTrainSchedule(micro_batches, stages, stage_id, start_tick, accumulate, drain=True))
        for data_end in (None, 0, 1, start_tick, start_tick + 1, start_tick + 3):
            for drain in (False, True):
                key = f"grid K={stages} n={micro_batches} t={start_tick} a={accumulate} end={data_end} drain={drain}"
                g = grid.plan(
                    stages, micro_batches, data_end, start_tick=start_tick, accumulate=accumulate, drain=drain
                )
                out[key] = [g.render(), [[p.stage, p.tick, p.message] for p in g.validate()]]
    for stages, micro_batches, accumulate in itertools.product((1, 2, 3, 4), (1, 4, 9), (1, 2)):
        for drain in (False, True):
            key = f"plan fdg K={stages} n={micro_batches} a={accumulate} drain={drain}"
            out[key] = [
                [[a.op.name, a.micro_batch, a.stage, a.blocking] for a in s]
                for s in streams.fdg_streams(stages, micro_batches, accumulate, drain)
            ]
        key = f"plan thread K={stages} n={micro_batches} a={accumulate}"
        out[key] = [
            [[a.op.name, a.micro_batch, a.stage, a.blocking] for a in s]
            for s in streams.fdg_thread_streams(stages, micro_batches, accumulate)
        ]
    return out


if __name__ == "__main__":
    PATH.write_text(json.dumps(cases(), indent=0, sort_keys=True) + "\n")
