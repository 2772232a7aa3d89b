"""Pure tests of the FDG tick arithmetic and instruction schedule: golden tables and invariants."""

from __future__ import annotations

import itertools

import pytest
from deepspeed.runtime.pipe.schedule import ReduceGrads

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.sched import ticks
from fdg_schedule.sched.schedule import (
    AdvanceTick,
    Exchange,
    FDGBackward,
    FDGForward,
    FDGLoad,
    FDGTrainSchedule,
    LocalOptimizerStep,
    PostRecvActivation,
    PostRecvGrad,
    ScheduleRun,
    SendActivation,
    SendGrad,
    WaitActivation,
    WaitGrad,
    render,
    short,
)


def grid(stages: int, micro_batches: int, drain_after: int | None = None) -> list[str]:
    """One row per stage, one column per tick: ``Bb`` backward then ``Fb`` forward, ``.`` idle."""
    rows = []
    for stage_id in range(stages):
        cells = []
        schedules = [FDGTrainSchedule(micro_batches, stages, stage_id)]
        if drain_after is not None:
            schedules = [
                FDGTrainSchedule(drain_after, stages, stage_id),
                FDGTrainSchedule(ticks.drain_ticks(stages), stages, stage_id, start_tick=drain_after, drain=True),
            ]
        for schedule in schedules:
            for step in schedule.steps():
                # Forward-then-backward on the last stage is one cell "FbBb"; elsewhere "BbFb".
                cell = "".join(str(c) for c in step if isinstance(c, (FDGForward, FDGBackward)))
                cells.append(cell or ".")
        rows.append(" ".join(f"{c:6}" for c in cells).rstrip())
    return rows


# Legend: Fb = forward of micro-batch b, Bb = backward of micro-batch b, . = idle.
GOLDEN = {
    1: [
        "F0B0   F1B1   F2B2   F3B3",
    ],
    2: [
        "F0     F1     B0F2   B1F3   B2F4   B3F5",
        ".      F0B0   F1B1   F2B2   F3B3   F4B4",
    ],
    3: [
        "F0     F1     F2     F3     B0F4   B1F5   B2F6   B3F7",
        ".      F0     F1     B0F2   B1F3   B2F4   B3F5   B4F6",
        ".      .      F0B0   F1B1   F2B2   F3B3   F4B4   F5B5",
    ],
    4: [
        "F0     F1     F2     F3     F4     F5     B0F6   B1F7   B2F8   B3F9",
        ".      F0     F1     F2     F3     B0F4   B1F5   B2F6   B3F7   B4F8",
        ".      .      F0     F1     B0F2   B1F3   B2F4   B3F5   B4F6   B5F7",
        ".      .      .      F0B0   F1B1   F2B2   F3B3   F4B4   F5B5   F6B6",
    ],
}


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_golden_fill_and_steady_state(stages: int) -> None:
    columns = len(GOLDEN[stages][0].split())
    assert grid(stages, columns) == GOLDEN[stages]


def test_golden_drain_k3() -> None:
    # 5 micro-batches enter, then the drain runs 2(K-1) = 4 ticks with no new micro-batch.
    assert grid(3, 0, drain_after=5) == [
        "F0     F1     F2     F3     B0F4   B1     B2     B3     B4",
        ".      F0     F1     B0F2   B1F3   B2F4   B3     B4     .",
        ".      .      F0B0   F1B1   F2B2   F3B3   F4B4   .      .",
    ]


def test_golden_instructions_k2() -> None:
    # The whole instruction stream of both stages of K = 2 for four ticks.
    assert render(FDGTrainSchedule(4, 2, 0)) == [
        "L0 F0 sa0 X T+",
        "pg0 L1 F1 sa1 X T+",
        "G0 pg1 B0 R S L2 F2 sa2 X T+",
        "G1 pg2 B1 R S L3 F3 sa3 X T+",
    ]
    assert render(FDGTrainSchedule(4, 2, 1)) == [
        "pa0 L0 X T+",
        "A0 pa1 L1 F0 B0 sg0 R S X T+",
        "A1 pa2 L2 F1 B1 sg1 R S X T+",
        "A2 pa3 L3 F2 B2 sg2 R S X T+",
    ]


def test_accumulate_steps_every_n_backward_passes_and_at_drain() -> None:
    steps = render(FDGTrainSchedule(6, 1, 0, accumulate=4)) + render(
        FDGTrainSchedule(0, 1, 0, start_tick=6, accumulate=4, drain=True)
    )
    # K = 1: steps after the 4th backward; the drain has no tick but steps the remaining two.
    assert [("S" in step.split()) for step in steps] == [False, False, False, True, False, False, True]
    assert steps[-1] == "R S"
    # K = 2, stage 0 drains after 6 micro-batches: steps after B3 and after the last (partial) B5.
    sched = [*FDGTrainSchedule(6, 2, 0, accumulate=4).steps(), *FDGTrainSchedule(2, 2, 0, 6, 4, drain=True).steps()]
    sched = [list(step) for step in sched]  # each tick's instructions come one at a time
    stepped_after = [
        next(str(c) for c in step if isinstance(c, FDGBackward))
        for step in sched
        if any(isinstance(c, LocalOptimizerStep) for c in step)
    ]
    assert stepped_after == ["B3", "B5"]


def _all_steps(stages: int, calls: list[int], accumulate: int) -> dict[int, list[list]]:
    """Every stage's instruction lists over several calls (the last call a drain)."""
    out: dict[int, list[list]] = {}
    for stage_id in range(stages):
        tick, steps = 0, []
        for n in calls:
            steps += map(list, FDGTrainSchedule(n, stages, stage_id, start_tick=tick, accumulate=accumulate).steps())
            tick += n
        steps += map(
            list, FDGTrainSchedule(ticks.drain_ticks(stages), stages, stage_id, tick, accumulate, True).steps()
        )
        out[stage_id] = steps
    return out


@pytest.mark.parametrize(
    "stages,gas,accumulate",
    [(k, g, a) for k, g, a in itertools.product([1, 2, 3, 4, 5, 8], [1, 2, 3, 7], [1, 3])],
)
def test_invariants(stages: int, gas: int, accumulate: int) -> None:
    calls = [gas] * 4
    plan = _all_steps(stages, calls, accumulate)
    entered = sum(calls)
    n_ticks = entered + ticks.drain_ticks(stages)
    for stage_id, steps in plan.items():
        flush = stages == 1 and entered % accumulate != 0  # K = 1's drain: one step, no tick
        assert len(steps) == n_ticks + flush
        if flush:
            assert [type(c) for c in steps.pop()] == [ReduceGrads, LocalOptimizerStep]
        delay = ticks.delay(stages, stage_id)
        fwd_tick, bwd_tick, steps_taken = {}, {}, 0
        for tick, step in enumerate(steps):
            kinds = [type(c) for c in step]
            assert kinds[-2:] == [Exchange, AdvanceTick], "every tick ends with the exchange's end then the tick"
            assert kinds.count(Exchange) == 1
            for c in step:
                if isinstance(c, FDGForward):
                    fwd_tick[c.micro_batch] = tick
                if isinstance(c, FDGBackward):
                    bwd_tick[c.micro_batch] = tick
            if stage_id < stages - 1 and FDGBackward in kinds and FDGForward in kinds:
                assert kinds.index(FDGBackward) < kinds.index(FDGForward), "backward before forward"
            for before, cmd in zip(step, step[1:]):  # Note [each message when it exists]: sent once made
                made = {SendGrad: FDGBackward, SendActivation: FDGForward}.get(type(cmd))
                if made is not None and not getattr(cmd, "end", False):
                    assert isinstance(before, made) and before.micro_batch == cmd.micro_batch, (tick, step)
            if LocalOptimizerStep in kinds:
                assert kinds[kinds.index(LocalOptimizerStep) - 1] is ReduceGrads
                steps_taken += 1
            assert step[-1].entered == (tick < entered)
        # Each micro-batch is forwarded at b + k and back-propagated exactly delay ticks later.
        assert sorted(fwd_tick) == sorted(bwd_tick) == list(range(entered))
        for b in range(entered):
            assert fwd_tick[b] == b + stage_id
            assert bwd_tick[b] == b + stage_id + delay == b + 2 * (stages - 1) - stage_id
        assert steps_taken + flush == -(-entered // accumulate)  # every `accumulate` passes + the remainder
        # Buffers: a buffer is never reused while its micro-batch is in flight.
        nbuf = ticks.num_buffers(stages, stage_id)
        for b in range(entered):
            for other in range(b + 1, entered):
                if other % nbuf == b % nbuf:
                    assert fwd_tick[other] > bwd_tick[b]
    _check_messages_pair_up(plan, stages)


def _check_messages_pair_up(plan: dict[int, list[list]], stages: int) -> None:
    """Every send meets the receive the neighbour posted in the same tick (Note [each message when it exists]),
    of the same micro-batch, and that receive is waited for in the neighbour's next tick."""

    def micro_batches(step: list, kind: type) -> list[int]:
        return [c.micro_batch for c in step if isinstance(c, kind)]

    for stage_id in range(stages - 1):
        for tick, (up, down) in enumerate(zip(plan[stage_id], plan[stage_id + 1])):
            assert micro_batches(up, SendActivation) == micro_batches(down, PostRecvActivation), (stage_id, tick)
            assert micro_batches(down, SendGrad) == micro_batches(up, PostRecvGrad), (stage_id, tick)
            for step, post, wait in ((down, PostRecvActivation, WaitActivation), (up, PostRecvGrad, WaitGrad)):
                rows = plan[stage_id + 1] if step is down else plan[stage_id]
                if micro_batches(step, post) and tick + 1 < len(rows):
                    assert micro_batches(rows[tick + 1], wait) == micro_batches(step, post), (stage_id, tick)


def test_first_and_last_stage_read_each_micro_batch_at_the_same_tick() -> None:
    for stages in (1, 2, 3, 4):
        for stage_id in {0, stages - 1}:
            loads = [
                [c.micro_batch for c in step if isinstance(c, FDGLoad)]
                for step in FDGTrainSchedule(12, stages, stage_id).steps()
            ]
            assert loads == [[t] for t in range(12)]  # so both data iterators stay at the same position
        drain = FDGTrainSchedule(ticks.drain_ticks(stages), stages, stages - 1, start_tick=12, drain=True)
        assert not any(isinstance(c, FDGLoad) for step in drain.steps() for c in step)


def test_buffers() -> None:
    assert [ticks.num_buffers(4, k) for k in range(4)] == [7, 5, 3, 1]
    assert [ticks.delay(3, k) for k in range(3)] == [4, 2, 0]


def test_a_drain_learns_an_earlier_end_of_the_data_on_its_way_down() -> None:
    # K = 2, 5 micro-batches: stage 0 learned the end at tick 5; a drain starts at tick 6 on stage 1,
    # which learns it from the dummy activation and stops at the segment's last tick (6), not after 2.
    drain = FDGTrainSchedule(ticks.drain_ticks(2), 2, 1, start_tick=6, drain=True)
    running = ScheduleRun(drain)
    rendered = []
    for step in running:
        cmds = []
        for cmd in step:
            cmds.append(str(cmd))
            if isinstance(cmd, WaitActivation):
                running.end_data(5)
        rendered.append(" ".join(cmds))
    assert rendered == ["A5 X T"]
    assert drain.limit == 6 and running.schedule.limit == 5  # a new schedule, the drain's own untouched
    assert render(running.schedule) == ["A5 X T"]  # the ended schedule alone gives what ran


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_the_tick_end_says_which_tick_is_the_segments_last(stages: int) -> None:
    """AdvanceTick(last=True) at the tick stage 0 back-propagates the segment's last micro-batch, on every stage:
    the tied step flushes there (Note [tied layers across stages]); a segment whose end is not known has none."""

    def lasts(plan: FDGTrainSchedule) -> list[bool]:
        return [cmd.last for step in plan.steps() for cmd in step if isinstance(cmd, AdvanceTick)]

    for stage_id in range(stages):
        ended = lasts(FDGTrainSchedule(20, stages, stage_id, limit=5))
        assert len(ended) == ticks.last_tick(5, stages) + 1 and ended[-1] and not any(ended[:-1])
        assert not any(lasts(FDGTrainSchedule(8, stages, stage_id)))
        drain = lasts(FDGTrainSchedule(ticks.drain_ticks(stages), stages, stage_id, start_tick=4, drain=True))
        assert drain == [False] * (ticks.drain_ticks(stages) - 1) + [True] or stages == 1


def _render_with_labels_ending_at_7(plan: FDGTrainSchedule) -> list[str]:
    """The last stage's ticks, rendered, when its labels run out after micro-batch 6 (told at that forward)
    and the end of the data arrives where micro-batch 7 would (Note [end of data])."""
    rendered = []
    running = ScheduleRun(plan)
    for step in running:
        cmds = []
        for cmd in step:
            cmds.append(short(cmd))
            if isinstance(cmd, FDGForward) and cmd.micro_batch == 6:
                running.end_labels(7)
            if isinstance(cmd, WaitActivation) and cmd.micro_batch == 7:
                running.end_data(7)
        rendered.append(" ".join(cmds))
    return rendered


def test_the_last_stage_steps_a_partial_accumulation_at_the_end_of_its_labels() -> None:
    # K = 2, accumulate 2, 7 micro-batches (Note [end of data]): stage 1's labels run out at micro-batch 7
    # (read at tick 7); it forwards micro-batch 6 at tick 7 holding no more labels, so it steps after that
    # backward, at tick 7 as the reference does, not at tick 8 when the dummy tells it the data ended.
    rendered = _render_with_labels_ending_at_7(FDGTrainSchedule(9, 2, 1, accumulate=2))
    assert rendered[6:] == ["A5 pa6 L6 F5 B5 sg5 R S X T+", "A6 pa7 L7 F6 B6 sg6 R S X T+", "A7 X T"]
    with pytest.raises(FDGRuntimeError, match="labels ran out at micro-batch 3"):
        ScheduleRun(FDGTrainSchedule(9, 2, 0, accumulate=2)).end_labels(3)  # only the last stage holds labels


def test_a_drain_after_the_data_ended_steps_the_partial_accumulation_the_labels_show() -> None:
    # K = 3, accumulate 2, 7 micro-batches; the call ended at tick 8 before stage 2 learned the end, and a
    # drain (limit 8 as far as stage 2 knows) starts there: its labels ran out at micro-batch 7, so it
    # steps after the backward of micro-batch 6 at tick 8, as the reference does, then learns the end.
    drain = FDGTrainSchedule(ticks.drain_ticks(3), 3, 2, start_tick=8, accumulate=2, drain=True)
    rendered = _render_with_labels_ending_at_7(drain)
    assert rendered == ["A6 pa7 F6 B6 sg6 R S X T", "A7 X T", "X T"]
