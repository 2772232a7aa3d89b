"""Every schedule at every K, and the pick: the fastest configuration that fits the memory limit.

:func:`plan` predicts each (schedule variant, K) pair, keeps the ones no split can hold (too few
layers, or over the memory limit) as reasons, and :func:`recommend` picks the highest throughput
(or throughput per device) among those that fit. :func:`table` and :func:`plot` present the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fdg_schedule.plan.cluster import Cluster
from fdg_schedule.plan.costs import ModelProfile
from fdg_schedule.plan.predict import CostModel, Infeasible, Prediction, Variant, backprop, predict

OBJECTIVES = ("throughput", "per-gpu")


@dataclasses.dataclass
class Plan:
    """All predictions of one planning run, what could not be planned and why, and the pick."""

    profile: ModelProfile
    cluster: Cluster
    dp: int
    memory_limit: float
    predictions: list[Prediction]
    skipped: list[tuple[str, int, str]]  # (variant name, K, reason)
    backprop_s: float  # one device, one step per micro-batch
    recommendation: Prediction | None
    objective: str

    def speedup(self, p: Prediction) -> float:
        """Throughput over plain backprop on ``dp`` devices (one step per micro-batch)."""
        return p.samples_per_s / (self.profile.micro_batch * self.dp / self.backprop_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.profile.meta,
            "micro_batch": self.profile.micro_batch,
            "cluster": dataclasses.asdict(self.cluster),
            "dp": self.dp,
            "memory_limit_bytes": self.memory_limit,
            "backprop_s_per_micro_batch": self.backprop_s,
            "objective": self.objective,
            "predictions": [{**p.row(), "speedup_over_backprop": self.speedup(p)} for p in self.predictions],
            "skipped": [{"schedule": v, "K": k, "reason": r} for v, k, r in self.skipped],
            "recommendation": None if self.recommendation is None else self.recommendation.row(),
        }


def plan(
    profile: ModelProfile,
    cluster: Cluster,
    stages: Sequence[int],
    variants: Sequence[Variant],
    dp: int = 1,
    micro_batches: Callable[[int], int] = lambda k: 4 * k,
    memory_limit: float | None = None,
    model: CostModel | None = None,
    gpus: int | None = None,
    objective: str = "throughput",
) -> Plan:
    """Predict every variant at every K in ``stages`` (``micro_batches(K)`` per batch), then pick one."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
    model = model or CostModel()
    limit = cluster.memory if memory_limit is None else memory_limit
    predictions: list[Prediction] = []
    skipped: list[tuple[str, int, str]] = []
    for k in stages:
        if gpus is not None and k * dp > gpus:
            skipped.append(("all", k, f"K={k} x dp={dp} needs {k * dp} devices, more than --gpus {gpus}"))
            continue
        for variant in variants:
            m = micro_batches(k)
            if variant.schedule == "interleaved" and variant.chunks > 1 and m % k:
                m += k - m % k  # Megatron's interleaving needs a multiple of K
            try:
                predictions.append(predict(profile, variant, k, cluster, dp, m, model, limit))
            except Infeasible as error:
                skipped.append((variant.name, k, str(error)))
    return Plan(
        profile=profile,
        cluster=cluster,
        dp=dp,
        memory_limit=limit,
        predictions=predictions,
        skipped=skipped,
        backprop_s=backprop(profile, model),
        recommendation=recommend(predictions, objective),
        objective=objective,
    )


def recommend(
    predictions: Sequence[Prediction], objective: str = "throughput", tolerance: float = 0.02
) -> Prediction | None:
    """The fitting prediction with the best objective, or the one on fewest devices within ``tolerance`` of it.

    Predictions within 2% of the best are ties (the model is not more precise than that); among
    them fewer devices win, then the higher objective, then less memory.
    """
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        return None

    def value(p: Prediction) -> float:
        return p.samples_per_s if objective == "throughput" else p.samples_per_s / p.gpus

    best = max(value(p) for p in fitting)
    close = [p for p in fitting if value(p) >= (1 - tolerance) * best]
    return min(close, key=lambda p: (p.gpus, -value(p), p.peak_memory))


# ---------------------------------------------------------------------------------------------------
# Presenting


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.1f} s"


def table(result: Plan) -> str:
    """The predictions as a Markdown table, grouped by K, then the skipped ones and the pick."""
    p0 = result.profile
    lines = [
        f"model: {p0.meta.get('model', p0.meta.get('source', '?'))}, {len(p0.layers)} layers, micro-batch "
        f"{p0.micro_batch}, {p0.dtype} on {p0.device}; backprop on one device: {_seconds(result.backprop_s)} "
        f"per micro-batch; cluster {result.cluster.name}: {result.cluster.gpus_per_node} per node; dp {result.dp}; "
        f"memory limit {_bytes(result.memory_limit)}",
        "",
        "| K | schedule | split | time/µb | step | samples/s | ×BP | idle | peak memory | fits | p2p/µb | "
        "inter-node/µb | all-reduce/µb |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result.predictions:
        split = ",".join(map(str, p.bounds)) if len(p.bounds) <= 9 else f"{len(p.bounds) - 1} cuts"
        lines.append(
            f"| {p.stages} | {p.variant.name} | {split} | {_seconds(p.time_per_micro_batch_s)} | {_seconds(p.step_s)} "
            f"| {rate(p.samples_per_s)} | {result.speedup(p):.2f} | {p.idle_fraction:.1%} | {_bytes(p.peak_memory)} "
            f"| {'yes' if p.fits else 'NO'} | {_bytes(p.p2p_bytes_per_micro_batch)} "
            f"| {_bytes(p.inter_node_bytes_per_micro_batch)} | {_bytes(p.allreduce_bytes_per_micro_batch)} |"
        )
    if result.skipped:
        lines += ["", "Not planned:"]
        lines += [f"- {name} at K={k}: {reason}" for name, k, reason in result.skipped]
    lines += ["", describe(result.recommendation, result)]
    return "\n".join(lines)


def rate(samples_per_s: float) -> str:
    """Samples/s with three significant figures at least (a 8B model trains a few samples per second)."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def describe(p: Prediction | None, result: Plan) -> str:
    if p is None:
        return (f"Recommendation: none of the planned configurations fits {_bytes(result.memory_limit)} per device; "
                "raise --memory-limit, use more stages, or FDG's recomputed activations.")  # fmt: skip
    per = "throughput" if result.objective == "throughput" else "throughput per device"
    return (
        f"Recommendation (best {per} within {_bytes(result.memory_limit)} per device; within 2% of it, fewest "
        f"devices): {p.variant.name} at K={p.stages} x dp={p.dp} ({p.gpus} devices), split {p.bounds}: "
        f"{rate(p.samples_per_s)} samples/s "
        f"({result.speedup(p):.2f}x backprop on {p.dp} device{'s' if p.dp > 1 else ''}), peak "
        f"{_bytes(p.peak_memory)} per device."
    )


def plot(result: Plan, path: str | Path, title: str = "") -> Path:
    """Throughput and peak memory against K, one line per schedule (dashed where it does not fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({p.variant.name for p in result.predictions}, key=_order)
    bases = sorted({n.split(" acc=")[0] for n in names}, key=_order)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name in names:
        base = name.split(" acc=")[0]
        rows = sorted((p for p in result.predictions if p.variant.name == name), key=lambda p: p.stages)
        # one colour per schedule; FDG with accumulation dashed in its mode's colour
        style = {"color": plt.get_cmap("tab10")(bases.index(base) % 10), "marker": "o", "markersize": 3,
                 "linewidth": 1.3, "linestyle": "--" if " acc=" in name else "-"}  # fmt: skip
        ks = [p.stages for p in rows]
        ax_t.plot(ks, [p.samples_per_s for p in rows], label=name, **style)
        ax_m.plot(ks, [p.peak_memory / 1e9 for p in rows], label=name, **style)
        for ax, values in ((ax_t, [p.samples_per_s for p in rows]), (ax_m, [p.peak_memory / 1e9 for p in rows])):
            bad = [(k, v) for k, v, p in zip(ks, values, rows) if not p.fits]
            if bad:
                ax.scatter(*zip(*bad), marker="x", color=style["color"], s=30, zorder=3)
    ax_m.axhline(result.memory_limit / 1e9, color="black", linestyle=":", linewidth=1)
    ax_m.text(min(p.stages for p in result.predictions), result.memory_limit / 1e9, " memory limit", va="bottom")
    from matplotlib.ticker import ScalarFormatter

    for ax, label in ((ax_t, "samples/s (whole job)"), (ax_m, "peak memory per device (GB)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("pipeline stages K")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_m.set_yscale("log")
    ax_t.legend(fontsize=7, ncol=2)
    fig.suptitle(title or "predicted throughput and memory against K (x: over the memory limit)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("fdg") else 1, name)
