"""The one schedule alphabet (issues 43, 65): text that round-trips, torch-free, and one lowering that the engine,
the grid and the planner all run, ends of data included."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from fdg_schedule.sched import actions, grid
from fdg_schedule.sched.actions import Action, Op


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("accumulate", [1, 2, 3])
@pytest.mark.parametrize("limit", [None, 3, 7])
def test_text_round_trips_for_the_whole_grid(stages: int, accumulate: int, limit: int | None) -> None:
    compute = actions.fdg_grid(stages, 0, 12, accumulate, limit)
    lowered = grid.plan(stages, 12, limit, accumulate=accumulate).rows
    for g in (compute, lowered):
        for action in itertools.chain.from_iterable(itertools.chain.from_iterable(g)):
            assert Action.from_str(str(action)) == action
        assert actions.parse(actions.render(g)) == g
    ops = {a.op for row in lowered for tick in row for a in tick}
    assert ops >= {Op.FORWARD, Op.BACKWARD, Op.RECV_GRAD, Op.POST_RECV_GRAD, Op.EXCHANGE, Op.ADVANCE_ENTERED}
    assert limit is None or {Op.SEND_END, Op.ADVANCE} <= ops


def test_text_form() -> None:
    assert str(Action(1, Op.FORWARD, 3, 4)) == "1F3@4"
    assert str(Action(0, Op.STEP)) == "0S"
    assert Action(1, Op.SEND_END, 4, 7).short() == "se4"
    assert Action.from_str("2G5") == Action(2, Op.RECV_GRAD, 5)
    assert Action.from_str("0T+@3") == Action(0, Op.ADVANCE_ENTERED, None, 3)
    with pytest.raises(ValueError, match="unknown op"):
        Action.from_str("1Q3")
    with pytest.raises(ValueError, match="not an action"):
        Action.from_str("F3")


def test_every_op_has_one_letter_and_a_kind() -> None:
    assert len({op.value for op in Op}) == len(Op)
    assert all(op.kind is not None for op in Op if op not in (Op.ADVANCE, Op.ADVANCE_ENTERED))


def test_grid_is_the_engine_schedule() -> None:
    """The compute letters of FDGTrainSchedule's instructions are the grid's, tick by tick."""
    from fdg_schedule.sched.schedule import FDGTrainSchedule, render

    for stages, accumulate, limit in itertools.product((2, 3, 4), (1, 2), (None, 5)):
        compute = actions.fdg_grid(stages, 0, 14, accumulate, limit)
        for stage_id in range(stages):
            engine = render(FDGTrainSchedule(14, stages, stage_id, accumulate=accumulate, limit=limit))
            keep = ("L", "F", "B", "R", "S")
            assert [" ".join(w for w in t.split() if w.startswith(keep)) for t in engine] == [
                " ".join(a.short() for a in tick) for tick in compute[stage_id]
            ]


def test_actions_lowering_and_grid_import_no_torch() -> None:
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'deepspeed'):\n"
        "        raise ImportError('no ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import fdg_schedule.sched.actions as m\n"
        "from fdg_schedule.sched import grid\n"
        "print(len(m.fdg_grid(3, 0, 8)), grid.plan(3, 8, 5).validate())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3 []"


def _lowered_grid(stages: int, num_ticks: int, accumulate: int = 1) -> list[list[list[Action]]]:
    return grid.plan(stages, num_ticks, accumulate=accumulate).rows


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_lowered_send_meets_its_receive(stages: int) -> None:
    assert actions.check_messages(_lowered_grid(stages, 12, accumulate=2)) == []


def test_a_missing_send_is_reported_in_the_receivers_cell_at_the_sending_tick() -> None:
    lowered = _lowered_grid(2, 6)
    cell = lowered[1][2]  # stage 1 at tick 2 forwards and back-propagates micro-batch 1, and sends its gradient
    sent = next(a for a in cell if a.op is Op.SEND_GRAD)
    cell.remove(sent)
    problems = actions.check_messages(lowered)
    assert [(p.stage, p.tick) for p in problems] == [(0, 2)]
    assert f"0G{sent.micro_batch}@3 without 1sg{sent.micro_batch}@2" in problems[0].message


def _engine_call(stages: int, stage_id: int, micro_batches: int, data_end: int | None, **options: int) -> list:
    """One call of the engine's schedule on one stage, its instructions read back as actions: the stage learns
    ``data_end`` where its handlers do (stage 0's load of it, a later stage's wait for it)."""
    from fdg_schedule.sched.schedule import FDGLoad, FDGTrainSchedule, ScheduleRun, WaitActivation, op_of

    start = options.get("start_tick", 0)
    known = data_end if data_end is not None and start > data_end + stage_id else None
    schedule = FDGTrainSchedule(micro_batches, stages, stage_id, limit=known, **options)
    learns = None if known is not None or schedule.drain else data_end
    running, rows = ScheduleRun(schedule), []
    for tick in running:
        row = []
        for cmd in tick:
            op = op_of(cmd)
            assert op is not None, cmd
            action = Action(stage_id, op, getattr(cmd, "micro_batch", None), running.tick)
            assert running.schedule.instruction(action).kwargs == cmd.kwargs  # the one table, both ways
            row.append(action)
            found = isinstance(cmd, FDGLoad) and stage_id == 0 or isinstance(cmd, WaitActivation)
            if learns is not None and found and cmd.micro_batch == learns:
                running.end_data(learns)
        rows.append(row)
    return rows


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_the_engine_runs_the_lowering_everywhere_ends_of_data_included(stages: int, accumulate: int) -> None:
    """The engine's instructions, read back through the one Op -> instruction table, are the grid's actions (the
    one lowering) at every tick: fill, steady state, drains, a data end learned in this call or an earlier one,
    K = 1's partial step. (Before issue 65 they were compared only away from a segment's ends.)"""
    for data_end, start, gas in itertools.product((None, 0, 1, 3, 7), (0, 2, 5, 9), (1, 4)):
        options = {"start_tick": start, "accumulate": accumulate}
        lowered = grid.plan(stages, gas, data_end, **options)
        engine = [_engine_call(stages, k, gas, data_end, **options) for k in range(stages)]
        assert engine == lowered.rows, (data_end, start, gas, lowered.render())
        assert lowered.validate() == []
    drain = {"start_tick": 6, "accumulate": accumulate, "drain": True}
    engine = [_engine_call(stages, k, 2 * (stages - 1) + 1, None, **drain) for k in range(stages)]
    assert engine == grid.plan(stages, 2 * (stages - 1) + 1, **drain).rows


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_planner_times_the_engines_actions(stages: int, accumulate: int) -> None:
    """The planner's FDG stream of a segment and its drain is the engine's instructions of those calls read back
    as actions, less what costs the planner nothing (loads, posted receives, the tick's ends, the end word)."""
    from fdg_schedule.plan import streams

    timed = actions.COMPUTE | actions.SENDS | actions.RECVS | {Op.ALLREDUCE}
    for micro_batches in (1, 4, 9):
        planned = streams.fdg_streams(stages, micro_batches, accumulate, drain=True)
        for k in range(stages):
            calls = _engine_call(stages, k, micro_batches, None, accumulate=accumulate)
            if stages > 1:
                drain = {"start_tick": micro_batches, "accumulate": accumulate, "drain": True}
                calls += _engine_call(stages, k, 2 * (stages - 1), None, **drain)
            assert planned[k] == [a for row in calls for a in row if a.op in timed]
