"""The one schedule alphabet: an action is (stage, op, micro-batch[, tick]), with a text form that round-trips.

Torch-free (standard library and :mod:`fdg_schedule.sched.ticks` / :mod:`~fdg_schedule.sched.kinds` only), so
the planner and any tool can read, write and check schedules without DeepSpeed. Following
torch.distributed.pipelining's ``_Action``, ``str(action)`` is ``<stage><op><micro-batch>[@<tick>]`` and
:meth:`Action.from_str` parses it back: ``1F3@4`` is stage 1 forwarding micro-batch 3 at segment tick 4, ``0S@6``
stage 0's optimizer step, ``2G5`` stage 2 waiting for micro-batch 5's gradient. :meth:`Action.short` drops the
stage and tick (``F3``): a stage's own row, the engine's traces and golden tables.

The one alphabet (:class:`Op`), every letter the engine runs and every letter the planner times::

    L  load a micro-batch (inputs on the first stage, labels on the last)
    A  wait for (receive) an activation        G  wait for (receive) a gradient
    F  forward                 B  backward (input and weight gradients)
    I  input-gradient backward (ZB's "B")         W  weight-gradient backward (ZB's "W")
    R  data-parallel gradient all-reduce          RT  DeepSpeed 1F1B's tied-gradient all-reduce
    S  optimizer step
    sa / sg  send activation / gradient (non-blocking)     se  send the end of the data where an activation would be
    pa / pg  post the receive of next tick's activation / gradient
    X  the tick's end of the exchange             T / T+  the tick's end (+: a micro-batch entered)
    P  a collective over the pipeline's stages (DeepSpeed's per-batch loss broadcast)

Upper case takes the stage's time; lower case only starts a message. FDG's compute is generated from the tick
arithmetic (:func:`fdg_tick`, :func:`fdg_grid`); :mod:`fdg_schedule.sched.lowering` adds the exchange and the
ends of data, and the engine (:data:`fdg_schedule.sched.schedule.INSTRUCTIONS`), the grid and the planner all
run what it gives.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from fdg_schedule.sched import ticks
from fdg_schedule.sched.kinds import Kind


class Op(enum.Enum):
    """One letter per thing a stage does; :attr:`kind` is what its time counts as (None: not timed)."""

    LOAD = "L"
    RECV_ACTIVATION = "A"
    RECV_GRAD = "G"
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    ALLREDUCE = "R"
    ALLREDUCE_TIED = "RT"
    STEP = "S"
    SEND_ACTIVATION = "sa"
    SEND_GRAD = "sg"
    SEND_END = "se"
    POST_RECV_ACTIVATION = "pa"
    POST_RECV_GRAD = "pg"
    EXCHANGE = "X"
    ADVANCE = "T"
    ADVANCE_ENTERED = "T+"
    PIPE_COLLECTIVE = "P"

    @property
    def kind(self) -> Kind | None:
        return _KINDS[self]


_KINDS: dict[Op, Kind | None] = {
    Op.LOAD: Kind.LOAD,
    Op.RECV_ACTIVATION: Kind.WAIT,
    Op.RECV_GRAD: Kind.WAIT,
    Op.FORWARD: Kind.FORWARD,
    Op.BACKWARD: Kind.BACKWARD,
    Op.BACKWARD_INPUT: Kind.BACKWARD,
    Op.BACKWARD_WEIGHT: Kind.BACKWARD,
    Op.ALLREDUCE: Kind.REDUCE,
    Op.ALLREDUCE_TIED: Kind.REDUCE,
    Op.STEP: Kind.STEP,
    Op.SEND_ACTIVATION: Kind.EXCHANGE,
    Op.SEND_GRAD: Kind.EXCHANGE,
    Op.SEND_END: Kind.EXCHANGE,
    Op.POST_RECV_ACTIVATION: Kind.EXCHANGE,
    Op.POST_RECV_GRAD: Kind.EXCHANGE,
    Op.EXCHANGE: Kind.EXCHANGE,
    Op.ADVANCE: None,
    Op.ADVANCE_ENTERED: None,
    Op.PIPE_COLLECTIVE: Kind.WAIT,
}

COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.STEP})
SENDS = frozenset({Op.SEND_ACTIVATION, Op.SEND_GRAD})
RECVS = frozenset({Op.RECV_ACTIVATION, Op.RECV_GRAD})
# Ops about no one micro-batch: their text carries none.
UNNUMBERED = frozenset({Op.ALLREDUCE, Op.ALLREDUCE_TIED, Op.STEP, Op.EXCHANGE, Op.ADVANCE, Op.ADVANCE_ENTERED,
                        Op.PIPE_COLLECTIVE})  # fmt: skip

_TEXT = re.compile(r"(?P<stage>\d+)(?P<op>[A-Za-z]+\+?)(?P<mb>\d*)(?:@(?P<tick>-?\d+))?")


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """What ``stage`` does: ``op`` on ``micro_batch`` (None: not about one), at segment ``tick`` (None: unplaced).

    ``stage`` is a virtual stage where a rank holds several (interleaved 1F1B: stage c runs on rank c % K).
    ``blocking``: a send that waits for its receiver (a rendezvous, as DeepSpeed's 1F1B sends); the planner's
    only, and not part of the text.
    """

    stage: int
    op: Op
    micro_batch: int | None = None
    tick: int | None = None
    blocking: bool = False

    def __str__(self) -> str:
        at = "" if self.tick is None else f"@{self.tick}"
        return f"{self.stage}{self.short()}{at}"

    def short(self) -> str:
        """The op and micro-batch, without stage and tick: ``F3``, ``R``, ``sg1``, ``T+``."""
        return short(self.op, self.micro_batch)

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


def short(op: Op, micro_batch: int | None) -> str:
    """The compact text of ``op`` on ``micro_batch``: ``F3``, ``R``, ``se4``."""
    return op.value if micro_batch is None else f"{op.value}{micro_batch}"


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
_MESSAGE = {Op.SEND_END: Op.SEND_ACTIVATION}  # the end of the data travels as the activation it replaces


def check_messages(grid: list[list[list[Action]]]) -> list[Problem]:
    """Every send of a micro-batch at tick t meets the neighbour's receive of it at tick t + 1, and every receive
    its send: FDG's exchange. ``grid[stage][i]`` holds actions; those placed (``tick`` set) are checked, except
    messages that cross the grid's first or last tick (sent in an earlier call, received in a later one).
    A missing counterpart is reported at the sending tick, in the cell of the stage that misses it."""
    placed = [a for row in grid for cell in row for a in cell if a.tick is not None]
    if not placed:
        return []
    first, last = min(a.tick or 0 for a in placed), max(a.tick or 0 for a in placed)
    receives = {(a.stage, a.op, a.micro_batch, a.tick) for a in placed if a.op in RECVS}
    sends = {
        (a.stage, _MESSAGE.get(a.op, a.op), a.micro_batch, a.tick) for a in placed if a.op in SENDS | {Op.SEND_END}
    }
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
