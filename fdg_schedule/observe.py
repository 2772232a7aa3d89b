"""Hooks through which trackers and tracers watch an FDG engine, built from the config.

The engine calls ``on_instruction`` after every instruction it executes (with ``perf_counter``
start and end times) and ``on_call_end`` after every ``train_batch()`` / ``drain()``. Observers
must not communicate with other ranks: they run inside the training ticks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fdg_schedule.engine import FDGPipelineEngine


class Observer(Protocol):
    def on_instruction(self, engine: FDGPipelineEngine, cmd: Any, start: float, end: float) -> None: ...

    def on_call_end(self, engine: FDGPipelineEngine, seconds: float) -> None: ...


def observers_from_config(engine: FDGPipelineEngine) -> list[Observer]:
    """The observers the engine's config asks for (none yet: tracking and tracing land separately)."""
    return []
