"""Hooks through which trackers and tracers watch an FDG engine, built from the config.

The engine calls ``on_instruction`` after every instruction it executes (with ``perf_counter``
start and end times) and ``on_call_end`` after every ``train_batch()`` / ``drain()``. Observers
must not communicate with other ranks: they run inside the training ticks. What the config can ask
for:

* ``"wandb": {"enabled": true, ...}`` (DeepSpeed's block) → :class:`fdg_schedule.tracking.StageTracker`,
  one W&B run per rank in one group;
* ``"pipeline": {"fdg": {"trace": {...}}}`` → :class:`fdg_schedule.timeline.FDGTimeline`, a
  Chrome/Perfetto trace of a window of ticks, one file per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from fdg_schedule.schedule import AdvanceTick

if TYPE_CHECKING:
    from fdg_schedule.engine import FDGPipelineEngine


class Observer(Protocol):
    def on_instruction(self, engine: FDGPipelineEngine, cmd: Any, start: float, end: float) -> None: ...

    def on_call_end(self, engine: FDGPipelineEngine, seconds: float) -> None: ...


def observers_from_config(engine: FDGPipelineEngine) -> list[Observer]:
    """The observers the engine's config asks for (called once, in the engine's ``__init__``).

    Building the W&B tracker may broadcast a group name from global rank 0 once (init time, every
    rank builds its engine); nothing here communicates after that.
    """
    observers: list[Observer] = []
    ds_config = engine._config._param_dict
    from fdg_schedule import tracking

    if tracking.wandb_block(ds_config) is not None:
        observers.append(tracking.StageTracker(engine))
    if engine.fdg_config.trace is not None:
        from fdg_schedule import timeline

        observers.append(timeline.FDGTimeline(engine, **engine.fdg_config.trace))
    return observers


def before_engine(ds_config: Mapping[str, Any]) -> None:
    """Prepare what must exist before DeepSpeed builds its monitors (W&B mode and group).

    Meant to run on every rank before ``FDGPipelineEngine`` is constructed, so that DeepSpeed's own
    rank-0 W&B run starts offline when nobody is logged in and lands in the stages' group.
    Idempotent; :func:`observers_from_config` calls it too (then too late for DeepSpeed's run).
    """
    from fdg_schedule import tracking

    if tracking.wandb_block(ds_config) is not None:
        tracking.prepare(ds_config)


def close_observers(engine: Any) -> None:
    """Flush and close every observer of ``engine`` (finish W&B runs, write pending traces).

    Optional: both are also closed at interpreter exit. Call it after ``drain()`` when the process
    goes on to do something else.
    """
    for observer in getattr(engine, "observers", []):
        close = getattr(observer, "close", None)
        if close is not None:
            close()


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
