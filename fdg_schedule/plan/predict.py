"""From a profile, a schedule, K and a cluster to predicted step time, throughput, idle time, memory and traffic.

:func:`predict` cuts the layers (:mod:`fdg_schedule.plan.split`), turns each stage's layers into
action costs (:func:`chunk_costs`), builds the schedule's per-rank streams
(:mod:`fdg_schedule.plan.streams`) and simulates them (:mod:`fdg_schedule.plan.simulate`).

What a stage costs per micro-batch, with ``f, b, r, s`` its layers' forward, backward, recompute and
step seconds, ``A`` what autograd saves, ``I`` its input and ``W`` its parameter bytes:

    schedule                   forward   backward          held per micro-batch in flight
    FDG stored                 f         b                 I + A        (+ W if stashed)
    FDG recomputed             r         f + b             I (+ A while its backward runs) (+ W)
    FDG, last stage            f         b                 I + A, freed in the same tick
    1F1B, GPipe, interleaved   f         b                 I + A
    ZB-H1                      f         I: q b, W: (1-q) b  I + A; I frees all but w A, W the rest

(held bytes: :mod:`fdg_schedule.partitioning.stage_memory`, the model the partitioner uses too; the stage's input
is held with each micro-batch in flight, as ``engine.held_bytes()`` counts it).
``"stashed"`` also copies W at each forward and twice at each backward (in and out of the
parameters) at ``copy_bandwidth``. Every stage also holds ``bytes_per_param`` per parameter
(weights, gradients, optimizer state). Steady state: FDG is simulated for a long segment and timed
over a window of whole accumulation periods after the fill; the others flush, so one batch is timed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from fdg_schedule.partitioning import stage_memory as memory_model
from fdg_schedule.plan import streams as st
from fdg_schedule.plan.cluster import Cluster, Placement
from fdg_schedule.plan.costs import ModelProfile
from fdg_schedule.plan.simulate import ChunkCosts, Link, Timeline, simulate
from fdg_schedule.plan.split import best_split

SCHEDULES = ("fdg", "1f1b", "gpipe", "interleaved", "zbh1")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A schedule and its settings."""

    schedule: str
    """``"fdg"``, ``"1f1b"`` (DeepSpeed's), ``"gpipe"``, ``"interleaved"`` or ``"zbh1"``."""
    weights: str = "current"
    """FDG: ``"current"`` or ``"stashed"``."""
    activations: str = "stored"
    """FDG: ``"stored"`` or ``"recomputed"``."""
    accumulate: int | None = 1
    """FDG: backward passes per optimizer step; None = as many as the flushing schedules' micro-batches."""
    chunks: int = 2
    """Interleaved 1F1B: model chunks per rank."""
    threads: bool = False
    """FDG as the authors' code runs it: one process, a thread per stage, a join and serial copies per tick."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {list(SCHEDULES)}")
        if self.weights not in ("current", "stashed") or self.activations not in ("stored", "recomputed"):
            raise ValueError(f"FDG modes are weights current/stashed and activations stored/recomputed, got "
                             f"{self.weights}/{self.activations}")  # fmt: skip
        if self.accumulate is not None and self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 or None, got {self.accumulate}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")

    @property
    def name(self) -> str:
        if self.schedule == "fdg":
            acc = "" if self.accumulate == 1 else " acc=m" if self.accumulate is None else f" acc={self.accumulate}"
            return f"fdg {self.weights}/{self.activations}{acc}{' threads' if self.threads else ''}"
        if self.schedule == "interleaved":
            return f"interleaved v={self.chunks}"
        return {"1f1b": "deepspeed 1f1b", "gpipe": "gpipe", "zbh1": "zb-h1"}[self.schedule]


def default_variants() -> list[Variant]:
    """What the planner compares unless told otherwise: FDG's four modes with and without accumulation, the rest."""
    out = [
        Variant("fdg", w, a, acc) for acc in (1, None) for w in ("current", "stashed") for a in ("stored", "recomputed")
    ]
    return out + [Variant("1f1b"), Variant("gpipe"), Variant("interleaved"), Variant("zbh1")]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """How profile numbers become action costs; every figure here is an assumption the report states."""

    bytes_per_param: float = 16.0
    """Static memory per parameter: weights, gradients, optimizer state (16 = Adam in mixed precision)."""
    input_fraction: float = 0.5
    """ZB-H1: share of a backward that is the input gradient (the rest is the weight gradient)."""
    weight_grad_fraction: float = 0.4
    """ZB-H1: share of the saved activations the weight gradient still needs after the input gradient
    (the inputs of the matrix products: 14 of a transformer layer's 34 s b h bytes, Korthikanti et al.)."""
    copy_bandwidth: float = 1e12
    """Bytes/s of the weight copies of ``weights: "stashed"`` (device memory bandwidth)."""
    overhead_s: float = 0.0
    """Framework time per forward and per backward (Python dispatch, kernel launches)."""
    tick_overhead_s: float = 0.0
    """FDG: framework time per tick outside forward and backward (posting the exchange, bookkeeping)."""
    host_s_per_layer: float = 0.0
    """Host time per layer per compute action; with ``shared_host`` all stages share one host thread."""
    shared_host: bool = False


@dataclasses.dataclass
class Prediction:
    """What one (schedule, K) is predicted to do on the cluster."""

    variant: Variant
    stages: int
    dp: int
    micro_batches: int  # per batch (flushing schedules) / per accumulation window
    bounds: list[int]
    time_per_micro_batch_s: float
    step_s: float  # optimizer step period: a batch (flushing schedules), accumulate ticks (FDG)
    samples_per_s: float
    idle_fraction: float
    memory_bytes: list[float]  # per stage (rank): static + peak held
    held_bytes: list[float]
    p2p_bytes_per_micro_batch: float  # one pipeline replica, all boundaries, both directions
    inter_node_bytes_per_micro_batch: float
    allreduce_bytes_per_micro_batch: float  # per rank, what its ring all-reduce sends
    fits: bool
    timeline: Timeline | None = None

    @property
    def tick_s(self) -> float:
        return self.time_per_micro_batch_s

    @property
    def peak_memory(self) -> float:
        return max(self.memory_bytes)

    @property
    def gpus(self) -> int:
        return self.stages * self.dp

    def row(self) -> dict[str, Any]:
        return {
            "schedule": self.variant.name,
            "K": self.stages,
            "dp": self.dp,
            "gpus": self.gpus,
            "split": self.bounds,
            "time_per_micro_batch_s": self.time_per_micro_batch_s,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "idle_fraction": self.idle_fraction,
            "memory_bytes": self.memory_bytes,
            "peak_memory_bytes": self.peak_memory,
            "fits": self.fits,
            "p2p_bytes_per_micro_batch": self.p2p_bytes_per_micro_batch,
            "inter_node_bytes_per_micro_batch": self.inter_node_bytes_per_micro_batch,
            "allreduce_bytes_per_micro_batch": self.allreduce_bytes_per_micro_batch,
        }


class Infeasible(ValueError):
    """No split of the layers fits the schedule at this K (too few layers, or over the memory limit)."""


# ---------------------------------------------------------------------------------------------------
# Stage costs


@dataclasses.dataclass(frozen=True)
class _Span:
    """Sums over layers ``[a, b)``."""

    forward_s: float
    backward_s: float
    recompute_s: float
    step_s: float
    param_bytes: float
    saved_bytes: float
    input_bytes: float
    output_bytes: float
    layers: int


class _Prefix:
    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        keys = ("forward_s", "backward_s", "recompute_s", "step_s", "param_bytes", "saved_bytes")
        self.sums = {k: [0.0] for k in keys}
        for layer in profile.layers:
            for k in keys:
                self.sums[k].append(self.sums[k][-1] + getattr(layer, k))

    def span(self, a: int, b: int) -> _Span:
        s = {k: v[b] - v[a] for k, v in self.sums.items()}
        return _Span(
            **s,
            input_bytes=self.profile.input_bytes_of(a),
            output_bytes=self.profile.layers[b - 1].activation_bytes,
            layers=b - a,
        )


def chunk_costs(
    profile: ModelProfile,
    bounds: Sequence[int],
    variant: Variant,
    placement: Placement,
    model: CostModel,
) -> list[ChunkCosts]:
    """The action costs of every chunk (virtual stage) cut at ``bounds``; chunk c runs on rank c % K."""
    prefix = _Prefix(profile)
    count = len(bounds) - 1
    K = placement.stages
    out = []
    for c in range(count):
        span = prefix.span(bounds[c], bounds[c + 1])
        rank, last = c % K, c == count - 1
        forward, backward = span.forward_s, span.backward_s
        if variant.schedule == "fdg" and not last:  # the last stage runs plain autograd (delay 0)
            if variant.activations == "recomputed":
                forward, backward = span.recompute_s, span.forward_s + span.backward_s
            if variant.weights == "stashed":
                forward += 2 * span.param_bytes / model.copy_bandwidth
                backward += 4 * span.param_bytes / model.copy_bandwidth
        one = memory_model.per_micro_batch(variant.schedule, last, variant.activations, variant.weights)
        sizes = (span.saved_bytes, span.input_bytes, span.param_bytes)
        held, extra = one.held.bytes(*sizes), one.backward_extra.bytes(*sizes)
        input_fraction = 1.0 if c == 0 else model.input_fraction  # ZB-H1's first stage runs one full B
        out.append(
            ChunkCosts(
                forward_s=forward + model.overhead_s,
                backward_s=backward + model.overhead_s,
                step_s=span.step_s,
                allreduce_s=placement.allreduce_s(rank, span.param_bytes),
                backward_input_s=(backward + model.overhead_s) * input_fraction,
                held_bytes=held,
                weight_grad_bytes=span.saved_bytes * (0.0 if c == 0 else model.weight_grad_fraction),
                backward_extra_bytes=extra,
                static_bytes=span.param_bytes / profile.dtype_bytes * model.bytes_per_param,
                to_next=None if last else _link(placement, rank, (c + 1) % K, span.output_bytes),
                to_prev=None if c == 0 else _link(placement, rank, (c - 1) % K, span.input_bytes),
                host_s=model.host_s_per_layer * span.layers,
            )
        )
    return out


def _link(placement: Placement, src: int, dst: int, nbytes: float) -> Link:
    occupancy, latency, inter = placement.transfer_s(src, dst, nbytes)
    channel = f"nic{placement.node(src)}" if inter else f"r{src}>r{dst}"
    return Link(occupancy, latency, nbytes, inter, channel)


# ---------------------------------------------------------------------------------------------------
# Splitting


def stage_work(
    profile: ModelProfile, variant: Variant, stages: int, micro_batches: int, placement: Placement | None = None
) -> Any:
    """The per-micro-batch time of layers ``[a, b)`` as stage ``k`` (what the split balances).

    Compute, plus (given a placement) the transfer of the stage's output when it leaves the node:
    a cut between nodes costs most where activations are large, so the split moves it elsewhere.
    ``k`` is a chunk (a virtual stage, on rank ``k % stages``) for interleaved schedules.
    """
    prefix = _Prefix(profile)
    accumulate = variant.accumulate or micro_batches
    chunks = stages * (variant.chunks if variant.schedule == "interleaved" else 1)

    def work(a: int, b: int, k: int) -> float:
        s = prefix.span(a, b)
        total = s.forward_s + s.backward_s
        if variant.schedule == "fdg":
            total += s.step_s / accumulate
            if variant.activations == "recomputed" and k < chunks - 1:
                total += s.recompute_s
        # chunk k runs on rank k % K: interleaving's extra cuts, and its wrap from rank K-1 to rank 0,
        # cross nodes too, so they also move to where activations are small
        src, dst = k % stages, (k + 1) % stages
        if placement is not None and k < chunks - 1 and placement.crosses_nodes(src, dst):
            occupancy, latency, _ = placement.transfer_s(src, dst, s.output_bytes)
            total += occupancy + latency
        return total

    return work


def stage_memory(
    profile: ModelProfile, variant: Variant, stages: int, micro_batches: int, model: CostModel
) -> Any:  # fmt: skip
    """Bytes stage ``k`` holds with layers ``[a, b)`` at its peak: static plus
    :mod:`fdg_schedule.partitioning.stage_memory`."""
    prefix = _Prefix(profile)

    def memory(a: int, b: int, k: int) -> float:
        s = prefix.span(a, b)
        static = s.param_bytes / profile.dtype_bytes * model.bytes_per_param
        sizes = (s.saved_bytes, s.input_bytes, s.param_bytes)
        if variant.schedule in memory_model.SCHEDULES:
            peak, _ = memory_model.stage_footprint(
                variant.schedule, stages, k, variant.activations, variant.weights, micro_batches
            )
            return static + peak.bytes(*sizes)
        if variant.schedule == "zbh1":  # k + 1 micro-batches wait for W, K - k for I (1F1B's)
            w = 0.0 if k == 0 else model.weight_grad_fraction
            flight = memory_model.in_flight("1f1b", stages, k, micro_batches)
            one = memory_model.per_micro_batch("zbh1", k == stages - 1).held
            return static + flight * one.bytes(*sizes) + min(k, micro_batches) * w * s.saved_bytes
        return static  # interleaved: per-chunk memory depends on the interleaving; the simulation checks it

    return memory


# ---------------------------------------------------------------------------------------------------
# Streams and timing


def variant_streams(variant: Variant, stages: int, micro_batches: int, ticks: int = 0) -> list[st.Stream]:
    """The per-rank streams: ``ticks`` FDG ticks (no drain), or one batch of ``micro_batches``."""
    if variant.schedule == "fdg":
        accumulate = variant.accumulate or micro_batches
        if variant.threads:
            return st.fdg_thread_streams(stages, ticks, accumulate)
        return st.fdg_streams(stages, ticks, accumulate, drain=False)
    if variant.schedule == "1f1b":
        return st.deepspeed_1f1b_streams(stages, micro_batches)
    if variant.schedule == "gpipe":
        return st.gpipe_streams(stages, micro_batches)
    if variant.schedule == "interleaved":
        return st.interleaved_streams(stages, micro_batches, variant.chunks)
    return st.zbh1_streams(stages, micro_batches)


def fdg_window(stages: int, accumulate: int) -> tuple[int, int, int]:
    """``(ticks, first, length)``: simulate ``ticks`` ticks and time micro-batches ``first ... first + length``.

    The window starts after the fill (``2(K-1)`` ticks), ``K-1`` more for the stages' phases to settle (with
    each message sent when it is made, a stage can run ahead of the slowest for a while: Note [each message
    when it exists] in fdg_schedule.exchange.comm) and one accumulation period, and covers whole accumulation
    periods (at least 8 ticks, at least K).
    """
    first = 3 * (stages - 1) + 2 * accumulate
    length = accumulate * math.ceil(max(8, stages) / accumulate)
    return first + length + 1, first, length


def predict(
    profile: ModelProfile,
    variant: Variant,
    stages: int,
    cluster: Cluster,
    dp: int = 1,
    micro_batches: int = 8,
    model: CostModel | None = None,
    memory_limit: float | None = None,
    bounds: Sequence[int] | None = None,
    keep_timeline: bool = False,
) -> Prediction:
    """Predict ``variant`` at ``stages`` stages x ``dp`` replicas; raises :class:`Infeasible` when no split fits."""
    model = model or CostModel()
    limit = cluster.memory if memory_limit is None else memory_limit
    placement = Placement(cluster, stages, dp)
    chunks = stages * (variant.chunks if variant.schedule == "interleaved" else 1)
    layers = len(profile.layers)
    if chunks > layers:
        raise Infeasible(f"{variant.name} at K={stages} needs {chunks} chunks but the model has {layers} layers")
    if bounds is None:
        memory = stage_memory(profile, variant, chunks, micro_batches, model)
        work = stage_work(profile, variant, stages, micro_batches, placement)
        found = best_split(layers, chunks, work, memory, limit)
        if found is None:
            found = best_split(layers, chunks, work)  # report it anyway: memory shows by how much it misses
            assert found is not None
        bounds = found
    if len(bounds) != chunks + 1 or bounds[0] != 0 or bounds[-1] != layers or list(bounds) != sorted(set(bounds)):
        raise ValueError(f"split {list(bounds)} must rise strictly from 0 to {layers} with {chunks} stages")
    costs = chunk_costs(profile, bounds, variant, placement, model)
    collective = (
        2
        * math.ceil(math.log2(max(2, stages)))
        * (cluster.inter_latency if placement.nodes > 1 else cluster.intra_latency)
    )
    if variant.schedule == "fdg":
        accumulate = variant.accumulate or micro_batches
        ticks, first, length = fdg_window(stages, accumulate)
        if variant.threads:
            collective = _serial_exchange_s(costs) + model.tick_overhead_s
        streams = variant_streams(variant, stages, micro_batches, ticks)
        if model.tick_overhead_s and not variant.threads:
            costs = [dataclasses.replace(c, forward_s=c.forward_s + model.tick_overhead_s) for c in costs]
        timeline = simulate(streams, costs, collective, model.shared_host)
        forwards = timeline.ends(0, st.Op.FORWARD)
        start, end = forwards[first], forwards[first + length]
        per_micro_batch = (end - start) / length
        step_s = per_micro_batch * accumulate
        busy = [timeline.busy(r, start, end) for r in range(stages)]
        idle = 1 - sum(busy) / (stages * (end - start))
        steps_per_micro_batch = 1 / accumulate
    else:
        streams = variant_streams(variant, stages, micro_batches)
        timeline = simulate(streams, costs, collective, model.shared_host)
        step_s = timeline.makespan
        per_micro_batch = step_s / micro_batches
        idle = 1 - sum(timeline.busy(r) for r in range(stages)) / (stages * step_s)
        steps_per_micro_batch = 1 / micro_batches
    memory_bytes = [s + h for s, h in zip(timeline.static_bytes, timeline.peak_bytes)]
    p2p = sum(c.to_next.nbytes for c in costs if c.to_next) + sum(c.to_prev.nbytes for c in costs if c.to_prev)
    inter = sum(link.nbytes for c in costs for link in (c.to_next, c.to_prev) if link and link.inter_node)
    params_per_rank = [sum(_span_params(profile, bounds, c) for c in range(r, chunks, stages)) for r in range(stages)]
    ring = 2 * (dp - 1) / dp * max(params_per_rank) if dp > 1 else 0.0
    return Prediction(
        variant=variant,
        stages=stages,
        dp=dp,
        micro_batches=micro_batches,
        bounds=list(bounds),
        time_per_micro_batch_s=per_micro_batch,
        step_s=step_s,
        samples_per_s=profile.micro_batch * dp / per_micro_batch,
        idle_fraction=idle,
        memory_bytes=memory_bytes,
        held_bytes=list(timeline.peak_bytes),
        p2p_bytes_per_micro_batch=p2p,
        inter_node_bytes_per_micro_batch=inter,
        allreduce_bytes_per_micro_batch=ring * steps_per_micro_batch,
        fits=max(memory_bytes) <= limit,
        timeline=timeline if keep_timeline else None,
    )


def _span_params(profile: ModelProfile, bounds: Sequence[int], chunk: int) -> float:
    return sum(layer.param_bytes for layer in profile.layers[bounds[chunk] : bounds[chunk + 1]])


def _serial_exchange_s(costs: Sequence[ChunkCosts]) -> float:
    """The authors' code copies every activation and gradient one after another after the join."""
    return sum(link.occupancy_s + link.latency_s for c in costs for link in (c.to_next, c.to_prev) if link)


def backprop(profile: ModelProfile, model: CostModel | None = None) -> float:
    """Seconds per micro-batch of plain backprop on one device (forward, backward, step)."""
    model = model or CostModel()
    return sum(layer.forward_s + layer.backward_s + layer.step_s for layer in profile.layers) + 2 * model.overhead_s
