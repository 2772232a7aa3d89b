"""The whole pipeline's plan: how a segment ends when the data runs out, as golden grids, and the grid's checks."""

from __future__ import annotations

import itertools

import pytest

from fdg_schedule.sched import grid, lowering, ticks
from fdg_schedule.sched.actions import Op
from fdg_schedule.sched.schedule import FDGTrainSchedule

# Legend: L load, A / G wait for activation / gradient, F forward, B backward, R all-reduce, S step,
# sa / sg send activation / gradient (se: the end of the data, sent where that micro-batch would be),
# pa / pg post the receive of next tick's activation / gradient, X the tick's end of the exchange,
# T / T+ end of tick (+: a micro-batch entered). Note [end of data], Note [each message when it exists].


# (stages, ticks in the call, data_end, options) -> the grid
GOLDEN_DATA_END = {
    # Micro-batch 3 is missing: stage 0 finds out at tick 3 and sends the end in its place; stage 1
    # learns it at tick 4 from that dummy, which is also the segment's last tick (stage 0's B2).
    "k2": ((2, 6, 3, {}), [
        "tick  stage 0                         stage 1",
        "0     L0 F0 sa0 X T+                  pa0 L0 X T+",
        "1     pg0 L1 F1 sa1 X T+              A0 pa1 L1 F0 B0 sg0 R S X T+",
        "2     G0 pg1 B0 R S L2 F2 sa2 X T+    A1 pa2 L2 F1 B1 sg1 R S X T+",
        "3     G1 pg2 B1 R S L3 se3 X T        A2 pa3 L3 F2 B2 sg2 R S X T+",
        "4     G2 B2 R S X T                   A3 X T",
    ]),
    # The call starts at tick 3: stage 0 learned the end (at tick 2) in the previous call, stage 1
    # learns it now and passes it on, stage 2 one tick later; all stop at the last tick, 5.
    "k3-learned-in-an-earlier-call": ((3, 4, 2, {"start_tick": 3}), [
        "tick  stage 0              stage 1                         stage 2",
        "3     pg0 X T              G0 pg1 B0 sg0 R S A2 se2 X T    A1 pa2 L3 F1 B1 sg1 R S X T+",
        "4     G0 pg1 B0 R S X T    G1 B1 sg1 R S X T               A2 X T",
        "5     G1 B1 R S X T        X T                             X T",
    ]),
    # K = 1 learns the end one tick after its last backward; the partial accumulation is stepped then,
    # before that tick's T can move the learning rate (Note [learning rate per optimizer step]).
    "k1-partial-step": ((1, 4, 2, {"accumulate": 3}), [
        "tick  stage 0",
        "0     L0 F0 B0 X T+",
        "1     L1 F1 B1 X T+",
        "2     L2 R S X T",
    ]),
}  # fmt: skip


@pytest.mark.parametrize("name", GOLDEN_DATA_END)
def test_golden_data_end(name: str) -> None:
    (stages, micro_batches, data_end, options), expected = GOLDEN_DATA_END[name]
    assert grid.plan(stages, micro_batches, data_end, **options).render().splitlines() == expected


def _segment(stages: int, stage_id: int, gas: int, accumulate: int, data_end: int) -> list[list[str]]:
    """One stage's calls of ``gas`` ticks until its segment ends, as the engine runs them."""
    calls, tick, limit = [], 0, None
    while limit is None or tick <= ticks.last_tick(limit, stages):
        schedule = lowering.StageSchedule(gas, stages, stage_id, tick, accumulate, limit=limit)
        steps, ended_on = lowering.run_call(schedule, data_end if limit is None else None)
        tick += sum(a.op in (Op.ADVANCE, Op.ADVANCE_ENTERED) for step in steps for a in step)
        limit = ended_on.limit
        calls.append([" ".join(a.short() for a in step) for step in steps])
    return calls


@pytest.mark.parametrize("stages,gas,accumulate", list(itertools.product([1, 2, 3, 4, 5], [1, 2, 3, 7], [1, 3])))
def test_every_stage_ends_the_segment_in_the_same_call(stages: int, gas: int, accumulate: int) -> None:
    for data_end in range(1 if stages > 1 else 0, 12):
        segments = [_segment(stages, k, gas, accumulate, data_end) for k in range(stages)]
        last = ticks.last_tick(data_end, stages)
        expected_calls = max(last, data_end) // gas + 1  # K = 1 learns the end at tick data_end > its last
        assert {len(calls) for calls in segments} == {expected_calls}, data_end
        for calls in segments:
            steps = [s for call in calls for s in call if " X T" in s or s.startswith("X T")]
            assert len(steps) == max(last, data_end) + 1
            entered = [s.endswith("T+") for s in steps]
            assert entered[:data_end] == [True] * data_end  # counted until the stage learned the end
            if data_end == 0:
                continue
            forwards = [s for s in steps if f" F{data_end - 1} " in f" {s} "]
            assert len(forwards) == 1 and f"F{data_end}" not in " ".join(steps)
            backwards = [s for s in steps if f"B{data_end - 1} " in f"{s} "]
            assert len(backwards) == 1


@pytest.mark.parametrize("stages,gas,accumulate", list(itertools.product([2, 3, 4], [1, 3], [1, 2])))
def test_every_message_meets_its_counterpart(stages: int, gas: int, accumulate: int) -> None:
    for data_end in (None, 1, 4, 9):
        for start in range(0, 12, gas):
            plan = grid.plan(stages, gas, data_end, start_tick=start, accumulate=accumulate)
            assert plan.validate() == [], (data_end, start, plan.render())
        drain = grid.plan(stages, ticks.drain_ticks(stages), start_tick=7, accumulate=accumulate, drain=True)
        assert drain.validate() == []


def test_validate_marks_the_cell_whose_send_is_not_received() -> None:
    plan = grid.plan(2, 4)
    row = plan.rows[1][2]
    row.remove(next(a for a in row if a.op is Op.SEND_GRAD))  # stage 1 forgets micro-batch 1's gradient at tick 2
    problems = plan.validate()
    assert [(p.stage, p.tick) for p in problems] == [(0, 2)]
    assert "stage 0 receives a gradient stage 1 does not send" in problems[0].message
    marked = plan.render(mark=(0, 2)).splitlines()
    assert marked[3].startswith("2   > G0 pg1 B0 R S L2 F2 sa2 X T+ <")


def test_around_prints_the_neighbourhood_of_a_tick() -> None:
    schedule = FDGTrainSchedule(6, 3, 1, start_tick=3)
    text = grid.around(schedule, tick=5)
    lines = text.splitlines()
    assert lines[0] == "the plan of every stage near tick 5 (this stage's cell marked):"
    assert [line.split()[0] for line in lines[2:]] == ["3", "4", "5", "6", "7"]
    assert "> G2 pg3 B2 sg2 R S A4 pa5 F4 sa4 X T+ <" in lines[4]  # stage 1 at tick 5
