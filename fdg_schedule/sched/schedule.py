"""The FDG training schedule: a pure generator of DeepSpeed pipeline instructions, one iterable per tick.

It imports no communication code and needs no process group: ``render(FDGTrainSchedule(...))`` is
the whole plan of one ``train_batch()`` call (or one drain) for one stage. All tick arithmetic
lives in :mod:`fdg_schedule.sched.ticks`; this module only orders the instructions within a tick and
knows how a segment ends (Note [end of data]). Each instruction kind has one letter and one kind of
time, in :data:`OPS`: ``str(instruction)`` gives the compact form (``B3`` backward of micro-batch
3, ``F5`` forward, ``S`` optimizer step, ``sg3`` send its input gradient, ``pa6`` post the receive of
micro-batch 6's activation, ``X`` the tick's end of the exchange) used by golden tests, error messages
and traces, and the kind names ``fdg_stats`` and W&B keys. Each message is sent right after the
instruction that made it and each receive posted as soon as the previous one was read (Note [each
message when it exists] in :mod:`fdg_schedule.exchange.comm`); K = 2, stage 0 then stage 1::

    L0 F0 sa0 X T+                 pa0 L0 X T+
    pg0 L1 F1 sa1 X T+             A0 pa1 L1 F0 B0 sg0 R S X T+
    G0 pg1 B0 R S L2 F2 sa2 X T+   A1 pa2 L2 F1 B1 sg1 R S X T+

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

import copy
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
from fdg_schedule.sched.outcomes import DataEnded, LabelsEnded, Outcome


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
    SendActivation: Op("sa", Kind.EXCHANGE),
    SendGrad: Op("sg", Kind.EXCHANGE),
    PostRecvActivation: Op("pa", Kind.EXCHANGE),
    PostRecvGrad: Op("pg", Kind.EXCHANGE),
    Exchange: Op("X", Kind.EXCHANGE),
    AdvanceTick: Op("T", None),
}


def short(cmd: PipeInstruction) -> str:
    """The compact text of an instruction: ``F3``, ``R``, ``sg1``, ``se4`` (the end word where micro-batch 4
    would have gone), ``T+`` (a micro-batch entered)."""
    letter = OPS[type(cmd)].letter
    if isinstance(cmd, SendActivation) and cmd.end:
        return f"se{cmd.micro_batch}"
    if isinstance(cmd, AdvanceTick):
        return letter + ("+" if cmd.entered else "")
    micro_batch = getattr(cmd, "micro_batch", None)
    return letter if micro_batch is None else f"{letter}{micro_batch}"


class FDGTrainSchedule(PipeSchedule):
    """The instructions of ``micro_batches`` ticks of FDG for one stage: a pure function of its arguments.

    Iterating it yields, per tick, that tick's instructions. A schedule is never changed: a stage
    that learns in the middle of a tick that the data ended runs on with :meth:`ended`'s schedule, a
    new one of the shorter segment, from the same instruction (:class:`ScheduleRun` does that for
    the engine and the grid; Note [end of data]). The engine runs it as DeepSpeed does: ``for cmds in
    schedule: for cmd in cmds: handler(cmd)``.

    Args:
        micro_batches: ticks to run (DeepSpeed's ``gradient_accumulation_steps`` per call).
        stages: number of pipeline stages ``K``.
        stage_id: this stage.
        start_tick: segment tick at which this call starts (ticks since the pipeline last filled).
        accumulate: backward passes per optimizer step.
        drain: run a drain instead: no micro-batch enters, in-flight ones finish.
        limit: the segment has only this many micro-batches (the data ran out): none enters after
            them, and the schedule stops at the segment's last tick.
        learned_at: the tick at which this stage learned ``limit`` (None: before this call): that
            tick still holds the load or wait that found the end, and passes the end on.
        labels_end: the last stage holds no labels from this micro-batch on (:meth:`labels_ended`).
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
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.start_tick = start_tick
        self.accumulate = accumulate
        self.drain = drain
        # During a drain only the micro-batches that already entered stage 0 are processed.
        self.limit: int | None = start_tick if drain else limit
        self.learned_at = learned_at
        self.labels_end = labels_end

    def _replace(self, **changes: int | None) -> FDGTrainSchedule:
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    def num_pipe_buffers(self) -> int:
        return ticks.num_buffers(self.stages, self.stage_id)

    def last_tick(self) -> int | None:
        """The segment tick at which stage 0 back-propagates the segment's last micro-batch (once known)."""
        return None if self.limit is None else ticks.last_tick(self.limit, self.stages)

    def ended(self, limit: int, tick: int | None) -> FDGTrainSchedule:
        """Note [end of data]: this schedule for a segment of ``limit`` micro-batches, learned at ``tick``."""
        expected = None if tick is None else tick - self.stage_id
        # A drain that started after stage 0's data ran out learns the earlier end on its way down.
        ends_drain_early = self.drain and self.limit is not None and limit < self.limit
        if (self.learned_at is not None or (self.limit is not None and not ends_drain_early)) or limit != expected:
            raise FDGRuntimeError(
                f"stage {self.stage_id}: told at segment tick {tick} that the data ended after {limit} "
                f"micro-batches (segment limit so far {self.limit}); stage {self.stage_id} can only learn it at "
                f"tick limit + {self.stage_id}"
            )
        return self._replace(limit=limit, learned_at=tick)

    def labels_ended(self, limit: int, tick: int | None) -> FDGTrainSchedule:
        """Note [end of data]: this schedule for a last stage holding no labels for micro-batch ``limit`` (its
        label iterator ran out); learned at ``tick``, in the forward of micro-batch ``limit - 1``."""
        forwarded = None if tick is None else ticks.forward_micro_batch(tick, self.stage_id, self.limit)
        if not self.is_last_stage or self.is_first_stage or forwarded is None or limit != forwarded + 1:
            raise FDGRuntimeError(
                f"stage {self.stage_id}: told at segment tick {tick} that the labels ran out at micro-batch "
                f"{limit}; only the last stage of K > 1 learns it, in its forward of micro-batch {limit - 1}"
            )
        return self._replace(labels_end=limit)

    def steps(self) -> Iterator[Iterator[PipeInstruction]]:
        return ScheduleRun(self).steps()

    def runs(self, tick: int) -> bool:
        """Whether the call runs segment tick ``tick`` (K = 1 learns the end one tick after its last)."""
        last = self.last_tick()
        return self.start_tick <= tick < self.start_tick + self.micro_batches and (last is None or tick <= last)

    def after_ticks(self) -> list[PipeInstruction]:
        """What runs after the call's last tick: K = 1's partial accumulation at the end of a drain."""
        if self.drain and self.stages == 1 and self.limit is not None and self.limit % self.accumulate:
            # K = 1 has no drain ticks: its last backward ran in the last tick, so the partial
            # accumulation is stepped here, before any other tick moves the learning rate.
            return [ReduceGrads(), LocalOptimizerStep()]
        return []

    def tick_instructions(self, tick: int) -> list[PipeInstruction]:
        """Everything this stage does at segment tick ``tick``, in order.

        The compute is :func:`fdg_schedule.sched.actions.fdg_tick`'s, lowered to DeepSpeed instructions with
        each message where it exists (Note [each message when it exists] in fdg_schedule.exchange.comm): the
        wait for a gradient before each delayed backward and its input gradient sent right after it, the wait
        for an activation before each forward and the activation sent right after it; next tick's receives
        posted as soon as this tick's were waited for (at the tick's start where it waits for none); the
        tick's :class:`Exchange` and :class:`AdvanceTick` at its end. At ``learned_at`` the load or wait of
        micro-batch ``limit`` stays where it found the end, and the end is passed on before the tick ends
        (Note [end of data]).
        """
        plan = actions.fdg_tick(self.stages, self.stage_id, tick, self.accumulate, self.limit, self.labels_end)
        bwd = ticks.backward_micro_batch(tick, self.stages, self.stage_id, self.limit)
        fwd = ticks.forward_micro_batch(tick, self.stage_id, self.limit)
        learns_here = self.learned_at == tick and self.limit is not None
        waits_grad = not self.is_last_stage and bwd is not None
        waits_activation = not self.is_first_stage and (fwd is not None or learns_here)
        post_grad, post_activation = self._posts(tick)
        out: list[PipeInstruction] = []
        early = ((post_grad, waits_grad), (post_activation, waits_activation))  # posted where no wait precedes
        out += [post for post, waits in early if post is not None and not waits]
        for action in itertools.takewhile(_before_forward, plan):  # a non-last stage's backward
            if action.op is ActionOp.BACKWARD:
                out += [WaitGrad(self._buffer(bwd), micro_batch=bwd), *([post_grad] if post_grad else [])]
            out += self._lower(action)
        if waits_activation:
            waited = self.limit if fwd is None else fwd
            out.append(WaitActivation(self._buffer(waited), micro_batch=waited))  # learns the end at learned_at
            out += [post_activation] if post_activation else []
        loads = [action.micro_batch for action in plan if action.op is ActionOp.LOAD]
        if self.is_first_stage and learns_here:
            loads.append(self.limit)  # stage 0's iterator was found empty here
        for micro_batch in loads:
            # Note [labels read when the inputs are]: the last stage reads micro-batch t's labels at
            # tick t, with stage 0's inputs, and keeps the K-1 in flight; both iterators stay aligned.
            labels = self.is_last_stage and not self.is_first_stage
            out.append(FDGLoad(0 if labels else self._buffer(micro_batch), micro_batch=micro_batch))
        if self.stages == 1 and learns_here and self.limit is not None and self.limit % self.accumulate:
            # K = 1 learns the end one tick after its last backward: the partial accumulation is
            # stepped now, before this tick's AdvanceTick can move the learning rate.
            out += [ReduceGrads(), LocalOptimizerStep()]
        forward = next((action for action in plan if action.op is ActionOp.FORWARD), None)
        if forward is not None:
            out += [cmd for action in plan[plan.index(forward) :] for cmd in self._lower(action)]
        if learns_here and not self.is_last_stage and self.limit is not None:
            # The next stage posted a receive for micro-batch `limit`: tell it the data ended instead.
            out.append(SendActivation(self._buffer(self.limit), micro_batch=self.limit, end=True))
        out.append(Exchange())
        entered = ticks.forward_micro_batch(tick, 0, self.limit) is not None
        out.append(AdvanceTick(entered=entered, last=self.last_tick() == tick))
        return out

    def _posts(self, tick: int) -> tuple[PostRecvGrad | None, PostRecvActivation | None]:
        """The receives this tick posts for the next: what the stage will back-propagate and forward then."""
        next_bwd = ticks.backward_micro_batch(tick + 1, self.stages, self.stage_id, self.limit)
        next_fwd = ticks.forward_micro_batch(tick + 1, self.stage_id, self.limit)
        grad = (
            None
            if self.is_last_stage or next_bwd is None
            else PostRecvGrad(self._buffer(next_bwd), micro_batch=next_bwd)
        )
        activation = None
        if not self.is_first_stage and next_fwd is not None:
            activation = PostRecvActivation(self._buffer(next_fwd), micro_batch=next_fwd)
        return grad, activation

    def _lower(self, action: actions.Action) -> list[PipeInstruction]:
        """One compute action as instructions: a forward followed by the send of its activation, a backward by
        the send of its input gradient (Note [each message when it exists])."""
        if action.op is ActionOp.FORWARD:
            buffer = self._buffer(action.micro_batch)
            sent = [] if self.is_last_stage else [SendActivation(buffer, micro_batch=action.micro_batch, end=False)]
            return [FDGForward(buffer, micro_batch=action.micro_batch), *sent]
        if action.op is ActionOp.BACKWARD:
            buffer = self._buffer(action.micro_batch)
            sent = [] if self.is_first_stage else [SendGrad(buffer, micro_batch=action.micro_batch)]
            return [FDGBackward(buffer, micro_batch=action.micro_batch), *sent]
        if action.op is ActionOp.ALLREDUCE:
            return [ReduceGrads()]
        if action.op is ActionOp.STEP:
            return [LocalOptimizerStep()]
        raise FDGRuntimeError(f"stage {self.stage_id}: the schedule cannot lower action {action}")

    def _buffer(self, micro_batch: int | None) -> int:
        assert micro_batch is not None
        return micro_batch % self.num_pipe_buffers()


class ScheduleRun:
    """One call's instructions as a stage runs them: a pure :class:`FDGTrainSchedule`, replaced by the schedule
    of the shorter segment when the stage learns the end of the data or of the labels mid-tick.

    After a replacement the tick goes on from the next instruction of the new schedule's tick: the
    instructions already run are, by Note [end of data], that tick's first instructions under the
    new schedule too (checked: a schedule that would rewrite what already ran is an error).
    """

    def __init__(self, schedule: FDGTrainSchedule) -> None:
        self.schedule = schedule
        self.tick: int | None = None  # the tick being run

    def num_pipe_buffers(self) -> int:
        return self.schedule.num_pipe_buffers()

    def last_tick(self) -> int | None:
        return self.schedule.last_tick()

    def end_data(self, limit: int) -> None:
        """The segment has ``limit`` micro-batches; learned during the current tick."""
        self.schedule = self.schedule.ended(limit, self.tick)

    def end_labels(self, limit: int) -> None:
        """The last stage holds no labels for micro-batch ``limit``; learned during the current tick."""
        self.schedule = self.schedule.labels_ended(limit, self.tick)

    def tell(self, outcome: Outcome) -> None:
        """What a handler returned during the current tick (:mod:`fdg_schedule.sched.outcomes`): the run goes on
        with the schedule that follows from it."""
        if isinstance(outcome, DataEnded):
            self.end_data(outcome.limit)
        elif isinstance(outcome, LabelsEnded):
            self.end_labels(outcome.limit)
        else:
            raise FDGRuntimeError(f"stage {self.schedule.stage_id}: the schedule run does not take {outcome!r}")

    def __iter__(self) -> Iterator[Iterator[PipeInstruction]]:
        return self.steps()

    def steps(self) -> Iterator[Iterator[PipeInstruction]]:
        tick = self.schedule.start_tick
        while self.schedule.runs(tick):
            self.tick = tick
            yield self._tick(tick)
            tick += 1
        self.tick = None
        tail = self.schedule.after_ticks()
        if tail:
            yield iter(tail)

    def _tick(self, tick: int) -> Iterator[PipeInstruction]:
        schedule = self.schedule
        planned = schedule.tick_instructions(tick)
        done = 0
        while done < len(planned):
            yield planned[done]
            done += 1
            if self.schedule is not schedule:  # learned an end: the new segment's tick, from here on
                schedule, ran = self.schedule, planned[:done]
                planned = schedule.tick_instructions(tick)
                if [_signature(cmd) for cmd in planned[:done]] != [_signature(cmd) for cmd in ran]:
                    raise FDGRuntimeError(
                        f"stage {schedule.stage_id}: learning the end at tick {tick} would change what already ran "
                        f"({' '.join(map(short, ran))} -> {' '.join(map(short, planned[:done]))})"
                    )


def _signature(cmd: PipeInstruction) -> tuple[type, tuple[tuple[str, object], ...]]:
    return type(cmd), tuple(sorted(cmd.kwargs.items()))


def _before_forward(action: actions.Action) -> bool:
    return action.op not in (ActionOp.LOAD, ActionOp.FORWARD)


def render(schedule: FDGTrainSchedule) -> list[str]:
    """The compact text of each tick, e.g. ``["L0 F0 sa0 X T+", "pg0 L1 F1 sa1 X T+"]``."""
    return [" ".join(short(cmd) for cmd in step) for step in schedule.steps()]
