"""The observers an FDG engine's config asks for: built once per engine, closed on request.

The engine calls ``on_instruction`` after every instruction it executes (with ``perf_counter``
start and end times) and ``on_call_end`` after every ``train_batch()`` / ``drain()``, handing each
observer a :class:`~fdg_schedule.observability.view.StageView` built for that call (Note [observers see a
view]). What the config can ask for:

* ``"wandb": {"enabled": true, ...}`` (DeepSpeed's block) → :class:`fdg_schedule.observability.tracking.StageTracker`,
  one W&B run per rank in one group;
* ``"pipeline": {"fdg": {"trace": {...}}}`` → :class:`fdg_schedule.observability.timeline.FDGTimeline`, a
  Chrome/Perfetto trace of a window of ticks, one file per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fdg_schedule.observability import timeline, tracking
from fdg_schedule.observability.view import Observer, StageView


def observers_from_config(view: StageView, ds_config: Mapping[str, Any]) -> list[Observer]:
    """The observers ``ds_config`` asks for (called once, in the engine's ``__init__``).

    Building the W&B tracker may broadcast a group name from global rank 0 once (init time, every
    rank builds its engine); nothing here communicates after that.
    """
    observers: list[Observer] = []
    if tracking.wandb_block(ds_config) is not None:
        observers.append(tracking.StageTracker(view, ds_config))
    if view.config.trace is not None:
        observers.append(timeline.FDGTimeline(view, **view.config.trace))
    return observers


def before_engine(ds_config: Mapping[str, Any]) -> None:
    """Prepare what must exist before DeepSpeed builds its monitors (W&B mode and group).

    Meant to run on every rank before ``FDGPipelineEngine`` is constructed, so that DeepSpeed's own
    rank-0 W&B run starts offline when nobody is logged in and lands in the stages' group.
    Idempotent; :func:`observers_from_config` calls it too (then too late for DeepSpeed's run).
    """
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
