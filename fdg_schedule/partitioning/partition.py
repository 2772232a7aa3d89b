"""Contiguous pipeline stages that minimise the slowest stage's time, from a layer profile.

A stage's time per micro-batch (``f``, ``b``, ``r``, ``s``: its layers' summed ``forward_s``,
``backward_s``, ``recompute_s``, ``step_s`` from :class:`~fdg_schedule.partitioning.profile.ModelProfile`):

    FDG, stage k < K-1     f + b + s / accumulate   (+ r with activations "recomputed")   per tick
    FDG, last stage        f + b + s / accumulate   (its forward and backward are back to back)
    1F1B, every stage      f + b + s / micro_batches                                    per micro-batch

Both schedules run at the pace of their slowest stage, so the split minimises the largest of these.

Memory per stage, in bytes: :mod:`fdg_schedule.partitioning.stage_memory` (the model the planner uses too), for
example FDG stage k with delay d = 2(K-1-k) holds d(I + A) between ticks with activations "stored"
(``I`` = the stage's input per micro-batch, ``A`` = what autograd saves per micro-batch), plus its
static bytes (weights + gradients + optimizer state, as measured). ``held`` is what
``engine.held_bytes()`` reports at a tick's end. With ``memory_limit`` every stage's peak must fit in it.

Note [the delay-weighted split]: with ``Objective.delay_weight`` alpha > 0 (FDG only) the solver's cost of stage
k is ``(1 + alpha * h_k) * time_k`` (integer picoseconds, rounded once), h_k = 2(K-1-k) / accumulate its delay
in optimizer steps, so a stage whose gradients are older is charged more for each layer and the most delayed
stages come out short. It trades pipeline speed for staleness: the split's bottleneck time can rise. The
predicted times of the result (:func:`evaluate_partition`) are the stages' own, unweighted.

The split itself is :func:`fdg_schedule.partitioning.contiguous_split.solve` (Note [the split solver]), the
solver the planner uses too: times are summed in integer picoseconds, so a stage's time is the
same integer wherever it is computed and the least bottleneck is exact; among the splits with it,
the one whose fastest stage is slowest (the slack spread over the stages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fdg_schedule.partitioning import contiguous_split, stage_memory
from fdg_schedule.partitioning.profile_format import ModelProfile

SCHEDULES = ("fdg", "1f1b")
PICOSECONDS = 10**12


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a split is balanced for: the schedule, its modes, and an optional memory limit per stage."""

    schedule: str = "fdg"
    """``"fdg"`` (time per tick) or ``"1f1b"`` (DeepSpeed's schedule, time per micro-batch)."""
    activations: str = "stored"
    """FDG ``activations``: ``"recomputed"`` adds the extra forward on every stage but the last."""
    weights: str = "current"
    """FDG ``weights``: ``"stashed"`` holds a copy of the stage's weights per micro-batch in flight."""
    accumulate: int = 1
    """FDG backward passes per optimizer step (the step's time is shared by that many ticks)."""
    micro_batches: int = 1
    """1F1B micro-batches per optimizer step and at most in flight (``gradient_accumulation_steps``)."""
    memory_limit: int | None = None
    """Bytes each stage may use at its peak (see the module docstring); None: no limit."""
    delay_weight: float = 0.0
    """alpha >= 0, the split as a staleness correction (FDG; issue 64): the split minimises the largest
    ``(1 + alpha * h_k) * time_k``, h_k = 2(K-1-k) / accumulate, so the most delayed stages get fewer layers
    (Note [the delay-weighted split]). The stages' predicted times stay their times. 0: balance time alone."""

    def __post_init__(self) -> None:
        choices = {"schedule": SCHEDULES, "activations": ("stored", "recomputed"), "weights": ("current", "stashed")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        for name in ("accumulate", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        weight = self.delay_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
            raise ValueError(
                f"delay_weight must be a number >= 0, got {weight!r}; 0 balances time alone, e.g. 0.5 gives the "
                "most delayed stages fewer layers"
            )
        if weight and self.schedule != "fdg":
            raise ValueError(f"delay_weight {weight!r} needs schedule 'fdg' (1F1B has no delay); remove it")
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int) or self.memory_limit <= 0):
            raise ValueError(f"memory_limit must be a positive number of bytes or None, got {self.memory_limit!r}")

    @property
    def recomputes(self) -> bool:
        return self.schedule == "fdg" and self.activations == "recomputed"

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any], memory_limit: int | None = None) -> Objective:
        """The objective a DeepSpeed config trains with: its schedule, FDG modes and accumulation."""
        from fdg_schedule.base import config as fdg_config

        fdg = fdg_config.parse(dict(ds_config))
        micro_batches = int(ds_config.get("gradient_accumulation_steps", 1) or 1)
        if fdg is None:
            return cls(schedule="1f1b", micro_batches=micro_batches, memory_limit=memory_limit)
        return cls(
            schedule="fdg",
            activations=fdg.activations,
            weights=fdg.weights,
            accumulate=fdg.accumulate,
            micro_batches=micro_batches,
            memory_limit=memory_limit,
        )

    def describe(self) -> str:
        if self.schedule == "1f1b":
            text = f"1F1B, {self.micro_batches} micro-batches per step"
        else:
            text = f"FDG, weights {self.weights}, activations {self.activations}"
            text += f", accumulate {self.accumulate}" if self.accumulate > 1 else ""
        if self.delay_weight:
            text += f", delay weight {self.delay_weight:g}"
        if self.memory_limit is not None:
            text += f", memory limit {self.memory_limit / 2**20:.0f} MiB per stage"
        return text


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage of a split: its layers and its predicted time and memory per micro-batch."""

    stage_id: int
    start: int
    stop: int
    time_s: float
    """Predicted time per tick (FDG) or per micro-batch (1F1B): the sum of the four below."""
    forward_s: float
    backward_s: float
    recompute_s: float
    step_s: float
    """The optimizer step's share per micro-batch (its time over accumulate / micro_batches)."""
    held_bytes: int
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class Partition:
    """Stage boundaries ``parts`` (DeepSpeed's form: ``[0, b1, ..., num_layers]``) and their predictions."""

    parts: list[int]
    stages: tuple[StagePlan, ...]
    objective: Objective
    profile: ModelProfile | None = dataclasses.field(default=None, compare=False, repr=False)
    """The profile the predictions come from (for :func:`rescaled`)."""
    own: tuple[bool, ...] | None = None
    """The per-layer constraint :func:`balanced_partition` was given (a rebalanced split keeps it)."""

    @property
    def bottleneck_s(self) -> float:
        return max(stage.time_s for stage in self.stages)

    def describe(self, names: Sequence[str] | None = None) -> Iterable[str]:
        """One line per stage: layers, predicted time (and its parts) and memory."""
        slowest = max(range(len(self.stages)), key=lambda k: self.stages[k].time_s)
        for s in self.stages:
            layers = f"layers {s.start}-{s.stop - 1}" if s.stop - s.start > 1 else f"layer {s.start}"
            if names is not None:
                layers += (
                    f" ({names[s.start]}..{names[s.stop - 1]})" if s.stop - s.start > 1 else f" ({names[s.start]})"
                )
            recompute = f" + recompute {s.recompute_s * 1e3:.2f}" if s.recompute_s else ""
            mark = "  <- slowest" if s.stage_id == slowest else ""
            yield (
                f"stage {s.stage_id}: {layers}: {s.time_s * 1e3:.2f} ms = forward {s.forward_s * 1e3:.2f} + "
                f"backward {s.backward_s * 1e3:.2f}{recompute} + step {s.step_s * 1e3:.2f}; "
                f"held {s.held_bytes / 2**20:.1f} MiB, peak {s.peak_bytes / 2**20:.1f} MiB{mark}"
            )


def balanced_partition(
    profile: ModelProfile, stages: int, objective: Objective | None = None, own: Sequence[bool] | None = None
) -> Partition:
    """The contiguous split of ``profile``'s layers into ``stages`` stages with the smallest bottleneck.

    Exact (Note [the split solver] in :mod:`fdg_schedule.partitioning.contiguous_split`) and deterministic. ``own``,
    per layer: whether it gives a stage trainable parameters of its own; when given, every stage holds
    at least one such layer (FDG steps tied layers apart, so a stage of tied layers only would have an
    empty optimizer). Raises ValueError when there are fewer layers than stages or when no split fits
    ``objective.memory_limit`` (and ``own``).
    """
    objective = objective or Objective()
    costs = _Costs(profile, stages, objective, own)
    n = costs.layers
    if stages < 1 or n < stages:
        raise ValueError(f"cannot cut {n} layers into {stages} stages; use between 1 and {n} stages")
    if own is not None and sum(map(bool, own)) < stages:
        raise ValueError(
            f"cannot cut {n} layers into {stages} stages each holding a layer with parameters of its own: "
            f"{sum(map(bool, own))} such layers (the others are tied or hold no parameters); use fewer stages"
        )
    parts = contiguous_split.solve(n, stages, costs.time_matrix, costs.allowed_matrix)
    if parts is None:
        assert objective.memory_limit is not None  # without a limit every split with a layer of its own is allowed
        raise ValueError(
            f"no split of {n} layers into {stages} stages fits memory_limit {objective.memory_limit} bytes "
            f"({objective.memory_limit / 2**20:.0f} MiB) per stage for {objective.describe()}; raise the limit"
            f" or use more stages{'' if objective.recomputes else ', or FDG activations recomputed'}"
        )
    plan = evaluate_partition(profile, parts, objective)
    return plan if own is None else dataclasses.replace(plan, own=tuple(bool(o) for o in own))


def evaluate_partition(profile: ModelProfile, parts: Sequence[int], objective: Objective | None = None) -> Partition:
    """The predicted time and memory of each stage of any split (e.g. DeepSpeed's "parameters" one)."""
    objective = objective or Objective()
    parts = [int(p) for p in parts]
    n, stages = len(profile.layers), len(parts) - 1
    if stages < 1 or parts[0] != 0 or parts[-1] != n or any(b <= a for a, b in zip(parts, parts[1:])):
        raise ValueError(f"parts {parts} must rise strictly from 0 to {n} (the number of layers)")
    costs = _Costs(profile, stages, objective)
    plans = []
    for k, (start, stop) in enumerate(zip(parts, parts[1:])):
        layers = profile.layers[start:stop]
        share = objective.accumulate if objective.schedule == "fdg" else objective.micro_batches
        time_prefix = costs.time_prefix(k)
        peak, held = costs.memory(k, start, stop)
        plans.append(
            StagePlan(
                stage_id=k,
                start=start,
                stop=stop,
                time_s=int(time_prefix[stop] - time_prefix[start]) / PICOSECONDS,
                forward_s=sum(c.forward_s for c in layers),
                backward_s=sum(c.backward_s for c in layers),
                recompute_s=sum(c.recompute_s for c in layers) if costs.recomputes(k) else 0.0,
                step_s=sum(c.step_s for c in layers) / share,
                held_bytes=held,
                peak_bytes=peak,
            )
        )
    return Partition(parts=parts, stages=tuple(plans), objective=objective, profile=profile)


class _Costs:
    """Integer prefix sums of a profile's per-layer time (picoseconds) and bytes, for one objective."""

    def __init__(
        self, profile: ModelProfile, stages: int, objective: Objective, own: Sequence[bool] | None = None
    ) -> None:
        self.objective = objective
        # per start, the least stop leaving the stage a layer of its own (balanced_partition's ``own``)
        n = len(profile.layers)
        marks = np.ones(n, dtype=bool) if own is None else np.array([bool(o) for o in own], dtype=bool)
        if len(marks) != n:
            raise ValueError(f"own has {len(marks)} entries for {n} layers")
        next_own = np.full(n + 1, n + 1, dtype=np.int64)  # n + 1: no layer of its own from there on
        for i in range(n - 1, -1, -1):
            next_own[i] = i + 1 if marks[i] else next_own[i + 1]
        self.least_stop = next_own
        self.stages = stages
        self.layers = len(profile.layers)
        column = lambda name: np.array([getattr(c, name) for c in profile.layers], dtype=np.float64)  # noqa: E731
        share = objective.accumulate if objective.schedule == "fdg" else objective.micro_batches
        plain = column("forward_s") + column("backward_s") + column("step_s") / share
        self.time_plain = _prefix(np.rint(plain * PICOSECONDS))
        self.time_recompute = _prefix(np.rint((plain + column("recompute_s")) * PICOSECONDS))
        self.time_prefixes = [self.time_prefix(k) for k in range(stages)]
        self.saved = _prefix(column("saved_bytes"))
        self.weights = _prefix(column("param_bytes"))
        self.static = _prefix(stage_memory.static_bytes(column("param_bytes"), column("optimizer_state_bytes")))
        self.inputs = np.array([profile.input_bytes_of(i) for i in range(self.layers)] + [0], dtype=np.int64)

    def recomputes(self, k: int) -> bool:
        return self.objective.recomputes and k < self.stages - 1

    def time_prefix(self, k: int) -> np.ndarray:
        return self.time_recompute if self.recomputes(k) else self.time_plain

    def _coefficients(self, k: int) -> tuple[int, int, int, int, int, int]:
        """Multipliers of (A, I, W) in stage k's peak and in its held bytes (:mod:`~.stage_memory`)."""
        o = self.objective
        peak, held = stage_memory.stage_footprint(o.schedule, self.stages, k, o.activations, o.weights, o.micro_batches)
        return peak.saved, peak.inputs, peak.weights, held.saved, held.inputs, held.weights

    def memory(self, k: int, start: int, stop: int) -> tuple[int, int]:
        """Stage k's (peak, held) bytes when it holds layers ``start:stop``."""
        a, i, w, held_a, held_i, held_w = self._coefficients(k)
        saved = int(self.saved[stop] - self.saved[start])
        weights = int(self.weights[stop] - self.weights[start])
        static = int(self.static[stop] - self.static[start])
        inputs = int(self.inputs[start])
        return a * saved + i * inputs + w * weights + static, held_a * saved + held_i * inputs + held_w * weights

    def time_matrix(self, k: int) -> np.ndarray:
        """Stage k's time in picoseconds for every (start, stop): the solver's cost (Note [the delay-weighted
        split]: weighted by ``1 + alpha * h_k``)."""
        prefix = self.time_prefix(k)
        times = prefix[None, :] - prefix[:, None]
        alpha = self.objective.delay_weight
        if not alpha:
            return times
        h = 2 * (self.stages - 1 - k) / self.objective.accumulate
        return np.rint(times * (1.0 + alpha * h)).astype(np.int64)

    def allowed_matrix(self, k: int) -> np.ndarray:
        """For every (start, stop): stage k then holds a layer of its own and its peak fits the memory limit."""
        allowed = np.arange(self.layers + 1)[None, :] >= self.least_stop[:, None]
        limit = self.objective.memory_limit
        if limit is None:
            return allowed
        a, i, w, *_ = self._coefficients(k)
        grows = a * self.saved + w * self.weights + self.static  # the bytes that grow with the stop
        peak = grows[None, :] - grows[:, None] + (i * self.inputs)[:, None]
        return allowed & (peak <= limit)


def rescaled(profile: ModelProfile, plan: Partition, measured_s: Sequence[float]) -> ModelProfile:
    """``profile`` with each stage's layer times scaled so that ``plan``'s stages predict ``measured_s``.

    Note [rebalancing on measured stage times]: a profile times layers one at a time on an otherwise
    quiet device; in the pipeline every stage shares the machine with the others, and the slowdown
    lands unevenly (on two CPU cores the deep half of a ResNet ran 24 % over its prediction, the
    shallow half 4 %: docs/performance.md). Given the measured compute per micro-batch of each stage
    of a run on ``plan``, every layer of stage k gets its four times multiplied by
    ``measured_s[k] / predicted_k``, so the rescaled profile predicts exactly what was measured for
    that split, and :func:`balanced_partition` on it moves the cut towards the measured balance. A
    layer that changes stage keeps its old stage's factor: one correction is a first-order step, and
    a run on the new split measures again. Sizes are unchanged.
    """
    if len(measured_s) != len(plan.stages):
        raise ValueError(f"measured_s has {len(measured_s)} stage times for a split of {len(plan.stages)} stages")
    if any(not t > 0 for t in measured_s):
        raise ValueError(f"every measured stage time must be > 0 seconds, got {list(measured_s)}")
    layers = list(profile.layers)
    factors = []
    for stage, measured in zip(plan.stages, measured_s):
        factor = measured / stage.time_s if stage.time_s > 0 else 1.0
        factors.append(factor)
        for i in range(stage.start, stage.stop):
            c = layers[i]
            layers[i] = dataclasses.replace(
                c,
                forward_s=c.forward_s * factor,
                backward_s=c.backward_s * factor,
                recompute_s=c.recompute_s * factor,
                step_s=c.step_s * factor,
            )
    meta = {**profile.meta, "rescaled": {"parts": plan.parts, "measured_s": list(measured_s), "factors": factors}}
    return dataclasses.replace(profile, layers=tuple(layers), meta=meta)


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(values.astype(np.int64))])


def parameter_split(profile: ModelProfile, stages: int) -> list[int] | None:
    """The boundaries DeepSpeed's ``partition_method="parameters"`` gives for this model, or None.

    Uses the profile's trainable-parameter counts; None when the profile has none.
    """
    from deepspeed.runtime.utils import partition_balanced

    counts = [c.params for c in profile.layers]
    if not any(counts) or len(counts) < stages:
        return None
    return [int(p) for p in partition_balanced(weights=counts, num_parts=stages)]
