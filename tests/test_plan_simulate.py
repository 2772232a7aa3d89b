"""The planner's simulator against closed forms, golden timelines, and the memory formulas of docs/fdg.md.

Pure: no process group. Costs are unit-like numbers so the expected values are exact.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from fdg_schedule.plan import streams as st
from fdg_schedule.plan.predict import fdg_window
from fdg_schedule.plan.simulate import ChunkCosts, Deadlock, Link, simulate
from fdg_schedule.plan.streams import Action, Op
from fdg_schedule.sched import schedule as fdg_schedule
from fdg_schedule.sched import ticks


def chain(forward: list[float], backward: list[float], exchange: tuple[float, float] = (0.0, 0.0), step: float = 0.0,
          held: float = 1.0, input_fraction: float = 0.5, **extra: float) -> list[ChunkCosts]:  # fmt: skip
    """Chunk costs of a pipeline; every message holds its link ``exchange[0]`` s and arrives ``exchange[1]`` later."""
    n = len(forward)
    occupancy, latency = exchange

    def link(name: str) -> Link:
        return Link(occupancy, latency, 1.0, False, name)

    return [
        ChunkCosts(
            forward[c],
            backward[c],
            step,
            backward_input_s=backward[c] * input_fraction,
            held_bytes=held,
            to_next=None if c == n - 1 else link(f"n{c}"),
            to_prev=None if c == 0 else link(f"p{c}"),
            **extra,
        )  # fmt: skip
        for c in range(n)
    ]


def fdg_period(streams_costs: list[ChunkCosts], stages: int, accumulate: int = 1) -> float:
    length_ticks, first, length = fdg_window(stages, accumulate)
    timeline = simulate(st.fdg_streams(stages, length_ticks, accumulate, drain=False), streams_costs)
    forwards = timeline.ends(0, Op.FORWARD)
    return (forwards[first + length] - forwards[first]) / length


# -- closed forms -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3, 5, 8])
@pytest.mark.parametrize("factor", [0.5, 1, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "deepspeed_1f1b", "megatron_1f1b"])
def test_flushing_schedules_take_m_plus_k_minus_1_slots(schedule: str, stages: int, factor: float) -> None:
    micro_batches = max(1, int(factor * stages))
    streams = {
        "gpipe": st.gpipe_streams(stages, micro_batches),
        "deepspeed_1f1b": st.deepspeed_1f1b_streams(stages, micro_batches),
        "megatron_1f1b": st.interleaved_streams(stages, micro_batches, chunks=1),
    }[schedule]
    timeline = simulate(streams, chain([1.0] * stages, [2.0] * stages))
    assert timeline.makespan == pytest.approx((micro_batches + stages - 1) * 3.0)
    idle = 1 - sum(timeline.busy(r) for r in range(stages)) / (stages * timeline.makespan)
    assert idle == pytest.approx((stages - 1) / (micro_batches + stages - 1))  # the bubble


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaving_divides_the_bubble_by_the_chunks(stages: int, chunks: int) -> None:
    # Narayanan et al. 2021: bubble (K-1)(t_f + t_b) / v with t the whole stage's times.
    micro_batches = 2 * stages
    t_f, t_b = 1.0, 2.0  # per stage; each chunk does 1/v of it
    timeline = simulate(st.interleaved_streams(stages, micro_batches, chunks),
                        chain([t_f / chunks] * (stages * chunks), [t_b / chunks] * (stages * chunks)))  # fmt: skip
    assert timeline.makespan == pytest.approx(micro_batches * (t_f + t_b) + (stages - 1) * (t_f + t_b) / chunks)


@pytest.mark.parametrize("stages", [2, 3, 5, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_zb_h1_bubble_is_k_minus_1_times_f_plus_b_minus_w(stages: int, factor: int) -> None:
    # Qi et al. 2024: with m >= K, ZB-H1's bubble is (p - 1)(T_F + T_B - T_W).
    t_f, t_i, t_w = 1.0, 1.2, 0.8
    micro_batches = factor * stages
    costs = chain([t_f] * stages, [t_i + t_w] * stages, input_fraction=t_i / (t_i + t_w))
    timeline = simulate(st.zbh1_streams(stages, micro_batches), costs)
    assert timeline.makespan == pytest.approx(micro_batches * (t_f + t_i + t_w) + (stages - 1) * (t_f + t_i - t_w))


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_fdg_steady_tick_is_the_slowest_stage_without_communication(stages: int) -> None:
    rng = random.Random(stages)
    forward = [rng.uniform(0.5, 1.5) for _ in range(stages)]
    backward = [rng.uniform(1.0, 3.0) for _ in range(stages)]
    step = 0.25
    assert fdg_period(chain(forward, backward, step=step), stages) == pytest.approx(
        max(f + b for f, b in zip(forward, backward)) + step
    )


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("exchange", [(0.0, 0.2), (0.1, 0.2), (0.0, 0.5), (1.0, 0.0), (0.0, 3.0)])
def test_fdg_steady_tick_adds_the_exchange_it_cannot_overlap(stages: int, exchange: tuple[float, float]) -> None:
    # Note [each message when it exists]: a message leaves when it is made. What stays on the critical path is
    # the round trip of the last two stages: stage K-2 back-propagates micro-batch b two ticks after forwarding
    # it, and in between the activation goes down, the last stage forwards and back-propagates it (f + b) and the
    # gradient comes back. Over two ticks stage K-2 runs B R S F once plus that round trip, so the period is
    # max(f + b + step, f + b + step / 2 + link) with f = 1, b = 2, step = 0.5, link = occupancy + latency: up
    # to half the step a link costs nothing, beyond it half a step less than when the whole exchange ran at
    # the tick's end (f + b + step + link).
    link = sum(exchange)
    assert fdg_period(chain([1.0] * stages, [2.0] * stages, exchange, step=0.5), stages) == pytest.approx(
        max(3.0 + 0.5, 3.0 + 0.25 + link)
    )


@pytest.mark.parametrize("accumulate", [2, 3])
def test_fdg_accumulation_amortises_the_step_between_its_bounds(accumulate: int) -> None:
    # Stages step on different ticks, and a step on one delays its neighbours, so the period lies
    # between the amortised step and a full step per tick.
    # (the link, 0.3, hidden at best, on the critical path at worst)
    period = fdg_period(chain([1.0] * 4, [2.0] * 4, (0.1, 0.2), step=0.5), 4, accumulate)
    assert 3.0 + 0.5 / accumulate - 1e-9 <= period <= 3.3 + 0.5 + 1e-9


def test_a_blocking_send_waits_for_the_receiver() -> None:
    # rank 1 posts its receive only after 5 s of work; the rendezvous holds rank 0 until then.
    streams = [
        [Action(0, Op.FORWARD, 0), Action(0, Op.SEND_ACTIVATION, 0, blocking=True), Action(0, Op.FORWARD, 1)],
        [Action(1, Op.BACKWARD, 9), Action(1, Op.RECV_ACTIVATION, 0), Action(1, Op.FORWARD, 0)],
    ]
    costs = [ChunkCosts(1.0, 5.0, to_next=Link(0.5, 0.25, 8.0, False, "a")),
             ChunkCosts(1.0, 5.0, to_prev=Link(0.5, 0.25, 8.0, False, "b"))]  # fmt: skip
    timeline = simulate(streams, costs)
    assert timeline.ends(0, Op.FORWARD) == [1.0, 6.75]  # second forward after the transfer 5 -> 5.75 (+1)
    assert timeline.ends(1, Op.FORWARD) == [6.75]
    nonblocking = [[Action(a.stage, a.op, a.micro_batch) for a in s] for s in streams]
    assert simulate(nonblocking, costs).ends(0, Op.FORWARD) == [1.0, 2.0]


def test_messages_on_one_link_leave_in_order() -> None:
    streams = [[Action(0, Op.FORWARD, 0), Action(0, Op.SEND_ACTIVATION, 0), Action(0, Op.FORWARD, 1),
                Action(0, Op.SEND_ACTIVATION, 1)],
               [Action(1, Op.RECV_ACTIVATION, 0), Action(1, Op.FORWARD, 0), Action(1, Op.RECV_ACTIVATION, 1),
                Action(1, Op.FORWARD, 1)]]  # fmt: skip
    costs = chain([0.1, 0.1], [0.0, 0.0], exchange=(1.0, 0.5))
    timeline = simulate(streams, costs)
    assert [m.arrived for m in timeline.messages] == pytest.approx([1.6, 2.6])  # the second queues behind the first


def test_a_deadlock_names_the_stuck_ranks_and_their_next_actions() -> None:
    streams = [[Action(0, Op.SEND_ACTIVATION, 0, blocking=True), Action(0, Op.RECV_GRAD, 0)],
               [Action(1, Op.SEND_GRAD, 0, blocking=True), Action(1, Op.RECV_ACTIVATION, 0)]]  # fmt: skip
    costs = chain([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(Deadlock, match=r"rank  0 >> \.\.\.  \| sa0 G0\n  rank  1 >> \.\.\.  \| sg0 A0"):
        simulate(streams, costs)


# -- golden timelines ---------------------------------------------------------------------------------


def test_golden_gpipe_k2() -> None:
    timeline = simulate(st.gpipe_streams(2, 4), chain([1.0, 1.0], [1.0, 1.0]))
    assert timeline.grid(1.0) == [
        "F0 F1 F2 F3 .  .  B0 B1 B2 B3",
        ".  F0 F1 F2 F3 B0 B1 B2 B3",
    ]


def test_golden_deepspeed_1f1b_k3() -> None:
    timeline = simulate(st.deepspeed_1f1b_streams(3, 4), chain([1.0] * 3, [1.0] * 3))
    assert timeline.grid(1.0) == [
        "F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
        ".  F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        ".  .  F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_golden_fdg_k3_matches_the_tick_table() -> None:
    # Unit forward and backward, no communication time: the tick table itself.
    timeline = simulate(st.fdg_streams(3, 6), chain([1.0] * 3, [1.0] * 3))
    assert timeline.grid(1.0) == [
        "F0 F1 F2 F3 .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5",
        ".  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5",
        ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    # and the order of work on every stage is ticks.py's: forward b at tick b + k, backward at b + 2(K-1) - k
    for k, stream in enumerate(st.fdg_streams(3, 6)):
        compute = [a for a in stream if a.op in (Op.FORWARD, Op.BACKWARD)]
        order = sorted(compute, key=lambda a: (
            a.micro_batch + (k if a.op is Op.FORWARD else 2 * 2 - k), a.op is Op.FORWARD))  # fmt: skip
        if k == 2:  # the last stage forwards then back-propagates within a tick
            order = sorted(compute, key=lambda a: (a.micro_batch, a.op is Op.BACKWARD))
        assert compute == order


def test_golden_zb_h1_k3() -> None:
    timeline = simulate(st.zbh1_streams(3, 4), chain([1.0] * 3, [2.0] * 3))
    assert timeline.grid(1.0) == [
        "F0 F1 F2 .  .  B0 B0 F3 B1 B1 B2 B2 B3 B3",
        ".  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        ".  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ]


def test_fdg_streams_follow_the_engines_generator() -> None:
    assert st.render(st.fdg_streams(2, 3)) == [
        "F0 sa0 F1 sa1 G0 B0 R S F2 sa2 G1 B1 R S G2 B2 R S",
        "A0 F0 B0 sg0 R S A1 F1 B1 sg1 R S A2 F2 B2 sg2 R S",
    ]
    # accumulate=2: the all-reduce and step follow every second backward (and the drain's last)
    assert st.render(st.fdg_streams(2, 3, accumulate=2))[1] == "A0 F0 B0 sg0 A1 F1 B1 sg1 R S A2 F2 B2 sg2 R S"


def test_every_fdg_instruction_kind_is_an_action() -> None:
    # One alphabet: every instruction the engine runs is the instruction of one action op (the table
    # schedule.INSTRUCTIONS), and the planner's streams are written in the same ops.
    classes = {cls for cls, _ in fdg_schedule.INSTRUCTIONS.values()}
    assert classes == set(fdg_schedule.KINDS)
    assert {a.op for s in st.fdg_streams(3, 4) for a in s} <= set(fdg_schedule.INSTRUCTIONS)
    assert {a.op for s in st.zbh1_streams(3, 4) for a in s} <= set(Op)


def test_interleaved_streams_name_their_chunks() -> None:
    line = st.render(st.interleaved_streams(2, 2, chunks=2))[0]
    assert line.startswith("F0 sa0 F1 sa1 A0.2 F0.2 sa0.2 A1.2 F1.2")


def test_interleaving_refuses_micro_batches_not_divisible_by_k() -> None:
    with pytest.raises(ValueError, match="needs micro-batches divisible by the stages: 5 micro-batches, 2 stages"):
        st.interleaved_streams(2, 5, chunks=2)


# -- memory formulas of docs/fdg.md -----------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
def test_fdg_holds_delay_micro_batches_per_stage(stages: int) -> None:
    """Stored: d·A; stashed: d·(A+W); recomputed: d·I (+ one A during the backward); last stage: one A."""
    a, i, w = 10.0, 1.0, 3.0
    micro_batches = 3 * stages
    streams = st.fdg_streams(stages, micro_batches)
    cases = {
        "stored": (a, 0.0, lambda d: d * a),
        "stashed": (a + w, 0.0, lambda d: d * (a + w)),
        "recomputed": (i, a, lambda d: d * i + a),
    }
    for held, extra, expected in cases.values():
        costs = [ChunkCosts(1.0, 2.0, held_bytes=held if k < stages - 1 else a, backward_extra_bytes=extra
                            if k < stages - 1 else 0.0, to_next=Link(0, 0, 0, False, f"n{k}") if k < stages - 1
                            else None, to_prev=Link(0, 0, 0, False, f"p{k}") if k else None)
                 for k in range(stages)]  # fmt: skip
        peaks = simulate(streams, costs).peak_bytes
        assert peaks == pytest.approx([expected(ticks.delay(stages, k)) for k in range(stages - 1)] + [a])


@pytest.mark.parametrize("stages", [2, 3, 5])
@pytest.mark.parametrize("micro_batches", [1, 3, 8])
def test_1f1b_holds_k_minus_k_and_gpipe_m(stages: int, micro_batches: int) -> None:
    one_f_one_b = simulate(st.deepspeed_1f1b_streams(stages, micro_batches), chain([1.0] * stages, [2.0] * stages))
    assert one_f_one_b.peak_bytes == [min(stages - k, micro_batches) for k in range(stages)]
    gpipe = simulate(st.gpipe_streams(stages, micro_batches), chain([1.0] * stages, [2.0] * stages))
    assert gpipe.peak_bytes == [micro_batches] * stages


@pytest.mark.parametrize("stages", [2, 3, 5])
@pytest.mark.parametrize("factor", [1, 3])
def test_zb_h1_holds_1f1bs_micro_batches_plus_what_deferred_w_passes_need(stages: int, factor: int) -> None:
    # Stage k defers k weight-gradient passes; each keeps w of a micro-batch's activations after I.
    a, w = 10.0, 4.0
    costs = [dataclasses.replace(c, held_bytes=a, weight_grad_bytes=0.0 if k == 0 else w)
             for k, c in enumerate(chain([1.0] * stages, [2.0] * stages))]  # fmt: skip
    timeline = simulate(st.zbh1_streams(stages, factor * stages), costs)
    assert timeline.peak_bytes == [(stages - k) * a + k * w for k in range(stages)]
    assert max(timeline.peak_bytes) == stages * a  # the paper: ZB-H1's peak is 1F1B's


def _deepspeed_generator_streams(stages: int, micro_batches: int) -> list[st.Stream]:
    """The 1F1B streams read off DeepSpeed's own ``TrainSchedule`` (its instructions carry buffer ids:
    on a stage the forward-side and the backward-side instructions each come in micro-batch order,
    so counting each kind numbers them)."""
    from deepspeed.runtime.pipe import schedule as ds

    kinds = {
        ds.RecvActivation: Op.RECV_ACTIVATION, ds.SendActivation: Op.SEND_ACTIVATION, ds.ForwardPass: Op.FORWARD,
        ds.RecvGrad: Op.RECV_GRAD, ds.SendGrad: Op.SEND_GRAD, ds.BackwardPass: Op.BACKWARD,
        ds.ReduceGrads: Op.ALLREDUCE, ds.OptimizerStep: Op.STEP,
    }  # fmt: skip
    streams = []
    for stage in range(stages):
        seen: dict[Op, int] = {}
        stream: st.Stream = []
        for step in ds.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage).steps():
            for cmd in step:
                if isinstance(cmd, (ds.LoadMicroBatch, ds.ReduceTiedGrads)):
                    continue
                op = kinds[type(cmd)]
                if op in (Op.ALLREDUCE, Op.STEP):
                    stream.append(Action(stage, op))
                    continue
                seen[op] = seen.get(op, 0) + 1
                stream.append(Action(stage, op, seen[op] - 1, blocking=op in st.SENDS))
        streams.append([*stream, Action(stage, Op.PIPE_COLLECTIVE)])
    return streams


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 8, 13])
def test_deepspeed_1f1b_restated_equals_deepspeeds_generator(stages: int, micro_batches: int) -> None:
    """The planner's torch-free 1F1B is DeepSpeed's TrainSchedule, action for action."""
    assert st.deepspeed_1f1b_streams(stages, micro_batches) == _deepspeed_generator_streams(stages, micro_batches)
