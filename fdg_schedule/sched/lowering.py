"""The one lowering: FDG's compute per tick to every action a stage runs, exchange and ends of data included.

Torch-free. :func:`lower` takes :func:`fdg_schedule.sched.actions.fdg_tick`'s compute and places the exchange
where each message exists (Note [each message when it exists] in fdg_schedule.exchange.comm), the posted
receives, the end of the data passed on (Note [end of data] in :mod:`fdg_schedule.sched.schedule`) and the
tick's end, as ``_add_send_recv`` does in torch's pipelining. Everything else runs exactly this list: the
engine turns each action into its DeepSpeed instruction (:data:`fdg_schedule.sched.schedule.INSTRUCTIONS`),
the grid (:mod:`fdg_schedule.sched.grid`) checks and prints it, the planner
(:mod:`fdg_schedule.plan.streams`) times it. K = 2, stage 0 then stage 1::

    L0 F0 sa0 X T+                 pa0 L0 X T+
    pg0 L1 F1 sa1 X T+             A0 pa1 L1 F0 B0 sg0 R S X T+
    G0 pg1 B0 R S L2 F2 sa2 X T+   A1 pa2 L2 F1 B1 sg1 R S X T+
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.sched import ticks
from fdg_schedule.sched.actions import Action, Op, fdg_tick
from fdg_schedule.sched.outcomes import DataEnded, LabelsEnded, Outcome


class StageSchedule:
    """The actions of ``micro_batches`` ticks of FDG for one stage: a pure function of its arguments.

    A schedule is never changed: a stage that learns in the middle of a tick that the data ended runs on with
    :meth:`ended`'s schedule, a new one of the shorter segment, from the same action (:class:`Run`).

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
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.start_tick = start_tick
        self.accumulate = accumulate
        self.drain = drain
        # During a drain only the micro-batches that already entered stage 0 are processed.
        self.limit: int | None = start_tick if drain else limit
        self.learned_at = learned_at
        self.labels_end = labels_end

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def num_buffers(self) -> int:
        return ticks.num_buffers(self.stages, self.stage_id)

    def last_tick(self) -> int | None:
        """The segment tick at which stage 0 back-propagates the segment's last micro-batch (once known)."""
        return None if self.limit is None else ticks.last_tick(self.limit, self.stages)

    def ends_segment(self, tick: int | None) -> bool:
        """Whether ``tick`` is the segment's last (once known): its tick end (``T``) flushes the tied step (Note
        [tied layers across stages] in fdg_schedule.exchange.tied)."""
        return tick is not None and self.last_tick() == tick

    def _replace(self, **changes: int | None) -> StageSchedule:
        new = copy.copy(self)  # of the same class: an engine's schedule stays one
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    def ended(self, limit: int, tick: int | None) -> StageSchedule:
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

    def labels_ended(self, limit: int, tick: int | None) -> StageSchedule:
        """Note [end of data]: this schedule for a last stage holding no labels for micro-batch ``limit`` (its
        label iterator ran out); learned at ``tick``, in the forward of micro-batch ``limit - 1``."""
        forwarded = None if tick is None else ticks.forward_micro_batch(tick, self.stage_id, self.limit)
        if not self.is_last_stage or self.is_first_stage or forwarded is None or limit != forwarded + 1:
            raise FDGRuntimeError(
                f"stage {self.stage_id}: told at segment tick {tick} that the labels ran out at micro-batch "
                f"{limit}; only the last stage of K > 1 learns it, in its forward of micro-batch {limit - 1}"
            )
        return self._replace(labels_end=limit)

    def runs(self, tick: int) -> bool:
        """Whether the call runs segment tick ``tick`` (K = 1 learns the end one tick after its last)."""
        last = self.last_tick()
        return self.start_tick <= tick < self.start_tick + self.micro_batches and (last is None or tick <= last)

    def tick_actions(self, tick: int) -> list[Action]:
        """Everything this stage does at segment tick ``tick``, in order: :func:`lower`."""
        return lower(self, tick)

    def after_ticks(self) -> list[Action]:
        """What runs after the call's last tick (no tick): K = 1's partial accumulation at the end of a drain."""
        if self.drain and self.stages == 1 and self.limit is not None and self.limit % self.accumulate:
            # K = 1 has no drain ticks: its last backward ran in the last tick, so the partial
            # accumulation is stepped here, before any other tick moves the learning rate.
            return [Action(self.stage_id, Op.ALLREDUCE), Action(self.stage_id, Op.STEP)]
        return []


def lower(schedule: StageSchedule, tick: int) -> list[Action]:
    """Everything ``schedule``'s stage does at segment tick ``tick``, in order: the one lowering.

    The compute is :func:`~fdg_schedule.sched.actions.fdg_tick`'s, with each message where it exists: the wait
    for a gradient (``G``) before each delayed backward and its input gradient sent (``sg``) right after it, the
    wait for an activation (``A``) before each forward and the activation sent (``sa``) right after it; next
    tick's receives posted (``pg``, ``pa``) as soon as this tick's were waited for (at the tick's start where it
    waits for none); the tick's end of the exchange (``X``) and the tick's end (``T``, ``T+``). At ``learned_at``
    the load or wait of micro-batch ``limit`` stays where it found the end, and the end is passed on (``se``)
    before the tick ends (Note [end of data]).
    """
    s, limit = schedule, schedule.limit
    plan = fdg_tick(s.stages, s.stage_id, tick, s.accumulate, limit, s.labels_end)
    bwd = ticks.backward_micro_batch(tick, s.stages, s.stage_id, limit)
    fwd = ticks.forward_micro_batch(tick, s.stage_id, limit)
    learns_here = s.learned_at == tick and limit is not None

    def act(op: Op, micro_batch: int | None = None) -> Action:
        return Action(s.stage_id, op, micro_batch, tick)

    waits_grad = not s.is_last_stage and bwd is not None
    waits_activation = not s.is_first_stage and (fwd is not None or learns_here)
    next_bwd = ticks.backward_micro_batch(tick + 1, s.stages, s.stage_id, limit)
    next_fwd = ticks.forward_micro_batch(tick + 1, s.stage_id, limit)
    post_grad = [] if s.is_last_stage or next_bwd is None else [act(Op.POST_RECV_GRAD, next_bwd)]
    post_activation = [] if s.is_first_stage or next_fwd is None else [act(Op.POST_RECV_ACTIVATION, next_fwd)]
    out: list[Action] = []
    out += post_grad if not waits_grad else []  # posted where no wait precedes
    out += post_activation if not waits_activation else []
    for action in itertools.takewhile(_before_forward, plan):  # a non-last stage's backward
        if action.op is Op.BACKWARD:
            out += [act(Op.RECV_GRAD, bwd), *post_grad]
        out += _with_send(s, action)
    if waits_activation:
        out += [act(Op.RECV_ACTIVATION, limit if fwd is None else fwd), *post_activation]  # the end, at learned_at
    loads = [action.micro_batch for action in plan if action.op is Op.LOAD]
    if s.is_first_stage and learns_here:
        loads.append(limit)  # stage 0's iterator was found empty here
    # Note [labels read when the inputs are]: the last stage reads micro-batch t's labels at tick t, with
    # stage 0's inputs, and keeps the K-1 in flight; both iterators stay aligned.
    out += [act(Op.LOAD, micro_batch) for micro_batch in loads]
    if s.stages == 1 and learns_here and limit is not None and limit % s.accumulate:
        # K = 1 learns the end one tick after its last backward: the partial accumulation is
        # stepped now, before this tick's T can move the learning rate.
        out += [act(Op.ALLREDUCE), act(Op.STEP)]
    forward = next((i for i, action in enumerate(plan) if action.op is Op.FORWARD), None)
    if forward is not None:
        out += [lowered for action in plan[forward:] for lowered in _with_send(s, action)]
    if learns_here and not s.is_last_stage:
        out.append(act(Op.SEND_END, limit))  # the next stage posted a receive for micro-batch `limit`
    entered = ticks.forward_micro_batch(tick, 0, limit) is not None
    return [*out, act(Op.EXCHANGE), act(Op.ADVANCE_ENTERED if entered else Op.ADVANCE)]


def _with_send(schedule: StageSchedule, action: Action) -> list[Action]:
    """A compute action and the message it makes: a forward's activation, a backward's input gradient."""
    if action.op is Op.FORWARD and not schedule.is_last_stage:
        return [action, Action(action.stage, Op.SEND_ACTIVATION, action.micro_batch, action.tick)]
    if action.op is Op.BACKWARD and not schedule.is_first_stage:
        return [action, Action(action.stage, Op.SEND_GRAD, action.micro_batch, action.tick)]
    if action.op in (Op.FORWARD, Op.BACKWARD, Op.ALLREDUCE, Op.STEP):
        return [action]
    raise FDGRuntimeError(f"stage {schedule.stage_id}: the schedule cannot lower action {action}")


def _before_forward(action: Action) -> bool:
    return action.op not in (Op.LOAD, Op.FORWARD)


class Run:
    """One call's actions as a stage runs them: a pure :class:`StageSchedule`, replaced by the schedule of the
    shorter segment when the stage learns the end of the data or of the labels mid-tick.

    After a replacement the tick goes on from the next action of the new schedule's tick: the actions already
    run are, by Note [end of data], that tick's first actions under the new schedule too (checked: a schedule
    that would rewrite what already ran is an error).
    """

    def __init__(self, schedule: StageSchedule) -> None:
        self.schedule = schedule
        self.tick: int | None = None  # the tick being run

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

    def __iter__(self) -> Iterator[Iterator[Action]]:
        tick = self.schedule.start_tick
        while self.schedule.runs(tick):
            self.tick = tick
            yield self._tick(tick)
            tick += 1
        self.tick = None
        tail = self.schedule.after_ticks()
        if tail:
            yield iter(tail)

    def _tick(self, tick: int) -> Iterator[Action]:
        schedule = self.schedule
        planned = schedule.tick_actions(tick)
        done = 0
        while done < len(planned):
            yield planned[done]
            done += 1
            if self.schedule is not schedule:  # learned an end: the new segment's tick, from here on
                schedule, ran = self.schedule, planned[:done]
                planned = schedule.tick_actions(tick)
                if planned[:done] != ran:
                    raise FDGRuntimeError(
                        f"stage {schedule.stage_id}: learning the end at tick {tick} would change what already ran "
                        f"({' '.join(a.short() for a in ran)} -> {' '.join(a.short() for a in planned[:done])})"
                    )


def run_call(schedule: StageSchedule, data_end: int | None = None) -> tuple[list[list[Action]], StageSchedule]:
    """One call of one stage as its engine runs it, learning ``data_end`` where the engine would: stage 0 in the
    load that finds its iterator empty, a later stage in the wait that receives the end in place of the
    activation. The actions of each tick, and the schedule the call ended on (the shorter segment's, if it
    learned the end)."""
    steps = []
    running = Run(schedule)
    for tick in running:
        step: list[Action] = []
        for action in tick:
            step.append(action)
            if data_end is not None and _learns_end(action, schedule, data_end):
                running.tell(DataEnded(data_end))  # what the engine's handler returns there
        steps.append(step)
    return steps, running.schedule


def _learns_end(action: Action, schedule: StageSchedule, data_end: int) -> bool:
    reads_inputs = action.op is Op.LOAD and schedule.is_first_stage
    return (reads_inputs or action.op is Op.RECV_ACTIVATION) and action.micro_batch == data_end
