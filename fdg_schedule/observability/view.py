"""What observers (trackers, tracers) see of an FDG stage: a read-only view, the Observer protocol, micro-batch numbers.

Observers never import the engine: they are handed a :class:`StageView` (the engine is one) and
read what it lists. They must not communicate with other ranks: they run inside the training ticks.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from fdg_schedule.base.config import FDGConfig
from fdg_schedule.runtime.stage_state import StageState
from fdg_schedule.sched.schedule import AdvanceTick


class StageView(Protocol):
    """The engine as observers see it (attributes DeepSpeed's ``PipelineEngine`` and FDG's engine have)."""

    stage_id: int
    num_stages: int
    global_rank: int
    dp_world_size: int
    global_steps: int
    global_samples: int
    fdg_config: FDGConfig
    fdg_stats: dict[str, float]  # counters and "<kind>_s" seconds, see sched.kinds.Kind
    agg_train_loss: Tensor  # what the last train_batch() / drain() returned
    fdg_state: StageState  # read only
    module: Any
    optimizer: Any
    grid: Any  # DeepSpeed's PipelineParallelGrid: data_parallel_id

    def get_lr(self) -> list[float]: ...

    def held_bytes(self) -> int: ...

    def in_flight(self) -> int: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...


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
