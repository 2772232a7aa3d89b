"""Everything a stage carries from one tick to the next, in one place, with its own capture and restore.

The engine's instruction handlers read and write a :class:`StageState`; checkpoints save what
:meth:`StageState.capture` returns and give it back to :meth:`StageState.restore`. Nothing else
keeps work in flight between ticks. Each micro-batch in flight on the stage is one :class:`InFlight`
record (``records[b]``, by the ``buffer_id`` its instructions carry), from the instruction that brings
its inputs to the one that sends its input gradient. What it holds, and how long each piece lives:

    field               written by                  read by                      lives
    tick                AdvanceTick                 the corrections, the meter   the run (t of the corrections)
    corrections.delta   LocalOptimizerStep          FDGForward (prediction)      the run
    segment_tick        AdvanceTick                 the next call's schedule     until the segment ends
    segment_limit       the handler that learns     the next call's schedule     from the end of the data
                        the end of the data                                      to the segment's last tick
    records[b]          FDGLoad / WaitActivation    ... SendGrad (non-first) or  delay ticks
                                                    FDGBackward (first)
      .inputs           FDGLoad / WaitActivation    FDGForward, FDGBackward      to the backward
      .labels           FDGLoad (K = 1)             FDGForward                   within a tick
      .outputs          FDGForward                  SendActivation, FDGBackward  to the send (recomputed) or
                                                                                 the backward (stored)
      .held             FDGForward (non-last)       FDGBackward, checkpoints     delay ticks
      .sent_meta        FDGForward (non-last)       PostRecvGrad                 delay ticks
      .probe            FDGForward (every N ticks)  FDGBackward (the metric)     delay ticks
      .loss             FDGForward (last stage)     FDGBackward                  within a tick
      .received         WaitGrad                    FDGBackward                  within a tick
      .to_send          FDGBackward (non-first)     SendGrad                     within a tick
    labels_in_flight    FDGLoad (last stage)        FDGForward (last stage)      K-1 ticks
    last_prediction     FDGForward (last stage,     FDGBackward (closes it:      within a tick
                        "stashed", predicting)      w back in the parameters)
    call_losses         FDGBackward                 train_batch()'s return       one call
    micro_batches_read  FDGLoad                     checkpoints (data position)  the run
    exchange            Exchange                    WaitActivation / WaitGrad    one tick (next tick's messages)
    tied (P, count,     FDGBackward (contribution)  AdvanceTick (tied step)      the run (Note [tied layers
      tied optimizer)   AdvanceTick (sum, step)                                  across stages] in tied.py)
    scaling (fp16:      LocalOptimizerStep (s_k),   FDGBackward, Exchange,       the run (Note [loss scale per
      s_k, counters,    FDGBackward (the last       LocalOptimizerStep           stage] in loss_scale.py)
      group scale)      stage's group scale)

Only what lives across ticks is captured (a record's probe is not: a measurement is skipped across
a checkpoint); within-tick fields are empty between calls. A new piece of per-stage state (an
optimizer-side tensor, a counter) gets a field here and a line in :meth:`capture` / :meth:`restore`;
a new piece of per-micro-batch state, a field of :class:`InFlight`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from fdg_schedule.base import rng
from fdg_schedule.base.config import FDGConfig
from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.tensors import detached, leaves, nbytes, on_cpu, to_device
from fdg_schedule.corrections.delayed import Held
from fdg_schedule.corrections.staleness import Corrections, StalenessMeter
from fdg_schedule.exchange.comm import Meta, NeighbourExchange
from fdg_schedule.exchange.tied import TiedSync
from fdg_schedule.precision.fp16 import StageScaling
from fdg_schedule.sched import ticks

Message = tuple[tuple[Tensor, ...], Tensor]  # gradients and the loss carried with them


@dataclasses.dataclass
class InFlight:
    """One micro-batch on this stage, from the instruction that brings its inputs to the one that sends its input
    gradient (the table in the module docstring says who writes and reads each field)."""

    inputs: Any = None  # the stage's inputs (a leaf that requires grad where a gradient is sent back)
    labels: Any = None  # K = 1: read with the inputs
    outputs: Any = None  # the forward's outputs: sent on, and back-propagated through when stored
    held: Held | None = None  # what the delayed backward needs (graph or RNG state, weight snapshot)
    sent_meta: Meta | None = None  # the activation's shapes, for the gradient receive
    probe: list[Tensor] | None = None  # the forward's weights, when the staleness meter measures this one
    loss: Tensor | None = None  # last stage: the forward's loss
    received: Message | None = None  # the gradient and loss from the next stage
    to_send: Message | None = None  # the input gradient and loss for the previous stage


class StageState:
    """The in-flight state of one stage (one rank).

    Args:
        stages: number of pipeline stages ``K``.
        exchange: this stage's exchange; it keeps the messages that arrived for the next tick.
        corrections: the stage's staleness corrections (:mod:`fdg_schedule.corrections.staleness`); none by default.
        meter: the stage's staleness metric; off by default.
        tied: the stage's tied-gradient sync (Note [tied layers across stages]); none by default.
        scaling: the stage's fp16 loss scale (:mod:`fdg_schedule.precision.fp16`); None: fp16 off.
    """

    def __init__(
        self,
        stages: int,
        exchange: NeighbourExchange,
        corrections: Corrections | None = None,
        meter: StalenessMeter | None = None,
        tied: TiedSync | None = None,
        scaling: StageScaling | None = None,
    ) -> None:
        self.stages = stages
        self.exchange = exchange
        self.corrections = corrections or Corrections([], stages, stages - 1, FDGConfig())  # off
        self.meter = meter or StalenessMeter([], every=0, delayed=False)
        self.tied = tied if tied is not None else TiedSync([], stages - 1, None)
        self.scaling = scaling if scaling is not None else StageScaling(None, None, exchange, False, False, 1, {})
        self.tick = 0  # ticks since the start of training (fill and drain included): t of the corrections
        self.segment_tick = 0  # ticks since the pipeline last filled (micro-batch 0 of the segment)
        self.segment_limit: int | None = None  # micro-batches in this segment, once the data has ended
        self.records: dict[int, InFlight] = {}  # buffer -> the micro-batch in it
        self.labels_in_flight: collections.deque[Any] = collections.deque()  # last stage, K > 1
        # Note [the last stage's prediction]: under "stashed" the last stage's predicted weights stay in its
        # parameters from its forward through its backward (same tick), so its gradient is taken at w_hat
        self.last_prediction = contextlib.ExitStack()
        self.call_losses: list[Tensor] = []  # losses back-propagated in this call
        self.micro_batches_read = 0  # from the data iterator on this rank (first and last stage)

    def enter(self, buffer_id: int, inputs: Any, labels: Any = None) -> None:
        """A micro-batch's inputs arrived in ``buffer_id`` (loaded or received): its record starts."""
        if buffer_id in self.records:  # the schedule's buffer count guarantees the previous one has left
            raise FDGRuntimeError(
                f"buffer {buffer_id} still holds a micro-batch in flight: the schedule reuses it too early "
                "(a bug; please report it with the stage's log)"
            )
        self.records[buffer_id] = InFlight(inputs=inputs, labels=labels)

    @contextlib.contextmanager
    def predicted_forward(self, keep: Callable[[], bool]) -> Iterator[None]:
        """Around a forward: the parameters hold the predicted weights (Note [predicted weights in place]). When
        ``keep()`` is true at its end (the last stage under "stashed", a forward that produced a loss) they stay
        until the backward closes ``last_prediction`` (Note [the last stage's prediction])."""
        self.last_prediction.close()  # w is back in the parameters, whatever happened in the last tick
        with contextlib.ExitStack() as prediction:
            prediction.enter_context(self.corrections.predicted())
            yield
            if keep():
                self.last_prediction = prediction.pop_all()

    def next_labels(self, micro_batch: int, where: Callable[[], str]) -> Any:
        """The last stage's labels of ``micro_batch`` (K > 1: read with stage 0's inputs, Note [labels read when the
        inputs are]); ``where()`` names the stage in the error when there are none."""
        if not self.labels_in_flight:
            raise FDGRuntimeError(
                f"{where()}: the labels ran out before the inputs, "
                f"at micro-batch {micro_batch} of the segment; first and last stage must read data of equal length"
            )
        return self.labels_in_flight.popleft()

    def in_flight(self) -> int:
        """Micro-batches forwarded but not yet back-propagated."""
        return sum(record.held is not None for record in self.records.values())

    def held_bytes(self) -> int:
        """Bytes held for delayed backward passes: stage inputs, saved activations, weight snapshots."""
        return sum(nbytes(r.inputs) + r.held.nbytes() for r in self.records.values() if r.held is not None)

    def ticks_left(self) -> int:
        """Ticks until the segment's last one, once the data has ended (Note [end of data])."""
        assert self.segment_limit is not None
        return ticks.last_tick(self.segment_limit, self.stages) + 1 - self.segment_tick

    def segment_over(self) -> bool:
        """True once the data has ended and the segment's last tick has run; then start a new segment."""
        if self.segment_limit is None or self.segment_tick <= ticks.last_tick(self.segment_limit, self.stages):
            return False
        self.segment_limit = None
        self.segment_tick = 0
        self.labels_in_flight.clear()  # read past the end when the label iterator is longer
        return True

    def reset(self) -> None:
        """Forget everything carried (before loading a checkpoint): the in-flight work, the tick, delta."""
        self.tick = 0
        self.corrections.reset()
        self.tied.reset()
        self.records.clear()
        self.labels_in_flight.clear()
        self.exchange.restore_received(None)
        self.segment_tick = 0
        self.segment_limit = None

    def capture(self) -> dict[str, Any]:
        """What continues this stage bit for bit in a new process (between ``train_batch()`` calls)."""
        in_flight = {
            buffer_id: {
                "inputs": detached(record.inputs),
                "rng_state": record.held.rng_state,
                "weights": record.held.weights,
                "saved": None if record.held.saved is None else [t.detach() for t in record.held.saved],
                "sent_meta": record.sent_meta,
            }
            for buffer_id, record in self.records.items()
            if record.held is not None
        }
        return {
            "tick": self.tick,
            "delta": self.corrections.capture(),
            "tied": self.tied.capture(),
            "loss_scale": self.scaling.capture(),
            "segment_tick": self.segment_tick,
            "in_flight": in_flight,
            "received": self.exchange.received(),
            "labels_in_flight": list(self.labels_in_flight),
            "micro_batches_read": self.micro_batches_read,
            "segment_limit": self.segment_limit,  # Note [end of data]: known here, maybe not yet downstream
            "rng": rng_state(),
        }

    def restore(
        self,
        saved: dict[str, Any],
        rebuild: Callable[[Held, Any], Any],
        needs_grad: bool,
        device: torch.device | None = None,
    ) -> None:
        """Undo :meth:`capture` in a new process.

        ``saved`` was loaded as :func:`fdg_schedule.checkpointing.checkpoint.load` places it (Note [host tensors stay on
        the host]); the in-flight inputs, held tensors and labels go to ``device`` (where the stage computes;
        None: where they are), RNG states to the CPU, where torch keeps them.

        ``rebuild(held, inputs)`` rebuilds a stored forward's outputs (Note [rebuilding a stored graph]);
        ``needs_grad``: the stage inputs are leaves that require gradients. The RNG state is set last.
        """
        self.reset()
        self.tick = saved.get("tick", 0)  # absent from checkpoints of earlier versions
        self.corrections.restore(saved.get("delta"))
        self.tied.restore(saved.get("tied"))
        self.scaling.restore(saved.get("loss_scale"))
        self.segment_tick = saved["segment_tick"]
        for buffer_id, kept in sorted(saved["in_flight"].items()):
            record = InFlight(inputs=leaves(_on(device, kept["inputs"]), needs_grad), sent_meta=kept["sent_meta"])
            weights, rng_state = _on(device, kept["weights"]), on_cpu(kept["rng_state"])
            record.held = Held(weights=weights, rng_state=rng_state, saved=_on(device, kept["saved"]))
            record.outputs = rebuild(record.held, record.inputs)
            self.records[buffer_id] = record
        self.exchange.restore_received(saved["received"])
        self.labels_in_flight.extend(_on(device, labels) for labels in saved["labels_in_flight"])
        self.micro_batches_read = saved["micro_batches_read"]
        self.segment_limit = saved.get("segment_limit")
        set_rng_state(on_cpu(saved["rng"]))


def _on(device: torch.device | None, x: Any) -> Any:
    """``x`` (a tensor, or tensors in a tuple or list) on ``device``; as it is when ``device`` is None."""
    if device is None or x is None:
        return x
    moved = to_device(x, device)
    return list(moved) if isinstance(x, list) else moved


def rng_state() -> dict[str, Any]:
    """Host and accelerator generator states (:mod:`fdg_schedule.base.rng`), as a checkpoint keeps them."""
    host, device = rng.capture()
    return {"host": host, "device": device}


def set_rng_state(state: dict[str, Any]) -> None:
    if "host" not in state:  # an earlier version of this package wrote {"cpu": ..., "cuda": ...}
        state = {"host": state["cpu"], "device": state.get("cuda")}
    rng.restore((state["host"], state["device"]))
