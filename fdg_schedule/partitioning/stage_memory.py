"""What a pipeline stage holds in memory per schedule: the one model the partitioner and the planner share.

Torch-free. For a stage with layers ``[a, b)``: ``I`` its input per micro-batch (what the previous
stage sends), ``A`` what autograd saves for the backward per micro-batch (parameters excluded,
``saved_bytes`` of :mod:`fdg_schedule.partitioning.profile_format`), ``W`` its parameter bytes. A micro-batch in
flight (forwarded, not yet back-propagated) holds:

    schedule / mode                held per micro-batch          extra while its backward runs
    FDG, activations "stored"      I + A        (+ W "stashed")  0
    FDG, activations "recomputed"  I            (+ W "stashed")  A (the rerun forward's graph)
    FDG, last stage                I + A, freed in the same tick
    1F1B, GPipe, ZB-H1             I + A

and at a tick's end (FDG) or at its peak (the flushing schedules) a stage has this many in flight:

    FDG stage k < K-1       d = 2(K-1-k)  (its delay, :func:`fdg_schedule.sched.ticks.delay`)
    FDG last stage          0 at a tick's end, 1 inside it
    1F1B                    min(K-k, micro_batches)
    GPipe                   micro_batches

so ``held`` (what ``engine.held_bytes()`` reports at a tick's end: stage inputs plus saved
tensors plus weight snapshots, ``fdg_schedule.runtime.stage_state.StageState.held_bytes``) and ``peak``:

    FDG stored        held d(I + A) (+ d W),  peak = held
    FDG recomputed    held d I (+ d W),       peak = held + A
    FDG last stage    held 0,                 peak = I + A
    1F1B              held = peak = n(I + A), n = min(K-k, micro_batches)

Every stage also holds its static bytes (weights, gradients, optimizer state): measured, ``2 W +
optimizer_state_bytes`` (:func:`static_bytes`), or estimated per parameter by the planner
(``CostModel.bytes_per_param``). ``tests/test_pipe_partition.py`` checks ``held`` against real
engines' ``held_bytes()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fdg_schedule.sched import ticks

SCHEDULES = ("fdg", "1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Multipliers of a stage's ``(A, I, W)``: bytes = saved * A + inputs * I + weights * W."""

    saved: int = 0
    inputs: int = 0
    weights: int = 0

    def bytes(self, saved: float, inputs: float, weights: float) -> float:
        return self.saved * saved + self.inputs * inputs + self.weights * weights

    def __mul__(self, count: int) -> Footprint:
        return Footprint(self.saved * count, self.inputs * count, self.weights * count)

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.saved + other.saved, self.inputs + other.inputs, self.weights + other.weights)


@dataclasses.dataclass(frozen=True)
class PerMicroBatch:
    """What one micro-batch in flight holds on a stage, and what its backward adds while it runs."""

    held: Footprint
    backward_extra: Footprint


def per_micro_batch(
    schedule: str, last: bool, activations: str = "stored", weights: str = "current"
) -> PerMicroBatch:  # fmt: skip
    """The held and transient bytes of one micro-batch in flight (the first table of the module docstring)."""
    if schedule != "fdg" or last:
        return PerMicroBatch(Footprint(saved=1, inputs=1), Footprint())
    stash = 1 if weights == "stashed" else 0
    if activations == "recomputed":
        return PerMicroBatch(Footprint(inputs=1, weights=stash), Footprint(saved=1))
    return PerMicroBatch(Footprint(saved=1, inputs=1, weights=stash), Footprint())


def in_flight(schedule: str, stages: int, stage_id: int, micro_batches: int = 1) -> int:
    """Micro-batches stage ``stage_id`` holds at a tick's end (FDG) or at its peak (flushing schedules)."""
    if schedule == "fdg":
        return ticks.delay(stages, stage_id)
    if schedule == "1f1b":
        return min(stages - stage_id, micro_batches)
    if schedule == "gpipe":
        return micro_batches
    raise ValueError(f"unknown schedule {schedule!r}; known: {list(SCHEDULES)}")


def stage_footprint(
    schedule: str,
    stages: int,
    stage_id: int,
    activations: str = "stored",
    weights: str = "current",
    micro_batches: int = 1,
) -> tuple[Footprint, Footprint]:
    """``(peak, held)`` multipliers of stage ``stage_id``'s ``(A, I, W)``, static bytes not included."""
    last = stage_id == stages - 1
    one = per_micro_batch(schedule, last, activations, weights)
    if schedule == "fdg" and last:
        return one.held, Footprint()  # forward and backward in the same tick: nothing held at its end
    held = one.held * in_flight(schedule, stages, stage_id, micro_batches)
    return held + one.backward_extra, held


def static_bytes(param_bytes: Any, optimizer_state_bytes: Any) -> Any:
    """Measured static bytes of a stage (numbers or numpy arrays): weights, their gradients, the optimizer state."""
    return 2 * param_bytes + optimizer_state_bytes
