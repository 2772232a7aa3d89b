"""The FDG training schedule: a pure generator of DeepSpeed pipeline instructions, one iterable per tick.

It imports no communication code and needs no process group: ``render(FDGTrainSchedule(...))`` is
the whole plan of one ``train_batch()`` call (or one drain) for one stage. The schedule is the torch-free
:class:`~fdg_schedule.sched.lowering.StageSchedule` (the tick arithmetic in :mod:`fdg_schedule.sched.ticks`, the
one lowering in :mod:`fdg_schedule.sched.lowering`); this module only gives each of its actions its DeepSpeed
instruction, through one table (:data:`INSTRUCTIONS`, Op -> instruction class), so the engine executes the very
actions the grid prints and the planner times. ``str(instruction)`` is its action's compact text
(:class:`~fdg_schedule.sched.actions.Op`: ``B3`` backward of micro-batch 3, ``F5`` forward, ``S`` optimizer
step, ``sg3`` send its input gradient, ``pa6`` post the receive of micro-batch 6's activation, ``X`` the tick's
end of the exchange), used by golden tests, error messages and traces; its kind names ``fdg_stats`` and W&B keys.
Each message is sent right after the instruction that made it and each receive posted as soon as the previous
one was read (Note [each message when it exists] in :mod:`fdg_schedule.exchange.comm`; K = 2 drawn in
:mod:`fdg_schedule.sched.lowering`).

Note [end of data]: a segment (the pipeline fills at its tick 0) ends with a drain or when the data
runs out. Stage 0's iterator runs out at micro-batch ``limit`` at tick ``limit``: the handler of
that ``FDGLoad`` returns ``DataEnded(limit)`` (:mod:`fdg_schedule.sched.outcomes`), which the dispatch loop
hands to :meth:`ScheduleRun.tell`; the run goes on with a new schedule, the one of a
segment of ``limit`` micro-batches learned at that tick (:meth:`FDGTrainSchedule.ended`; a schedule
is never changed). Before the tick ends the stage sends a dummy activation carrying ``limit``
(``SendActivation(end=True)``, ``se``) where micro-batch ``limit`` would have gone, and stage k learns the end from
that dummy at tick ``limit + k``, in the ``WaitActivation`` it had posted for micro-batch ``limit``,
and passes it on in that tick's exchange. The new schedule's tick begins with the instructions that
already ran (checked), so the rest of the tick (no forward, the end sent on (``se``),
``AdvanceTick(entered=False)``) and the ticks after it (through the segment's last tick, at which
stage 0 back-propagates micro-batch ``limit - 1``; K = 1 learns the end one tick after it) are those
of a segment of ``limit`` micro-batches. What ran before the end was learned does not depend on the limit: on a non-last
stage the backward before the load or wait in the same tick is of micro-batch ``limit - 2(K-1-k)``,
never the segment's last (``limit - 1``), so whether the stage steps after it is decided alike; the
last stage's label reads past the end are dropped (Note [labels read when the inputs are]); only
the samples counted at ticks ``limit .. limit + k - 1`` are taken back by the engine.

The one exception is the last stage's final partial accumulation (``accumulate`` > 1, ``limit`` not a
multiple of it, K > 1): the reference steps it right after the backward of micro-batch ``limit - 1``,
at tick ``limit + K - 2``, one tick before the dummy can reach the last stage. That stage read its
labels with stage 0's inputs, so it ran out of them at tick ``limit`` too: when it forwards a
micro-batch after which it holds no labels, its forward returns ``LabelsEnded(micro_batch + 1)``
and the stage steps after that backward, at the reference's tick and learning rate. (A label
iterator longer than the inputs gives no such sign: then the partial accumulation is not stepped.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.schedule import BufferOpInstruction, PipeInstruction, PipeSchedule, ReduceGrads

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.sched import actions, lowering
from fdg_schedule.sched.actions import Op
from fdg_schedule.sched.kinds import Kind
from fdg_schedule.sched.outcomes import Outcome


class _Short:
    def __str__(self) -> str:
        return short(self)


class FDGForward(_Short, BufferOpInstruction):
    """Forward the micro-batch in ``buffer_id`` and keep what its delayed backward needs.

    Roughly: ``outputs = module(inputs)``, keeping the graph (``activations="stored"``) or only
    the inputs and RNG state (``"recomputed"``), plus a weight snapshot (``weights="stashed"``).
    On the last stage also ``loss = loss_fn(outputs, labels)``.
    """


class FDGBackward(_Short, BufferOpInstruction):
    """Back-propagate the micro-batch in ``buffer_id`` with the gradient the next stage sent.

    Roughly: ``backward(outputs, grad_shrink * received_grad)`` on a non-last stage,
    ``backward(loss / accumulate)`` on the last one; the input gradient is kept for sending.
    """


class FDGLoad(_Short, BufferOpInstruction):
    """Read the next micro-batch from the data iterator (inputs on the first stage, labels on the last).

    Roughly: DeepSpeed's ``LoadMicroBatch``. The last stage reads a micro-batch's labels at the tick
    its inputs enter stage 0 and queues them until its forward, K-1 ticks later. On the first stage
    an empty iterator ends the segment (Note [end of data]).
    """


class WaitActivation(_Short, BufferOpInstruction):
    """Wait for the activation the previous stage sent last tick and put it in ``buffer_id``.

    A dummy activation carrying the end of the data ends the segment instead (Note [end of data]).
    """


class WaitGrad(_Short, BufferOpInstruction):
    """Wait for the gradient (and carried loss) the next stage sent last tick, for ``buffer_id``."""


class LocalOptimizerStep(_Short, PipeInstruction):
    """Step this stage's optimizer with stage-local clipping; no counters, no cross-stage collective."""


class SendActivation(_Short, BufferOpInstruction):
    """Send the activation the forward of ``micro_batch`` just made to the next stage (non-blocking).

    Roughly: ``isend(outputs[buffer_id] -> next)`` with its control word (Note [each message when it
    exists] in fdg_schedule.exchange.comm). ``end``: instead, send a dummy carrying the segment's number of
    micro-batches where micro-batch ``micro_batch`` (= ``limit``) would have gone (Note [end of data]).
    """


class SendGrad(_Short, BufferOpInstruction):
    """Send the input gradient the backward of ``micro_batch`` just made, with its loss, to the previous stage
    (non-blocking): before the all-reduce, the step and the forward that follow in the tick."""


class PostRecvActivation(_Short, BufferOpInstruction):
    """Post the receive of the activation of ``micro_batch``, which next tick's :class:`WaitActivation` reads."""


class PostRecvGrad(_Short, BufferOpInstruction):
    """Post the receive of the gradient of ``micro_batch``, which next tick's :class:`WaitGrad` reads."""


class Exchange(_Short, PipeInstruction):
    """End the tick's exchange: what waits for an activation header (a new shape or shared-memory link) is
    sent and posted after it, the previous tick's sends are waited for, tied gradients go to their owners."""


class AdvanceTick(_Short, PipeInstruction):
    """End the tick: ``global_steps += 1``, samples counted if one ``entered``, and the LR scheduler steps
    once every ``accumulate`` ticks (Note [learning rate per optimizer step]). ``last``: the tick is the
    segment's last (the tied step flushes, Note [tied layers across stages] in fdg_schedule.exchange.tied)."""


# The one table Op -> instruction: each letter the engine runs, as the instruction class its handler takes and the
# fixed arguments that tell two letters of one class apart (sa / se, T / T+). Buffer instructions also take the
# micro-batch's buffer and number, and a tick's end whether its tick is the segment's last (no letter of its own:
# StageSchedule.ends_segment, the lowering's; FDGTrainSchedule.instruction).
INSTRUCTIONS: dict[Op, tuple[type[PipeInstruction], dict[str, bool]]] = {
    Op.LOAD: (FDGLoad, {}),
    Op.RECV_ACTIVATION: (WaitActivation, {}),
    Op.RECV_GRAD: (WaitGrad, {}),
    Op.FORWARD: (FDGForward, {}),
    Op.BACKWARD: (FDGBackward, {}),
    Op.ALLREDUCE: (ReduceGrads, {}),  # DeepSpeed's: the gradient all-reduce over the stage's data-parallel group
    Op.STEP: (LocalOptimizerStep, {}),
    Op.SEND_ACTIVATION: (SendActivation, {"end": False}),
    Op.SEND_END: (SendActivation, {"end": True}),
    Op.SEND_GRAD: (SendGrad, {}),
    Op.POST_RECV_ACTIVATION: (PostRecvActivation, {}),
    Op.POST_RECV_GRAD: (PostRecvGrad, {}),
    Op.EXCHANGE: (Exchange, {}),
    Op.ADVANCE: (AdvanceTick, {"entered": False}),
    Op.ADVANCE_ENTERED: (AdvanceTick, {"entered": True}),
}

# DeepSpeed's own 1F1B instructions in the one alphabet (traces of a stock engine name their events by it).
DEEPSPEED_OPS: dict[type[PipeInstruction], Op] = {
    ds.LoadMicroBatch: Op.LOAD,
    ds.RecvActivation: Op.RECV_ACTIVATION,
    ds.ForwardPass: Op.FORWARD,
    ds.SendActivation: Op.SEND_ACTIVATION,
    ds.RecvGrad: Op.RECV_GRAD,
    ds.BackwardPass: Op.BACKWARD,
    ds.SendGrad: Op.SEND_GRAD,
    ds.ReduceTiedGrads: Op.ALLREDUCE_TIED,
    ds.ReduceGrads: Op.ALLREDUCE,
    ds.OptimizerStep: Op.STEP,
}

# What each instruction class's time counts as (fdg_stats, W&B keys, traces): its letters' kind, read off the table.
KINDS: dict[type[PipeInstruction], Kind | None] = {cls: op.kind for op, (cls, _) in INSTRUCTIONS.items()}
# Each row of the table with whether its instruction takes a buffer (and a micro-batch).
_ROWS = {op: (cls, fixed, issubclass(cls, BufferOpInstruction)) for op, (cls, fixed) in INSTRUCTIONS.items()}
_OPS_OF: dict[type[PipeInstruction], list[tuple[Op, dict[str, bool]]]] = {}
for _op, (_cls, _fixed) in INSTRUCTIONS.items():
    _OPS_OF.setdefault(_cls, []).append((_op, _fixed))


def op_of(cmd: PipeInstruction) -> Op | None:
    """The letter of an FDG instruction or a stock DeepSpeed one (:data:`DEEPSPEED_OPS`); None: neither."""
    for op, fixed in _OPS_OF.get(type(cmd), ()):
        if all(getattr(cmd, key) == value for key, value in fixed.items()):
            return op
    return DEEPSPEED_OPS.get(type(cmd))


def short(cmd: PipeInstruction) -> str:
    """The compact text of an instruction, its action's: ``F3``, ``R``, ``sg1``, ``se4`` (the end word where
    micro-batch 4 would have gone), ``T+`` (a micro-batch entered)."""
    op = op_of(cmd)
    if op is None:
        return type(cmd).__name__
    return actions.short(op, getattr(cmd, "micro_batch", None))


class FDGTrainSchedule(lowering.StageSchedule, PipeSchedule):
    """The instructions of ``micro_batches`` ticks of FDG for one stage: a pure function of its arguments.

    The torch-free :class:`~fdg_schedule.sched.lowering.StageSchedule` (its arguments, its :meth:`ended`
    schedule of a shorter segment) as a DeepSpeed ``PipeSchedule``: iterating it yields, per tick, the
    instructions of that tick's actions (:func:`fdg_schedule.sched.lowering.lower`), one each through
    :data:`INSTRUCTIONS`. The engine runs it as DeepSpeed does: ``for cmds in schedule: for cmd in cmds:
    handler(cmd)``, through :class:`ScheduleRun`, which swaps in the shorter segment's schedule when the stage
    learns that the data ended (Note [end of data]).
    """

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        start_tick: int = 0,
        accumulate: int = 1,
        drain: bool = False,
        limit: int | None = None,
        *,
        learned_at: int | None = None,
        labels_end: int | None = None,
    ) -> None:
        PipeSchedule.__init__(self, micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        lowering.StageSchedule.__init__(
            self, micro_batches, stages, stage_id, start_tick, accumulate, drain, limit,
            learned_at=learned_at, labels_end=labels_end,
        )  # fmt: skip
        self._buffers = self.num_buffers()

    def ended(self, limit: int, tick: int | None) -> FDGTrainSchedule:
        return cast(FDGTrainSchedule, super().ended(limit, tick))

    def labels_ended(self, limit: int, tick: int | None) -> FDGTrainSchedule:
        return cast(FDGTrainSchedule, super().labels_ended(limit, tick))

    def num_pipe_buffers(self) -> int:
        return self.num_buffers()

    def steps(self) -> Iterator[Iterator[PipeInstruction]]:
        return ScheduleRun(self).steps()

    def tick_instructions(self, tick: int) -> list[PipeInstruction]:
        """Everything this stage does at segment tick ``tick``, in order: :func:`~fdg_schedule.sched.lowering.lower`'s
        actions as instructions."""
        return [self.instruction(action) for action in self.tick_actions(tick)]

    def instruction(self, action: actions.Action) -> PipeInstruction:
        """The DeepSpeed instruction that runs ``action`` on this stage (:data:`INSTRUCTIONS`); a micro-batch sits in
        buffer ``micro_batch % num_pipe_buffers()``, except the last stage's labels, read into buffer 0 (Note
        [labels read when the inputs are])."""
        row = _ROWS.get(action.op)
        if row is None:
            raise FDGRuntimeError(f"stage {self.stage_id}: the engine has no instruction for action {action}")
        cls, fixed, buffered = row
        if not buffered:  # a tick's end also says whether the tick is the segment's last (the lowering's)
            return cls(**fixed, last=self.ends_segment(action.tick)) if cls is AdvanceTick else cls(**fixed)
        micro_batch = action.micro_batch
        assert micro_batch is not None, action
        labels = action.op is Op.LOAD and self.stage_id == self.stages - 1 and self.stage_id > 0
        return cls(0 if labels else micro_batch % self._buffers, micro_batch=micro_batch, **fixed)


class ScheduleRun:
    """One call's instructions as a stage runs them: :class:`~fdg_schedule.sched.lowering.Run`'s actions (the
    schedule replaced by the shorter segment's when the stage learns the end of the data or of the labels
    mid-tick), each as its instruction."""

    def __init__(self, schedule: FDGTrainSchedule) -> None:
        self._run = lowering.Run(schedule)

    @property
    def schedule(self) -> FDGTrainSchedule:
        return cast(FDGTrainSchedule, self._run.schedule)

    @property
    def tick(self) -> int | None:
        """The tick being run (None: between ticks, or in K = 1's final partial step)."""
        return self._run.tick

    def num_pipe_buffers(self) -> int:
        return self.schedule.num_pipe_buffers()

    def last_tick(self) -> int | None:
        return self.schedule.last_tick()

    def end_data(self, limit: int) -> None:
        """The segment has ``limit`` micro-batches; learned during the current tick."""
        self._run.end_data(limit)

    def end_labels(self, limit: int) -> None:
        """The last stage holds no labels for micro-batch ``limit``; learned during the current tick."""
        self._run.end_labels(limit)

    def tell(self, outcome: Outcome) -> None:
        """What a handler returned during the current tick (:mod:`fdg_schedule.sched.outcomes`): the run goes on
        with the schedule that follows from it."""
        self._run.tell(outcome)

    def __iter__(self) -> Iterator[Iterator[PipeInstruction]]:
        return self.steps()

    def steps(self) -> Iterator[Iterator[PipeInstruction]]:
        for tick in self._run:
            # an end learned mid-tick changes the segment (the tick that is its last), not the stage's buffers:
            # each action is read with the schedule running when it runs
            yield (self.schedule.instruction(action) for action in tick)


def render(schedule: FDGTrainSchedule) -> list[str]:
    """The compact text of each tick, e.g. ``["L0 F0 sa0 X T+", "pg0 L1 F1 sa1 X T+"]``."""
    return [" ".join(short(cmd) for cmd in step) for step in schedule.steps()]
