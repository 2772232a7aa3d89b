"""What the planner knows about a model: per-layer times and sizes, read from a profile, a trace or an estimate.

The profile is :class:`~fdg_schedule.partitioning.profile_format.ModelProfile`, the one format the profiler
(:mod:`fdg_schedule.partitioning.profile`) writes and the planner reads (its fields:
:mod:`fdg_schedule.partitioning.profile_format`).
Here: the planner's readers of it (a file, a dict), its writer, and a profile from a merged trace.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fdg_schedule.partitioning import profile_format
from fdg_schedule.partitioning.profile_format import DTYPE_BYTES, FORMAT, LayerCost, ModelProfile
from fdg_schedule.sched.kinds import Kind

PROFILE_FORMAT = FORMAT
__all__ = ["DTYPE_BYTES", "PROFILE_FORMAT", "LayerCost", "ModelProfile", "load_profile", "profile_from_dict",
           "profile_from_trace", "profile_to_dict"]  # fmt: skip


def profile_from_dict(data: Any, source: str = "profile") -> ModelProfile:
    """A profile from the profiler's JSON object; a missing or bad field is an error naming ``source``."""
    profile = profile_format.from_dict(data, source)
    return dataclasses.replace(profile, meta={**profile.meta, "source": source})


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile JSON written by the profiler (or by ``python -m fdg_schedule.plan --save-profile``)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"no profile at {path}; pass the JSON the layer profiler wrote")
    profile = profile_format.load(path)
    return dataclasses.replace(profile, meta={**profile.meta, "source": str(path)})


def profile_to_dict(profile: ModelProfile) -> dict[str, Any]:
    """The profiler's JSON form of ``profile``."""
    return profile.to_dict()


def profile_from_trace(
    trace: dict[str, Any],
    activation_bytes: Sequence[float] = (),
    param_bytes: Sequence[float] = (),
    micro_batch: int = 1,
    source: str = "trace",
) -> ModelProfile:
    """One "layer" per traced stage, timed by the medians of its forward, backward and step events.

    A trace (``pipeline.fdg.trace``, merged by ``python -m fdg_schedule.observability.timeline merge``) has times
    but no sizes: ``activation_bytes[k]`` (stage k's output) and ``param_bytes[k]`` default to 0.
    The planner can then re-time that split under other schedules and clusters, but not re-split it.
    """
    ranks = trace.get("otherData", {}).get("ranks")
    if not ranks:
        raise ValueError(f"{source}: no 'otherData.ranks'; merge the per-rank parts with "
                         "`python -m fdg_schedule.observability.timeline merge <dir>` first")  # fmt: skip
    stage_of = {int(rank): int(meta["stage_id"]) for rank, meta in ranks.items()}
    stages = max(stage_of.values()) + 1
    timed = (Kind.FORWARD.value, Kind.BACKWARD.value, Kind.STEP.value)  # the trace's "cat" is the instruction's kind
    kinds: dict[tuple[int, str], list[float]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in timed:
            continue
        key = (stage_of[int(event["pid"])], event["cat"])
        kinds.setdefault(key, []).append(event["dur"] * 1e-6)
    layers = []
    for k in range(stages):
        missing = [kind for kind in timed[:2] if (k, kind) not in kinds]
        if missing:
            raise ValueError(f"{source}: stage {k} has no {missing} events; trace a window of steady ticks")
        median = {kind: statistics.median(kinds.get((k, kind), [0.0])) for kind in timed}
        layers.append(
            LayerCost(
                name=f"stage{k}",
                forward_s=median[Kind.FORWARD.value],
                backward_s=median[Kind.BACKWARD.value],
                recompute_s=median[Kind.FORWARD.value],
                step_s=median[Kind.STEP.value],
                param_bytes=param_bytes[k] if k < len(param_bytes) else 0,
                activation_bytes=activation_bytes[k] if k < len(activation_bytes) else 0,
                saved_bytes=0,
            )
        )
    schedule = trace["otherData"].get("schedule")
    return ModelProfile(
        layers=tuple(layers),
        micro_batch=micro_batch,
        device="trace",
        dtype="float32",
        meta={"source": source, "traced_schedule": schedule, "stages": stages},
    )
