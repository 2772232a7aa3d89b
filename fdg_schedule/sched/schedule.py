"""The FDG training schedule: a pure generator of DeepSpeed pipeline instructions, one iterable per tick.

It imports no communication code and needs no process group: ``render(FDGTrainSchedule(...))`` is
the whole plan of one ``train_batch()`` call (or one drain) for one stage. All tick arithmetic
lives in :mod:`fdg_schedule.sched.ticks`; this module only orders the instructions within a tick and
knows how a segment ends (Note [end of data]). Each instruction kind has one letter and one kind of
time, in :data:`OPS`: ``str(instruction)`` gives the compact form (``B3`` backward of micro-batch
3, ``F5`` forward, ``S`` optimizer step, ``X[...]`` exchange) used by golden tests, error
messages and traces, and the kind names ``fdg_stats`` and W&B keys.

Note [end of data]: a segment (the pipeline fills at its tick 0) ends with a drain or when the data
runs out. Stage 0's iterator runs out at micro-batch ``limit`` at tick ``limit``: the handler of
that ``FDGLoad`` calls :meth:`FDGTrainSchedule.end_data`. The same tick's exchange then sends a
dummy activation carrying ``limit`` (``Exchange.send_end``) where micro-batch ``limit`` would have
gone, and stage k learns the end from that dummy at tick ``limit + k``, in the ``WaitActivation``
it had posted for micro-batch ``limit``, and passes it on in that tick's exchange. Each tick's
instructions are produced one at a time and re-read the limit after every instruction, so the rest
of the tick (no forward, the exchange with ``send_end``, ``AdvanceTick(entered=False)``) and the
ticks after it (through the segment's last tick, at which stage 0 back-propagates micro-batch
``limit - 1``; K = 1 learns the end one tick after it) are those of a segment of ``limit``
micro-batches. What ran before the end was learned does not depend on the limit: on a non-last
stage the backward before the load or wait in the same tick is of micro-batch ``limit - 2(K-1-k)``,
never the segment's last (``limit - 1``), so whether the stage steps after it is decided alike; the
last stage's label reads past the end are dropped (Note [labels read when the inputs are]); only
the samples counted at ticks ``limit .. limit + k - 1`` are taken back by the engine.

The one exception is the last stage's final partial accumulation (``accumulate`` > 1, ``limit`` not a
multiple of it, K > 1): the reference steps it right after the backward of micro-batch ``limit - 1``,
at tick ``limit + K - 2``, one tick before the dummy can reach the last stage. That stage read its
labels with stage 0's inputs, so it ran out of them at tick ``limit`` too: when it forwards a
micro-batch after which it holds no labels, the engine calls :meth:`FDGTrainSchedule.end_labels`
and the stage steps after that backward, at the reference's tick and learning rate. (A label
iterator longer than the inputs gives no such sign: then the partial accumulation is not stepped.)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from deepspeed.runtime.pipe.schedule import (
    BufferOpInstruction,
    PipeInstruction,
    PipeSchedule,
    ReduceGrads,
)

from fdg_schedule.runtime.errors import FDGRuntimeError
from fdg_schedule.sched import actions, ticks
from fdg_schedule.sched.actions import Op as ActionOp
from fdg_schedule.sched.kinds import Kind


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


class Exchange(_Short, PipeInstruction):
    """Post this tick's one batched, non-blocking exchange with both neighbours.

    Roughly: ``batch_isend_irecv([activation -> next, gradient + loss -> previous,
    activation <- previous, gradient + loss <- next])`` for the buffers named; the receives are
    waited for by next tick's :class:`WaitGrad` / :class:`WaitActivation`. Each buffer field is the
    buffer of the micro-batch concerned, or None. ``send_end``: instead of an activation, send a
    dummy carrying the segment's number of micro-batches (Note [end of data]).
    """


class AdvanceTick(_Short, PipeInstruction):
    """End the tick: ``global_steps += 1``, samples counted if one entered, and the LR scheduler steps
    once every ``accumulate`` ticks (Note [learning rate per optimizer step])."""


@dataclasses.dataclass(frozen=True)
class Op:
    """How an instruction is named in renders and traces, and what its time counts as (None: not timed)."""

    letter: str
    kind: Kind | None


# The one table of instruction letters and kinds (schedule text, traces, fdg_stats, W&B keys).
OPS: dict[type[PipeInstruction], Op] = {
    FDGLoad: Op("L", Kind.LOAD),
    WaitActivation: Op("A", Kind.WAIT),
    WaitGrad: Op("G", Kind.WAIT),
    FDGForward: Op("F", Kind.FORWARD),
    FDGBackward: Op("B", Kind.BACKWARD),
    ReduceGrads: Op("R", Kind.REDUCE),  # DeepSpeed's: the gradient all-reduce over the stage's data-parallel group
    LocalOptimizerStep: Op("S", Kind.STEP),
    Exchange: Op("X", Kind.EXCHANGE),
    AdvanceTick: Op("T", None),
}

# Exchange fields in its compact text: X[sa,sg,ra,rg,se].
_EXCHANGE_FLAGS = {
    "send_activation": "sa",
    "send_grad": "sg",
    "recv_activation": "ra",
    "recv_grad": "rg",
    "send_end": "se",
}


def short(cmd: PipeInstruction) -> str:
    """The compact text of an instruction: ``F3``, ``R``, ``X[sa,rg]``, ``T+`` (a micro-batch entered)."""
    letter = OPS[type(cmd)].letter
    if isinstance(cmd, Exchange):
        flags = [flag for field, flag in _EXCHANGE_FLAGS.items() if getattr(cmd, field) is not None]
        return f"{letter}[{','.join(flags)}]"
    if isinstance(cmd, AdvanceTick):
        return letter + ("+" if cmd.entered else "")
    micro_batch = getattr(cmd, "micro_batch", None)
    return letter if micro_batch is None else f"{letter}{micro_batch}"


class FDGTrainSchedule(PipeSchedule):
    """The instructions of ``micro_batches`` ticks of FDG for one stage.

    Iterating it yields, per tick, an iterator of that tick's instructions, produced one at a time
    so that :meth:`end_data`, called by a handler in the middle of a tick, shapes the rest
    (Note [end of data]). The engine runs it as DeepSpeed does: ``for cmds in schedule: for cmd in
    cmds: handler(cmd)``.

    Args:
        micro_batches: ticks to run (DeepSpeed's ``gradient_accumulation_steps`` per call).
        stages: number of pipeline stages ``K``.
        stage_id: this stage.
        start_tick: segment tick at which this call starts (ticks since the pipeline last filled).
        accumulate: backward passes per optimizer step.
        drain: run a drain instead: no micro-batch enters, in-flight ones finish.
        limit: the segment has only this many micro-batches, as every stage learned in an earlier
            call (the data ran out): none enters, and the schedule stops at the segment's last tick.
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
    ) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.start_tick = start_tick
        self.accumulate = accumulate
        self.drain = drain
        # During a drain only the micro-batches that already entered stage 0 are processed.
        self.limit: int | None = start_tick if drain else limit
        self.tick: int | None = None  # the tick being produced
        self._learned_at: int | None = None  # the tick at which this stage learned the end of the data
        self._labels_end: int | None = None  # last stage: the micro-batch whose labels ran out (end_labels)

    def num_pipe_buffers(self) -> int:
        return ticks.num_buffers(self.stages, self.stage_id)

    def last_tick(self) -> int | None:
        """The segment tick at which stage 0 back-propagates the segment's last micro-batch (once known)."""
        return None if self.limit is None else ticks.last_tick(self.limit, self.stages)

    def end_data(self, limit: int) -> None:
        """Note [end of data]: the segment has ``limit`` micro-batches; learned during the current tick."""
        expected = None if self.tick is None else self.tick - self.stage_id
        # A drain that started after stage 0's data ran out learns the earlier end on its way down.
        ends_drain_early = self.drain and self.limit is not None and limit < self.limit
        if (self.limit is not None and not ends_drain_early) or limit != expected:
            raise FDGRuntimeError(
                f"stage {self.stage_id}: told at segment tick {self.tick} that the data ended after {limit} "
                f"micro-batches (segment limit so far {self.limit}); stage {self.stage_id} can only learn it at "
                f"tick limit + {self.stage_id}"
            )
        self.limit = limit
        self._learned_at = self.tick

    def end_labels(self, limit: int) -> None:
        """Note [end of data]: the last stage holds no labels for micro-batch ``limit`` (its label iterator ran
        out); told during the forward of micro-batch ``limit - 1``, before its backward."""
        forwarded = None if self.tick is None else ticks.forward_micro_batch(self.tick, self.stage_id)
        if not self.is_last_stage or self.is_first_stage or forwarded is None or limit != forwarded + 1:
            raise FDGRuntimeError(
                f"stage {self.stage_id}: told at segment tick {self.tick} that the labels ran out at micro-batch "
                f"{limit}; only the last stage of K > 1 learns it, in its forward of micro-batch {limit - 1}"
            )
        self._labels_end = limit

    def steps(self) -> Iterator[Iterator[PipeInstruction]]:
        for tick in range(self.start_tick, self.start_tick + self.micro_batches):
            last = self.last_tick()
            if last is not None and tick > last:
                break  # the segment is over (K = 1 learns the end one tick after its last)
            self.tick = tick
            yield self.tick_instructions(tick)
        self.tick = None
        if self.drain and self.stages == 1 and self.limit is not None and self.limit % self.accumulate:
            # K = 1 has no drain ticks: its last backward ran in the last tick, so the partial
            # accumulation is stepped here, before any other tick moves the learning rate.
            yield iter([ReduceGrads(), LocalOptimizerStep()])

    def tick_instructions(self, tick: int) -> Iterator[PipeInstruction]:
        """Everything this stage does at segment tick ``tick``, in order; the limit is re-read after each.

        The compute is :func:`fdg_schedule.sched.actions.fdg_tick`'s, lowered to DeepSpeed instructions: the
        wait for a gradient before each delayed backward, for an activation before each forward, the
        tick's one :class:`Exchange` and :class:`AdvanceTick` at its end. The plan is regenerated after
        each instruction that may learn the end of the data or of the labels (Note [end of data]).
        """
        bwd = ticks.backward_micro_batch(tick, self.stages, self.stage_id, self.limit)
        for action in itertools.takewhile(_before_forward, self._plan(tick)):  # a non-last stage's backward
            if action.op is ActionOp.BACKWARD:
                yield WaitGrad(self._buffer(bwd), micro_batch=bwd)
            yield self._lower(action)
        fwd = self._forward(tick)
        if fwd is not None and not self.is_first_stage:
            yield WaitActivation(self._buffer(fwd), micro_batch=fwd)  # may learn the end
        for load in [action for action in self._plan(tick) if action.op is ActionOp.LOAD]:
            # Note [labels read when the inputs are]: the last stage reads micro-batch t's labels at
            # tick t, with stage 0's inputs, and keeps the K-1 in flight; both iterators stay aligned.
            labels = self.is_last_stage and not self.is_first_stage
            yield FDGLoad(0 if labels else self._buffer(load.micro_batch), micro_batch=load.micro_batch)  # may learn
        if self.stages == 1 and self._learned_at == tick and self.limit is not None and self.limit % self.accumulate:
            # K = 1 learns the end one tick after its last backward: the partial accumulation is
            # stepped now, before this tick's AdvanceTick can move the learning rate.
            yield from [ReduceGrads(), LocalOptimizerStep()]
        plan = self._plan(tick)
        forward = next((action for action in plan if action.op is ActionOp.FORWARD), None)
        if forward is not None:
            yield self._lower(forward)
            plan = self._plan(tick)  # the last stage's forward may have found its labels ended
            yield from (self._lower(action) for action in plan[plan.index(forward) + 1 :])
        yield self._exchange(tick, None if forward is None else forward.micro_batch, bwd)
        yield AdvanceTick(entered=ticks.forward_micro_batch(tick, 0, self.limit) is not None)

    def _forward(self, tick: int) -> int | None:
        return ticks.forward_micro_batch(tick, self.stage_id, self.limit)

    def _plan(self, tick: int) -> list[actions.Action]:
        return actions.fdg_tick(self.stages, self.stage_id, tick, self.accumulate, self.limit, self._labels_end)

    def _lower(self, action: actions.Action) -> PipeInstruction:
        if action.op is ActionOp.FORWARD:
            return FDGForward(self._buffer(action.micro_batch), micro_batch=action.micro_batch)
        if action.op is ActionOp.BACKWARD:
            return FDGBackward(self._buffer(action.micro_batch), micro_batch=action.micro_batch)
        if action.op is ActionOp.ALLREDUCE:
            return ReduceGrads()
        if action.op is ActionOp.STEP:
            return LocalOptimizerStep()
        raise FDGRuntimeError(f"stage {self.stage_id}: the schedule cannot lower action {action}")

    def _exchange(self, tick: int, fwd: int | None, bwd: int | None) -> Exchange:
        # What the neighbours need next tick is exactly what they will forward / back-propagate.
        next_fwd = ticks.forward_micro_batch(tick + 1, self.stage_id, self.limit)
        next_bwd = ticks.backward_micro_batch(tick + 1, self.stages, self.stage_id, self.limit)
        back_propagated = fwd if self.is_last_stage else bwd
        # The next stage posted a receive for micro-batch `limit`: tell it the data ended instead.
        passes_end = not self.is_last_stage and self._learned_at == tick
        return Exchange(
            send_activation=None if self.is_last_stage or fwd is None else self._buffer(fwd),
            send_grad=None if self.is_first_stage or back_propagated is None else self._buffer(back_propagated),
            recv_activation=None if self.is_first_stage or next_fwd is None else self._buffer(next_fwd),
            recv_grad=None if self.is_last_stage or next_bwd is None else self._buffer(next_bwd),
            send_end=self.limit if passes_end else None,
        )

    def _buffer(self, micro_batch: int | None) -> int:
        assert micro_batch is not None
        return micro_batch % self.num_pipe_buffers()


def _before_forward(action: actions.Action) -> bool:
    return action.op not in (ActionOp.LOAD, ActionOp.FORWARD)


def render(schedule: FDGTrainSchedule) -> list[str]:
    """The compact text of each tick, e.g. ``["L0 F0 X[sa] T+", "G0 B0 R S L1 F1 X[sa,rg] T+"]``."""
    return [" ".join(short(cmd) for cmd in step) for step in schedule.steps()]
