"""Per-rank instruction streams of every schedule the planner compares, as plain action lists.

FDG's stream is the engine's own schedule: the actions of the one lowering (:mod:`fdg_schedule.sched.lowering`),
which the engine runs as its instructions; DeepSpeed's 1F1B is the step arithmetic of
``deepspeed.runtime.pipe.schedule.TrainSchedule``, restated torch-free: the planner times what the engines
execute. GPipe, interleaved 1F1B and ZB-H1 are written here from their papers' orderings.

The actions and ops are the one alphabet's (:mod:`fdg_schedule.sched.actions`); a stream action's compact text is
``<op><micro-batch>`` (``F3``, ``G5``, :meth:`~fdg_schedule.sched.actions.Action.short`), its rank implied by the
stream it is in. An action's ``stage`` is its chunk, a virtual stage: with ``v`` chunks per rank (interleaved
1F1B) the model is cut into ``K * v`` pieces and chunk ``c`` runs on rank ``c % K``; otherwise chunk = stage =
rank. Sends are non-blocking unless ``blocking`` (then the sender waits for the receiver: a rendezvous).
"""

from __future__ import annotations

from collections.abc import Iterator

from fdg_schedule.sched import lowering
from fdg_schedule.sched.actions import COMPUTE, RECVS, SENDS, Action, Op

# The one alphabet (fdg_schedule.sched.actions); re-exported for the simulator.
__all__ = ["COMPUTE", "RECVS", "SENDS", "Action", "Op", "Stream"]

Stream = list[Action]
# What the planner times of the engine's actions: loads, posted receives and a tick's ends cost nothing here.
_TIMED = COMPUTE | SENDS | RECVS | {Op.ALLREDUCE}


# ---------------------------------------------------------------------------------------------------
# FDG: from the engine's generator


def fdg_streams(stages: int, micro_batches: int, accumulate: int = 1, drain: bool = True) -> list[Stream]:
    """Every stage's actions for a segment of ``micro_batches`` FDG ticks (then a drain).

    The actions the engine runs (:func:`fdg_schedule.sched.lowering.run_call`, the drain's ends included): waits
    before the backward / forward that needs them, the non-blocking send of each message right after the
    compute that made it (a gradient leaves before the tick's all-reduce, step and forward). Loads, posted
    receives and the tick's ends cost nothing here.
    """
    return [[a for tick in _fdg_ticks(stages, stage, micro_batches, accumulate, drain) for a in tick]
            for stage in range(stages)]  # fmt: skip


def fdg_thread_streams(stages: int, micro_batches: int, accumulate: int = 1) -> list[Stream]:
    """FDG as the authors' reference code runs it: every stage computes its tick, then all join.

    One Python process drives all GPUs with a thread per stage; after the threads join, the main
    thread copies every activation and gradient to its neighbour, one after another. Each tick is
    FDG's own compute (backward, all-reduce, step, forward) and then one pipeline collective (``P``)
    whose duration the caller sets to that of the serial copies.
    """
    out = []
    for stage in range(stages):
        stream: Stream = []
        for tick in _fdg_ticks(stages, stage, micro_batches, accumulate, drain=False):
            stream += [a for a in tick if a.op not in SENDS and a.op not in RECVS]
            stream.append(Action(stage, Op.PIPE_COLLECTIVE))
        out.append(stream)
    return out


def _fdg_ticks(stages: int, stage: int, micro_batches: int, accumulate: int, drain: bool) -> Iterator[Stream]:
    # a call of micro_batches ticks, then (drain) the call of 2(K-1) ticks that finishes the ones in flight
    calls = [lowering.StageSchedule(micro_batches, stages, stage, 0, accumulate)]
    if drain and stages > 1:
        calls.append(lowering.StageSchedule(2 * (stages - 1), stages, stage, micro_batches, accumulate, drain=True))
    for call in calls:
        for tick in lowering.run_call(call)[0]:
            yield [a for a in tick if a.op in _TIMED]


# ---------------------------------------------------------------------------------------------------
# DeepSpeed 1F1B: DeepSpeed's generator, restated torch-free


def _deepspeed_step(stages: int, stage: int, step: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of ``TrainSchedule._step_to_micro_batch``: even stages go forward on
    even steps, odd stages on odd steps, and backward on the others."""
    if step % 2 == stage % 2:
        return (step - stage % 2) // 2 - stage // 2, True
    if step % 2 == 0:  # an odd stage's backward
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def deepspeed_1f1b_streams(stages: int, micro_batches: int) -> list[Stream]:
    """Every stage's actions for one ``train_batch()`` of DeepSpeed's ``TrainSchedule``.

    The step arithmetic of ``deepspeed.runtime.pipe.schedule.TrainSchedule.steps`` (DeepSpeed 0.19.8,
    Apache-2.0), restated here so the planner imports no torch; tests/test_plan_simulate.py checks it
    against DeepSpeed's generator instruction by instruction. At each of ``2 (m + K - 1)`` steps a
    stage runs the exchange of the step (forward steps: send the previous micro-batch's input
    gradient, receive this one's activation; backward steps: receive this one's output gradient, send
    the previous one's activation), then its forward or backward; the last step reduces and steps.
    Its ``p2p.send``/``recv`` are blocking (a rendezvous). ``train_batch`` ends with the loss broadcast
    over the pipeline (``_aggregate_total_loss``): every stage waits for the last.
    """

    def valid(mb: int) -> bool:
        return 0 <= mb < micro_batches

    streams = []
    for stage in range(stages):
        has_prev, has_next = stage > 0, stage < stages - 1
        stream: Stream = []
        prev = -1
        total = 2 * (micro_batches + stages - 1)
        for step in range(total):
            mb, forward = _deepspeed_step(stages, stage, step)
            if forward:
                exchange = [(Op.SEND_GRAD, prev, has_prev), (Op.RECV_ACTIVATION, mb, has_prev)]
            else:
                exchange = [(Op.RECV_GRAD, mb, has_next), (Op.SEND_ACTIVATION, prev, has_next)]
            stream += [Action(stage, op, m, blocking=op in SENDS) for op, m, linked in exchange if linked and valid(m)]
            if valid(mb):
                stream.append(Action(stage, Op.FORWARD if forward else Op.BACKWARD, mb))
            prev = mb
        stream += [
            Action(stage, Op.ALLREDUCE),
            Action(stage, Op.STEP),
            Action(stage, Op.PIPE_COLLECTIVE),
        ]
        streams.append(stream)
    return streams


# ---------------------------------------------------------------------------------------------------
# Published orderings


def _forward(mb: int, chunk: int, chunks: int) -> Stream:
    """Receive the input (unless the first chunk), forward, send the output (unless the last)."""
    out = [] if chunk == 0 else [Action(chunk, Op.RECV_ACTIVATION, mb)]
    out.append(Action(chunk, Op.FORWARD, mb))
    return out + ([] if chunk == chunks - 1 else [Action(chunk, Op.SEND_ACTIVATION, mb)])


def _backward(mb: int, chunk: int, chunks: int, op: Op = Op.BACKWARD) -> Stream:
    """Receive the output gradient (unless the last chunk), back-propagate, send the input gradient."""
    out = [] if chunk == chunks - 1 else [Action(chunk, Op.RECV_GRAD, mb)]
    out.append(Action(chunk, op, mb))
    return out + ([] if chunk == 0 else [Action(chunk, Op.SEND_GRAD, mb)])


def _finish(stage: int) -> Stream:
    """End of a batch: all-reduce, step, and the cross-stage collective (grad-norm / loss report)."""
    return [Action(stage, Op.ALLREDUCE), Action(stage, Op.STEP), Action(stage, Op.PIPE_COLLECTIVE)]


def gpipe_streams(stages: int, micro_batches: int) -> list[Stream]:
    """GPipe (Huang et al. 2019): every forward of the batch, then every backward, then the step.

    ::

        stage 0  F0 F1 F2 F3 .  .  B0 B1 B2 B3
        stage 1  .  F0 F1 F2 F3 B0 B1 B2 B3 .         (K = 2, m = 4, one slot per F or B)
    """
    streams = []
    for s in range(stages):
        stream: Stream = []
        for mb in range(micro_batches):
            stream += _forward(mb, s, stages)
        for mb in range(micro_batches):
            stream += _backward(mb, s, stages)
        streams.append(stream + _finish(s))
    return streams


def interleaved_streams(stages: int, micro_batches: int, chunks: int = 2) -> list[Stream]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): ``chunks`` model chunks per rank.

    Rank r holds chunks r, r + K, ..., and runs ``(K - r - 1) * 2 + (chunks - 1) * K`` warm-up
    forwards, then alternates one forward and one backward, then cools down with backwards. The
    j-th forward on a rank is micro-batch ``(j // (K v)) K + j % K`` of chunk ``(j % (K v)) // K``;
    backwards visit chunks in reverse. With ``chunks = 1`` this is Megatron's plain 1F1B.
    Needs ``micro_batches`` divisible by ``K`` (as Megatron does).
    """
    if chunks > 1 and micro_batches % stages:
        raise ValueError(f"interleaved 1F1B needs micro-batches divisible by the stages: {micro_batches} "
                         f"micro-batches, {stages} stages; pick --micro-batches as a multiple of K")  # fmt: skip
    virtual = stages * chunks
    total = micro_batches * chunks
    streams = []
    for r in range(stages):

        def item(j: int, forward: bool, r: int = r) -> tuple[int, int]:
            local = (j % virtual) // stages
            mb = (j // virtual) * stages + j % stages
            return mb, (local if forward else chunks - 1 - local) * stages + r

        if chunks == 1:
            warmup = min(stages - r - 1, micro_batches)
        else:
            warmup = min((stages - r - 1) * 2 + (chunks - 1) * stages, total)
        stream: Stream = []
        for j in range(warmup):
            stream += _forward(*item(j, True), virtual)
        for i in range(total - warmup):
            stream += _forward(*item(warmup + i, True), virtual)
            stream += _backward(*item(i, False), virtual)
        for i in range(total - warmup, total):
            stream += _backward(*item(i, False), virtual)
        streams.append(stream + _finish(r))
    return streams


def zbh1_streams(stages: int, micro_batches: int) -> list[Stream]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split in two.

    ``I`` (input gradient, on the critical path) runs where 1F1B runs ``B``; stage k defers its
    ``W`` (weight gradient) passes by k slots, so they fill the tail bubble, and never holds more
    micro-batches than 1F1B's stage 0 (K). Warm-up ``K - k - 1`` forwards; then k slots of ``F I``;
    then ``F I W`` until the forwards run out; then ``I W``; then the remaining ``W``::

        stage 0  F0 F1 F2 B0 F3 B1 B2 B3
        stage 1  F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        stage 2  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3      (K = 3, m = 4, in stream order)

    The first stage sends no input gradient, so it runs one full ``B`` (as the authors' code does).
    """
    streams = []
    for k in range(stages):
        first = k == 0
        back_op = Op.BACKWARD if first else Op.BACKWARD_INPUT
        stream: Stream = []
        forward = backward = weight = 0

        def backward_step(mb: int, k: int = k, back_op: Op = back_op) -> Stream:
            return _backward(mb, k, stages, back_op)

        def weight_step(k: int = k, first: bool = first) -> Stream:
            nonlocal weight
            weight += 1
            return [] if first else [Action(k, Op.BACKWARD_WEIGHT, weight - 1)]

        for _ in range(min(stages - k - 1, micro_batches)):
            stream += _forward(forward, k, stages)
            forward += 1
        for _ in range(k):
            if forward == micro_batches:
                break
            stream += _forward(forward, k, stages) + backward_step(backward)
            forward += 1
            backward += 1
        while forward < micro_batches:
            stream += _forward(forward, k, stages) + backward_step(backward) + weight_step()
            forward += 1
            backward += 1
        while backward < micro_batches:
            stream += backward_step(backward) + weight_step()
            backward += 1
        while weight < micro_batches:
            stream += weight_step()
        streams.append(stream + _finish(k))
    return streams


def render(streams: list[Stream]) -> list[str]:
    """One line per rank in compact text, e.g. ``["F0 sa0 F1 sa1 G0 B0 ...", ...]``.

    An action of a chunk other than its rank's own (interleaved schedules) gets the chunk as a
    suffix: ``F2.3`` is the forward of micro-batch 2 on chunk 3.
    """
    return [" ".join(a.short() if a.stage == rank else f"{a.short()}.{a.stage}" for a in stream)
            for rank, stream in enumerate(streams)]  # fmt: skip


def iter_actions(streams: list[Stream]) -> Iterator[tuple[int, Action]]:
    for rank, stream in enumerate(streams):
        for action in stream:
            yield rank, action
