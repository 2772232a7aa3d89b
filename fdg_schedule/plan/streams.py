"""Per-rank instruction streams of every schedule the planner compares, as plain action lists.

FDG's stream is translated from the engine's own generator (:class:`fdg_schedule.sched.schedule.FDGTrainSchedule`)
and DeepSpeed's 1F1B from ``deepspeed.runtime.pipe.schedule.TrainSchedule``: the planner times what
the engines execute. GPipe, interleaved 1F1B and ZB-H1 are written here from their papers' orderings.

An action's compact text (torch pipelining's style) is ``<op><micro-batch>`` with a chunk suffix
for interleaved schedules (``F3``, ``B0.1`` = backward of micro-batch 0 on chunk 1):

    F  forward                 B  backward (input and weight gradients)
    I  input-gradient backward (ZB's "B")         W  weight-gradient backward (ZB's "W")
    sa / sg  send activation / gradient           ra / rg  receive activation / gradient
    R  data-parallel gradient all-reduce          S  optimizer step
    P  a collective over the pipeline's stages (DeepSpeed's per-batch loss broadcast)

Chunks are virtual stages: with ``v`` chunks per rank (interleaved 1F1B) the model is cut into
``K * v`` pieces and chunk ``c`` runs on rank ``c % K``; otherwise chunk = stage = rank.
Sends are non-blocking unless ``blocking`` (then the sender waits for the receiver: a rendezvous).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator

from deepspeed.runtime.pipe import schedule as ds

from fdg_schedule.sched import schedule as fdg
from fdg_schedule.sched.schedule import FDGTrainSchedule


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACTIVATION = "sa"
    SEND_GRAD = "sg"
    RECV_ACTIVATION = "ra"
    RECV_GRAD = "rg"
    ALLREDUCE = "R"
    STEP = "S"
    PIPE_COLLECTIVE = "P"


COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.STEP})
SENDS = frozenset({Op.SEND_ACTIVATION, Op.SEND_GRAD})
RECVS = frozenset({Op.RECV_ACTIVATION, Op.RECV_GRAD})


@dataclasses.dataclass(frozen=True)
class Action:
    """One thing a rank does; ``chunk`` is the virtual stage it concerns."""

    op: Op
    micro_batch: int | None = None
    chunk: int = 0
    blocking: bool = False  # sends only: wait for the matching receive

    def __str__(self) -> str:
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{self.op.value}{mb}"


Stream = list[Action]


# ---------------------------------------------------------------------------------------------------
# FDG: from the engine's generator


def fdg_streams(stages: int, micro_batches: int, accumulate: int = 1, drain: bool = True) -> list[Stream]:
    """Every stage's actions for a segment of ``micro_batches`` FDG ticks (then a drain).

    Translated instruction by instruction from ``FDGTrainSchedule(...).steps()``: ``WaitGrad`` /
    ``WaitActivation`` become receives, the tick's ``Exchange`` becomes the non-blocking sends of
    what this tick produced (so a gradient leaves only after the tick's forward, as in the engine),
    ``ReduceGrads`` the all-reduce, ``LocalOptimizerStep`` the step. Loads and tick ends cost nothing.
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
            stream.append(Action(Op.PIPE_COLLECTIVE, None, stage))
        out.append(stream)
    return out


def _fdg_ticks(stages: int, stage: int, micro_batches: int, accumulate: int, drain: bool) -> Iterator[Stream]:
    calls = [FDGTrainSchedule(micro_batches, stages, stage, accumulate=accumulate)]
    if drain and stages > 1:
        calls.append(FDGTrainSchedule(2 * (stages - 1), stages, stage, micro_batches, accumulate, drain=True))
    for schedule in calls:
        for tick in schedule.steps():  # each tick is produced lazily; _fdg_tick reads it once
            yield _fdg_tick(tick, stage)


# FDG instruction -> planner action; the schedule's loads and tick ends cost nothing here.
_FDG_OPS: dict[type[ds.PipeInstruction], Op | None] = {
    fdg.WaitGrad: Op.RECV_GRAD,
    fdg.WaitActivation: Op.RECV_ACTIVATION,
    fdg.FDGForward: Op.FORWARD,
    fdg.FDGBackward: Op.BACKWARD,
    ds.ReduceGrads: Op.ALLREDUCE,
    fdg.LocalOptimizerStep: Op.STEP,
    fdg.FDGLoad: None,
    fdg.AdvanceTick: None,
}


def _fdg_tick(tick: Iterable[ds.PipeInstruction], stage: int) -> Stream:
    out: Stream = []
    forwarded = backpropagated = None
    for cmd in tick:
        if isinstance(cmd, fdg.Exchange):
            # the non-blocking sends of what this tick produced (a gradient leaves after the forward)
            if cmd.send_activation is not None:
                out.append(Action(Op.SEND_ACTIVATION, forwarded, stage))
            if cmd.send_grad is not None:
                out.append(Action(Op.SEND_GRAD, backpropagated, stage))
            continue
        if type(cmd) not in _FDG_OPS:
            raise ValueError(f"the planner does not know FDG instruction {type(cmd).__name__}; teach plan/streams.py")
        op = _FDG_OPS[type(cmd)]
        if op is None:
            continue
        micro_batch = getattr(cmd, "micro_batch", None)
        out.append(Action(op, micro_batch, stage))
        if op is Op.FORWARD:
            forwarded = micro_batch
        elif op is Op.BACKWARD:
            backpropagated = micro_batch
    return out


# ---------------------------------------------------------------------------------------------------
# DeepSpeed 1F1B: from DeepSpeed's generator

_DS_OPS = {
    ds.RecvActivation: Op.RECV_ACTIVATION,
    ds.SendActivation: Op.SEND_ACTIVATION,
    ds.ForwardPass: Op.FORWARD,
    ds.RecvGrad: Op.RECV_GRAD,
    ds.SendGrad: Op.SEND_GRAD,
    ds.BackwardPass: Op.BACKWARD,
    ds.ReduceGrads: Op.ALLREDUCE,
    ds.OptimizerStep: Op.STEP,
}


def deepspeed_1f1b_streams(stages: int, micro_batches: int) -> list[Stream]:
    """Every stage's actions for one ``train_batch()`` of DeepSpeed's ``TrainSchedule``.

    DeepSpeed's instructions carry buffer ids, not micro-batch numbers; on a stage the forward-side
    instructions come in micro-batch order and so do the backward-side ones, so counting each kind
    numbers them. Its ``p2p.send``/``recv`` are blocking (a rendezvous). ``train_batch`` ends with
    the loss broadcast over the pipeline (``_aggregate_total_loss``): every stage waits for the last.
    """
    streams = []
    for stage in range(stages):
        seen: dict[Op, int] = {}
        stream: Stream = []
        for step in ds.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage).steps():
            for cmd in step:
                op = _DS_OPS.get(type(cmd))
                if op is None:
                    if isinstance(cmd, (ds.LoadMicroBatch, ds.ReduceTiedGrads)):
                        continue
                    raise ValueError(f"the planner does not know DeepSpeed instruction {cmd}; teach plan/streams.py")
                if op in (Op.ALLREDUCE, Op.STEP):
                    stream.append(Action(op, None, stage))
                    continue
                number = seen.get(op, 0)
                seen[op] = number + 1
                stream.append(Action(op, number, stage, blocking=op in SENDS))
        stream.append(Action(Op.PIPE_COLLECTIVE, None, stage))
        streams.append(stream)
    return streams


# ---------------------------------------------------------------------------------------------------
# Published orderings


def _forward(mb: int, chunk: int, chunks: int) -> Stream:
    """Receive the input (unless the first chunk), forward, send the output (unless the last)."""
    out = [] if chunk == 0 else [Action(Op.RECV_ACTIVATION, mb, chunk)]
    out.append(Action(Op.FORWARD, mb, chunk))
    return out + ([] if chunk == chunks - 1 else [Action(Op.SEND_ACTIVATION, mb, chunk)])


def _backward(mb: int, chunk: int, chunks: int, op: Op = Op.BACKWARD) -> Stream:
    """Receive the output gradient (unless the last chunk), back-propagate, send the input gradient."""
    out = [] if chunk == chunks - 1 else [Action(Op.RECV_GRAD, mb, chunk)]
    out.append(Action(op, mb, chunk))
    return out + ([] if chunk == 0 else [Action(Op.SEND_GRAD, mb, chunk)])


def _finish(stage: int) -> Stream:
    """End of a batch: all-reduce, step, and the cross-stage collective (grad-norm / loss report)."""
    return [Action(Op.ALLREDUCE, None, stage), Action(Op.STEP, None, stage), Action(Op.PIPE_COLLECTIVE, None, stage)]


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
            return [] if first else [Action(Op.BACKWARD_WEIGHT, weight - 1, k)]

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
    """One line per rank in compact text, e.g. ``["F0 sa0 F1 sa1 rg0 B0 ...", ...]``.

    An action of a chunk other than its rank's own (interleaved schedules) gets the chunk as a
    suffix: ``F2.3`` is the forward of micro-batch 2 on chunk 3.
    """
    return [" ".join(str(a) if a.chunk == rank else f"{a}.{a.chunk}" for a in stream)
            for rank, stream in enumerate(streams)]  # fmt: skip


def iter_actions(streams: list[Stream]) -> Iterator[tuple[int, Action]]:
    for rank, stream in enumerate(streams):
        for action in stream:
            yield rank, action
