"""The one schedule vocabulary: an action is (stage, op, micro-batch[, tick]), with a text form that round-trips.

Torch-free (standard library and :mod:`fdg_schedule.sched.ticks` only), so the planner and any tool can
read, write and check schedules without DeepSpeed. Following torch.distributed.pipelining's
``_Action``, ``str(action)`` is ``<stage><op><micro-batch>[@<tick>]`` and :meth:`Action.from_str`
parses it back: ``1F3@4`` is stage 1 forwarding micro-batch 3 at segment tick 4, ``0S@6`` stage 0's
optimizer step, ``2rg5`` stage 2 receiving micro-batch 5's gradient.

The one alphabet (:class:`Op`):

    L  load a micro-batch (inputs on the first stage, labels on the last)
    F  forward                 B  backward (input and weight gradients)
    I  input-gradient backward (ZB's "B")         W  weight-gradient backward (ZB's "W")
    R  data-parallel gradient all-reduce          S  optimizer step
    sa / sg  send activation / gradient           ra / rg  receive activation / gradient
    P  a collective over the pipeline's stages (DeepSpeed's per-batch loss broadcast)

FDG's compute is generated from the tick arithmetic for the whole grid (:func:`fdg_tick`,
:func:`fdg_grid`); the exchange (the receives a tick waits for, the sends of what it produced) is
added by a lowering pass, :func:`add_exchange`, as ``_add_send_recv`` does in torch's pipelining.
Every function here is pure: a segment whose data ran out is a new grid with its ``limit``.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from fdg_schedule.sched import ticks


class Op(enum.Enum):
    LOAD = "L"
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

_TEXT = re.compile(r"(?P<stage>\d+)(?P<op>[A-Za-z]+)(?P<mb>\d*)(?:@(?P<tick>-?\d+))?")


@dataclasses.dataclass(frozen=True)
class Action:
    """What ``stage`` does: ``op`` on ``micro_batch`` (None: not about one), at segment ``tick`` (None: unplaced)."""

    stage: int
    op: Op
    micro_batch: int | None = None
    tick: int | None = None

    def __str__(self) -> str:
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        at = "" if self.tick is None else f"@{self.tick}"
        return f"{self.stage}{self.op.value}{mb}{at}"

    @staticmethod
    def from_str(text: str) -> Action:
        """The action whose ``str`` is ``text``."""
        match = _TEXT.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected <stage><op><micro-batch>[@<tick>], e.g. 1F3@4)")
        try:
            op = Op(match["op"])
        except ValueError:
            raise ValueError(f"unknown op {match['op']!r} in {text!r}; ops: {[o.value for o in Op]}") from None
        mb = int(match["mb"]) if match["mb"] else None
        tick = int(match["tick"]) if match["tick"] is not None else None
        return Action(int(match["stage"]), op, mb, tick)


def fdg_tick(
    stages: int,
    stage_id: int,
    tick: int,
    accumulate: int = 1,
    limit: int | None = None,
    labels_end: int | None = None,
) -> list[Action]:
    """FDG's compute at one segment tick of one stage, in order, with no exchange.

    A non-last stage back-propagates its delayed micro-batch (stepping after every ``accumulate``
    backward passes and after the segment's last), then loads (first stage) and forwards the newest;
    the last stage reads the labels of the micro-batch entering stage 0, forwards, and back-propagates
    at once. ``limit``: the segment has that many micro-batches; ``labels_end``: the last stage
    holds no labels from that micro-batch on (Note [end of data] in :mod:`fdg_schedule.sched.schedule`).
    """
    first, last_stage = stage_id == 0, stage_id == stages - 1
    ends = [end for end in (limit, labels_end) if end is not None]
    last_mb = min(ends) - 1 if ends else None

    def backward(mb: int) -> list[Action]:
        out = [Action(stage_id, Op.BACKWARD, mb, tick)]
        if ticks.steps_after_backward(mb, accumulate, last_mb):
            out += [Action(stage_id, Op.ALLREDUCE, None, tick), Action(stage_id, Op.STEP, None, tick)]
        return out

    out: list[Action] = []
    bwd = ticks.backward_micro_batch(tick, stages, stage_id, limit)
    if not last_stage and bwd is not None:
        out += backward(bwd)
    entering = ticks.forward_micro_batch(tick, 0, limit)
    if entering is not None and last_stage and not first:
        out.append(Action(stage_id, Op.LOAD, entering, tick))
    fwd = ticks.forward_micro_batch(tick, stage_id, limit)
    if fwd is not None:
        if first:
            out.append(Action(stage_id, Op.LOAD, fwd, tick))
        out.append(Action(stage_id, Op.FORWARD, fwd, tick))
        if last_stage:
            out += backward(fwd)
    return out


def add_exchange(actions: list[Action], stages: int) -> list[Action]:
    """Lower one stage's tick to what it runs with its neighbours, each message where it exists (Note [each
    message when it exists] in fdg_schedule.exchange.comm): each backward of a non-last stage waits for its
    gradient (``rg``) first and each forward of a non-first stage for its activation (``ra``); the input
    gradient a backward made leaves right after it (``sg``), the activation a forward made right after it
    (``sa``), each a non-blocking send."""
    out: list[Action] = []
    for action in actions:
        first, last_stage = action.stage == 0, action.stage == stages - 1
        if action.op is Op.BACKWARD and not last_stage:
            out.append(dataclasses.replace(action, op=Op.RECV_GRAD))
        if action.op is Op.FORWARD and not first:
            # the wait precedes the last stage's label load of the same tick
            at = next((i for i, a in enumerate(out) if a.op is Op.LOAD and a.tick == action.tick), len(out))
            out.insert(at, dataclasses.replace(action, op=Op.RECV_ACTIVATION))
        out.append(action)
        if action.op is Op.BACKWARD and not first:
            out.append(dataclasses.replace(action, op=Op.SEND_GRAD))
        if action.op is Op.FORWARD and not last_stage:
            out.append(dataclasses.replace(action, op=Op.SEND_ACTIVATION))
    return out


def fdg_grid(
    stages: int, start_tick: int, num_ticks: int, accumulate: int = 1, limit: int | None = None
) -> list[list[list[Action]]]:
    """``grid[stage_id][i]``: the compute of ``stage_id`` at segment tick ``start_tick + i``, every stage
    side by side; a segment with ``limit`` micro-batches stops at its last tick."""
    end = start_tick + num_ticks
    if limit is not None:
        end = min(end, ticks.last_tick(limit, stages) + 1)
    return [
        [fdg_tick(stages, stage_id, tick, accumulate, limit) for tick in range(start_tick, end)]
        for stage_id in range(stages)
    ]


@dataclasses.dataclass(frozen=True)
class Problem:
    """A message without its counterpart: the cell it shows in (``stage`` at ``tick``) and what is wrong."""

    stage: int
    tick: int
    message: str


# A send by stage k at tick t is received (waited for) at tick t + 1 by the neighbour: op, direction, receive, what.
_LINKS = {Op.SEND_ACTIVATION: (1, Op.RECV_ACTIVATION, "an activation"), Op.SEND_GRAD: (-1, Op.RECV_GRAD, "a gradient")}


def check_messages(grid: list[list[list[Action]]]) -> list[Problem]:
    """Every send of a micro-batch at tick t meets the neighbour's receive of it at tick t + 1, and every receive
    its send: FDG's exchange. ``grid[stage][i]`` holds placed actions (``tick`` set); messages that cross the
    grid's first or last tick (sent in an earlier call, received in a later one) are not checked.
    A missing counterpart is reported at the sending tick, in the cell of the stage that misses it."""
    placed = [a for row in grid for cell in row for a in cell]
    if not placed:
        return []
    first, last = min(a.tick or 0 for a in placed), max(a.tick or 0 for a in placed)
    receives = {(a.stage, a.op, a.micro_batch, a.tick) for a in placed if a.op in RECVS}
    sends = {(a.stage, a.op, a.micro_batch, a.tick) for a in placed if a.op in SENDS}
    problems = []
    for stage, op, mb, tick in sorted(sends, key=lambda s: (s[3], s[0], s[1].value)):
        step, recv, what = _LINKS[op]
        peer = stage + step
        if tick is not None and tick < last and (peer, recv, mb, tick + 1) not in receives:
            missing = f"{stage}{op.value}{mb}@{tick} without {peer}{recv.value}{mb}@{tick + 1}"
            problems.append(
                Problem(stage, tick, f"stage {stage} sends {what} stage {peer} does not receive ({missing})")
            )
    for stage, op, mb, tick in sorted(receives, key=lambda r: (r[3], r[0], r[1].value)):
        send = Op.SEND_ACTIVATION if op is Op.RECV_ACTIVATION else Op.SEND_GRAD
        step, _, what = _LINKS[send]
        peer = stage - step
        if tick is not None and tick > first and (peer, send, mb, tick - 1) not in sends:
            missing = f"{stage}{op.value}{mb}@{tick} without {peer}{send.value}{mb}@{tick - 1}"
            problems.append(
                Problem(stage, tick - 1, f"stage {stage} receives {what} stage {peer} does not send ({missing})")
            )
    return problems


def render(grid: list[list[list[Action]]]) -> str:
    """The grid as text, one line per tick, one column per stage (``str`` of each action)."""
    lines = []
    for i in range(max((len(row) for row in grid), default=0)):
        cells = [" ".join(str(a) for a in row[i]) if i < len(row) else "" for row in grid]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def parse(text: str) -> list[list[list[Action]]]:
    """The grid whose :func:`render` is ``text``."""
    rows = [line.split(" | ") for line in text.splitlines()]
    stages = max((len(r) for r in rows), default=0)
    return [[[Action.from_str(t) for t in r[k].split()] for r in rows if k < len(r)] for k in range(stages)]
