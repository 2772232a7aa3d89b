"""The one schedule vocabulary (issue 43): text that round-trips, torch-free, and the same plan as the engine's."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from fdg_schedule.sched import actions
from fdg_schedule.sched.actions import Action, Op


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("accumulate", [1, 2, 3])
@pytest.mark.parametrize("limit", [None, 3, 7])
def test_text_round_trips_for_the_whole_grid(stages: int, accumulate: int, limit: int | None) -> None:
    grid = actions.fdg_grid(stages, 0, 12, accumulate, limit)
    lowered = [[actions.add_exchange(tick, stages) for tick in row] for row in grid]
    for g in (grid, lowered):
        for action in itertools.chain.from_iterable(itertools.chain.from_iterable(g)):
            assert Action.from_str(str(action)) == action
        assert actions.parse(actions.render(g)) == g
    assert {a.op for row in lowered for tick in row for a in tick} >= {Op.FORWARD, Op.BACKWARD, Op.RECV_GRAD}


def test_text_form() -> None:
    assert str(Action(1, Op.FORWARD, 3, 4)) == "1F3@4"
    assert str(Action(0, Op.STEP)) == "0S"
    assert Action.from_str("2rg5") == Action(2, Op.RECV_GRAD, 5)
    with pytest.raises(ValueError, match="unknown op"):
        Action.from_str("1Q3")
    with pytest.raises(ValueError, match="not an action"):
        Action.from_str("F3")


def test_grid_is_the_engine_schedule() -> None:
    """The compute letters of FDGTrainSchedule's instructions are the grid's, tick by tick."""
    from fdg_schedule.sched.schedule import FDGTrainSchedule, render

    for stages, accumulate, limit in itertools.product((2, 3, 4), (1, 2), (None, 5)):
        grid = actions.fdg_grid(stages, 0, 14, accumulate, limit)
        for stage_id in range(stages):
            engine = render(FDGTrainSchedule(14, stages, stage_id, accumulate=accumulate, limit=limit))
            keep = ("L", "F", "B", "R", "S")
            assert [" ".join(w for w in t.split() if w.startswith(keep)) for t in engine] == [
                " ".join(f"{a.op.value}{'' if a.micro_batch is None else a.micro_batch}" for a in tick)
                for tick in grid[stage_id]
            ]


def test_actions_import_no_torch() -> None:
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'deepspeed'):\n"
        "        raise ImportError('no ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import fdg_schedule.sched.actions as m\n"
        "print(len(m.fdg_grid(3, 0, 8)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def _lowered_grid(stages: int, num_ticks: int, accumulate: int = 1) -> list[list[list[actions.Action]]]:
    grid = actions.fdg_grid(stages, 0, num_ticks, accumulate)
    return [[actions.add_exchange(cell, stages) for cell in row] for row in grid]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_lowered_send_meets_its_receive(stages: int) -> None:
    assert actions.check_messages(_lowered_grid(stages, 12, accumulate=2)) == []


def test_a_missing_send_is_reported_in_the_receivers_cell_at_the_sending_tick() -> None:
    grid = _lowered_grid(2, 6)
    cell = grid[1][2]  # stage 1 at tick 2 forwards and back-propagates micro-batch 1, and sends its gradient
    sent = next(a for a in cell if a.op is actions.Op.SEND_GRAD)
    cell.remove(sent)
    problems = actions.check_messages(grid)
    assert [(p.stage, p.tick) for p in problems] == [(0, 2)]
    assert f"0rg{sent.micro_batch}@3 without 1sg{sent.micro_batch}@2" in problems[0].message


def test_the_engine_grid_in_actions_is_the_lowered_action_grid() -> None:
    """grid.Grid.actions() (the engine's instructions read back) equals ticks.py's compute with the exchange
    lowered onto it, away from the segment's ends."""
    from fdg_schedule.sched import grid

    for stages in (2, 3, 4):
        engine = grid.plan(stages, 12).actions()
        lowered = _lowered_grid(stages, 12)
        assert engine == lowered
        assert grid.plan(stages, 12).validate() == []
