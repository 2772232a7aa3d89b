"""What observers (trackers, tracers) see of an FDG stage: a read-only view, the Observer protocol, micro-batch numbers.

Note [observers see a view]: observers never get the engine nor its ``StageState``. The engine builds a
:class:`StageView` for every call of an observer (after each instruction, at each call's end): a frozen
record of the stage's ids, counters, loss, loss scale, lr, lr factor and held bytes at that moment,
values only, so an observer can neither change the stage nor come to depend on its internals
(``fdg_schedule.runtime.stage_view`` builds it). Observers must not communicate with other ranks:
they run inside the training ticks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torch import Tensor

from fdg_schedule.base.config import FDGConfig
from fdg_schedule.sched.schedule import AdvanceTick


@dataclasses.dataclass(frozen=True)
class StageIds:
    """Where a stage sits in the job: the same at every call."""

    stage_id: int
    num_stages: int
    global_rank: int
    dp_id: int  # the stage's data-parallel replica
    dp_world_size: int

    @classmethod
    def of(cls, engine: Any) -> StageIds:
        """The ids of a DeepSpeed ``PipelineEngine``, FDG's or stock (a 1F1B trace reads them too)."""
        return cls(engine.stage_id, engine.num_stages, engine.global_rank, engine.grid.data_parallel_id,
                   engine.dp_world_size)  # fmt: skip


def _no_grad_norm() -> Tensor | None:
    return None


@dataclasses.dataclass(frozen=True)
class StageView:
    """An FDG stage as observers see it at one call (Note [observers see a view]): values, built per call."""

    ids: StageIds
    config: FDGConfig
    micro_batch_size: int  # train_micro_batch_size_per_gpu
    gradient_accumulation_steps: int
    global_steps: int  # ticks, as DeepSpeed counts its steps
    global_samples: int
    stats: Mapping[str, float]  # a copy of the engine's counters and "<kind>_s" seconds (sched.kinds.Kind)
    loss: Tensor | None  # what the last train_batch() / drain() returned (on the device); None before the first
    last_loss: Tensor | None  # the loss of the call's latest backward (last stage, on the device), else None
    loss_scale: float | None  # fp16: the scale of the stage's last step (Note [loss scale per stage]); else None
    lr: float  # the first param group's
    lr_factor: float | None  # with delay_lr_ticks: the factor of the tick that ran last; else None
    held_bytes: int  # held for delayed backward passes: inputs, saved activations, weight snapshots
    in_flight: int  # micro-batches forwarded but not yet back-propagated
    optimizer_grad_norm: float | Tensor | None  # the norm the optimizer's last step computed (ZeRO), if it keeps one
    grad_norm: Callable[[], Tensor | None] = _no_grad_norm  # the stage's gradients' norm now, unscaled, on request


class Observer(Protocol):
    def on_instruction(self, view: StageView, cmd: Any, start: float, end: float) -> None: ...

    def on_call_end(self, view: StageView, seconds: float) -> None: ...


class MicroBatchNumbers:
    """Run-wide micro-batch numbers from the engine's segment-relative ones.

    FDG instructions number micro-batches from the start of a segment (a ``drain()`` ends one and
    the next ``train_batch()`` starts again at 0). Every stage agrees on which ticks let a
    micro-batch enter (``AdvanceTick.entered``), so counting them gives the same numbering on all
    stages without communication.
    """

    def __init__(self) -> None:
        self.offset = 0  # micro-batches that entered in earlier segments
        self._entered = 0  # ... and in this segment
        self._entered_in_call = False

    def watch(self, cmd: Any) -> None:
        if isinstance(cmd, AdvanceTick) and cmd.entered:
            self._entered += 1
            self._entered_in_call = True

    def end_call(self) -> None:
        # A train_batch() call lets a micro-batch enter at every tick; a drain never does.
        if not self._entered_in_call:
            self.offset += self._entered
            self._entered = 0
        self._entered_in_call = False

    def __call__(self, micro_batch: int) -> int:
        return self.offset + micro_batch
