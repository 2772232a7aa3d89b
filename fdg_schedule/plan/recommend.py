"""Every schedule at every K, and the pick: the configuration that fits the memory limit and reaches the loss soonest.

:func:`plan` predicts each (schedule variant, K) pair, keeps the ones no split can hold (too few
layers, or over the memory limit) as reasons, and :func:`recommend` picks the highest throughput to the
same loss (or that per device) among those that fit: samples/s divided by the token overhead r
(:mod:`fdg_schedule.plan.overheads`; r = 1 for the synchronous schedules). Note [ranking by time to loss]
says how an FDG configuration whose r is unknown is ranked. :func:`table` and :func:`plot` present the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fdg_schedule.plan.cluster import Cluster
from fdg_schedule.plan.costs import ModelProfile
from fdg_schedule.plan.overheads import SYNCHRONOUS, Overheads, TokenOverhead
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
    overheads: Overheads = dataclasses.field(default_factory=Overheads)
    alternative: Prediction | None = None  # the pick among configurations whose r is known (Note [ranking ...])

    def speedup(self, p: Prediction) -> float:
        """Throughput over plain backprop on ``dp`` devices (one step per micro-batch)."""
        return p.samples_per_s / (self.profile.micro_batch * self.dp / self.backprop_s)

    def r(self, p: Prediction) -> TokenOverhead:
        """The token overhead of ``p`` against backprop at the job's batch (``p.micro_batches`` per step)."""
        if p.variant.schedule != "fdg":
            return SYNCHRONOUS
        return self.overheads.for_fdg(p.stages, p.variant.accumulate or p.micro_batches, p.micro_batches)

    def best_synchronous(self, stages: int) -> Prediction | None:
        """The fastest fitting synchronous schedule at K = ``stages`` (per step: they all have r = 1)."""
        fits = [p for p in self.predictions if p.stages == stages and p.fits and p.variant.schedule != "fdg"]
        return max(fits, key=lambda p: p.samples_per_s, default=None)

    def per_step(self, p: Prediction) -> float | None:
        """Samples/s over the fastest fitting synchronous schedule's at the same K; None where none fits."""
        sync = self.best_synchronous(p.stages)
        return None if sync is None else p.samples_per_s / sync.samples_per_s

    def break_even(self) -> float | None:
        """For a pick whose r is unknown: the r below which it reaches the loss before :attr:`alternative`."""
        rec, alt = self.recommendation, self.alternative
        if rec is None or alt is None or self.r(rec).known:
            return None
        return _value(rec, self.objective) / _value(alt, self.objective, self.r(alt).ranking)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.profile.meta,
            "micro_batch": self.profile.micro_batch,
            "cluster": dataclasses.asdict(self.cluster),
            "dp": self.dp,
            "memory_limit_bytes": self.memory_limit,
            "backprop_s_per_micro_batch": self.backprop_s,
            "objective": self.objective,
            "predictions": [
                {
                    **p.row(),
                    "speedup_over_backprop": self.speedup(p),
                    "per_step_over_synchronous": self.per_step(p),
                    "token_overhead": dataclasses.asdict(self.r(p)),
                }
                for p in self.predictions
            ],  # fmt: skip
            "skipped": [{"schedule": v, "K": k, "reason": r} for v, k, r in self.skipped],
            "recommendation": None if self.recommendation is None else self.recommendation.row(),
            "recommendation_conditional": self.recommendation is not None and not self.r(self.recommendation).known,
            "break_even_r": self.break_even(),
            "alternative": None if self.alternative is None else self.alternative.row(),
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
    overheads: Overheads | None = None,
) -> Plan:
    """Predict every variant at every K in ``stages`` (``micro_batches(K)`` per batch), then pick one.

    ``overheads`` says where FDG's token overhead r comes from (default: the shipped table for an unnamed model,
    which finds nothing: r unknown, Note [ranking by time to loss]).
    """
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
    result = Plan(
        profile=profile,
        cluster=cluster,
        dp=dp,
        memory_limit=limit,
        predictions=predictions,
        skipped=skipped,
        backprop_s=backprop(profile, model),
        recommendation=None,
        objective=objective,
        overheads=overheads or Overheads(),
    )
    overhead = lambda p: result.r(p).ranking  # noqa: E731
    result.recommendation = recommend(predictions, objective, overhead=overhead)
    if result.recommendation is not None and not result.r(result.recommendation).known:
        result.alternative = recommend([p for p in predictions if result.r(p).known], objective, overhead=overhead)
    return result


# Note [ranking by time to loss]
# A schedule's time to the loss the job trains for is its time per token x r, r the token overhead against
# backprop at the job's batch (docs/token-overhead.md): r = 1 for the synchronous schedules, which compute exactly
# that; FDG's r comes from --token-overhead or the shipped table. So the ranking divides samples/s by r. Where FDG's
# r is not known, the planner does not pretend it is 1 silently:
# - r only bounded below ("> c": a measured seed did not reach the loss within its cap): FDG is ranked at r = c,
#   its most favourable case; if it still loses, a synchronous schedule is faster whatever r is;
# - r unknown: FDG is ranked by its per-step speed (r = 1).
# Either way a pick whose r is not known is conditional: the plan also names the pick among the configurations
# whose r is known (:attr:`Plan.alternative`) and the break-even r below which the conditional pick is faster
# (:meth:`Plan.break_even`), and the recommendation says so.


def _value(p: Prediction, objective: str, r: float = 1.0) -> float:
    per = p.samples_per_s / r
    return per if objective == "throughput" else per / p.gpus


def recommend(
    predictions: Sequence[Prediction],
    objective: str = "throughput",
    tolerance: float = 0.02,
    overhead: Callable[[Prediction], float] | None = None,
) -> Prediction | None:
    """The fitting prediction with the best objective, or the one on fewest devices within ``tolerance`` of it.

    The objective is samples/s (or per device) divided by ``overhead(p)``, the token overhead r the ranking uses
    (Note [ranking by time to loss]; default 1: per step). Predictions within 2% of the best are ties (the model is
    not more precise than that); among them fewer devices win, then the higher objective, then less memory.
    """
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        return None

    def value(p: Prediction) -> float:
        return _value(p, objective, 1.0 if overhead is None else overhead(p))

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
    """The predictions as a Markdown table, grouped by K, then the skipped ones and the pick.

    ``×sync`` is samples/s over the fastest fitting synchronous schedule's at the same K (per step), ``r`` the
    token overhead (``?``: unknown, ``> c``: bounded below; ``≤`` its 95 % upper bound) and ``net`` ×sync / r.
    """
    p0 = result.profile
    lines = [
        f"model: {p0.meta.get('model', p0.meta.get('source', '?'))}, {len(p0.layers)} layers, micro-batch "
        f"{p0.micro_batch}, {p0.dtype} on {p0.device}; backprop on one device: {_seconds(result.backprop_s)} "
        f"per micro-batch; cluster {result.cluster.name}: {result.cluster.gpus_per_node} per node; dp {result.dp}; "
        f"memory limit {_bytes(result.memory_limit)}",
        "",
        "| K | schedule | split | time/µb | step | samples/s | ×BP | ×sync | r | net | idle | peak memory | fits | "
        "p2p/µb | inter-node/µb | all-reduce/µb |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result.predictions:
        split = ",".join(map(str, p.bounds)) if len(p.bounds) <= 9 else f"{len(p.bounds) - 1} cuts"
        ratio, r = result.per_step(p), result.r(p)
        step, net = ("–", "–") if ratio is None else (f"{ratio:.2f}", r.net(ratio))
        lines.append(
            f"| {p.stages} | {p.variant.name} | {split} | {_seconds(p.time_per_micro_batch_s)} | {_seconds(p.step_s)} "
            f"| {rate(p.samples_per_s)} | {result.speedup(p):.2f} | {step} | {r.text()} | {net} "
            f"| {p.idle_fraction:.1%} | {_bytes(p.peak_memory)} "
            f"| {'yes' if p.fits else 'NO'} | {_bytes(p.p2p_bytes_per_micro_batch)} "
            f"| {_bytes(p.inter_node_bytes_per_micro_batch)} | {_bytes(p.allreduce_bytes_per_micro_batch)} |"
        )
    lines += overhead_sources(result)
    if result.skipped:
        lines += ["", "Not planned:"]
        lines += [f"- {name} at K={k}: {reason}" for name, k, reason in result.skipped]
    lines += ["", describe(result.recommendation, result)]
    return "\n".join(lines)


def overhead_sources(result: Plan) -> list[str]:
    """Where each FDG row's r comes from, once per source."""
    sources: dict[str, list[str]] = {}
    for p in result.predictions:
        if p.variant.schedule == "fdg":
            r = result.r(p)
            key = f"r = {r.text()}: {r.source}" if r.known or r.at_least is not None else "r unknown (?)"
            sources.setdefault(key, []).append(f"{p.variant.name} at K={p.stages}")
    if not sources:
        return []
    lines = ["", "FDG's token overhead r (against backprop at the job's batch):"]
    for key, rows in sources.items():
        where = ", ".join(rows) if len(rows) <= 4 else f"{len(rows)} rows"
        lines.append(f"- {key} ({where})")
    return lines


def rate(samples_per_s: float) -> str:
    """Samples/s with three significant figures at least (a 8B model trains a few samples per second)."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def describe(p: Prediction | None, result: Plan) -> str:
    if p is None:
        return (f"Recommendation: none of the planned configurations fits {_bytes(result.memory_limit)} per device; "
                "raise --memory-limit, use more stages, or FDG's recomputed activations.")  # fmt: skip
    per = "throughput" if result.objective == "throughput" else "throughput per device"
    pick = (
        f"Recommendation (best {per} to the same loss, samples/s ÷ token overhead r, within "
        f"{_bytes(result.memory_limit)} per device; within 2% of it, fewest devices): {p.variant.name} at "
        f"K={p.stages} x dp={p.dp} ({p.gpus} devices), split {p.bounds}: {rate(p.samples_per_s)} samples/s "
        f"({result.speedup(p):.2f}x backprop on {p.dp} device{'s' if p.dp > 1 else ''}), peak "
        f"{_bytes(p.peak_memory)} per device."
    )
    return pick + " " + time_to_loss(result)


def _named(p: Prediction) -> str:
    return f"{p.variant.name} at K={p.stages} ({rate(p.samples_per_s)} samples/s)"


def time_to_loss(result: Plan) -> str:
    """Why the pick reaches the loss soonest, in per-step ratio, r and net speed-up (Note [ranking by time to loss])."""
    p = result.recommendation
    if p is None:
        return ""
    r, ratio = result.r(p), result.per_step(p)
    if p.variant.schedule != "fdg":
        fdg = recommend([q for q in result.predictions if q.variant.schedule == "fdg"], result.objective)
        if fdg is None or _value(fdg, result.objective) <= _value(p, result.objective):
            return "No FDG configuration that fits is faster per step."
        rf, step = result.r(fdg), result.per_step(fdg)
        if not rf.known and rf.at_least is None:
            return (f"FDG's fastest per step, {_named(fdg)}, is within 2% of it (a tie, which fewer devices win); "
                    f"its token overhead r is unknown ({rf.source}).")  # fmt: skip
        versus = "" if step is None else f", {step:.2f}x the fastest synchronous schedule at its K per step"
        net = "" if step is None else f": net {rf.net(step)}x"
        return (f"FDG's fastest per step, {_named(fdg)}{versus}, needs r = {rf.text()} times the tokens ({rf.source})"
                f"{net}, so a synchronous schedule reaches the loss sooner.")  # fmt: skip
    versus = "no synchronous schedule fits at this K" if ratio is None else (
        f"{ratio:.2f}x the fastest synchronous schedule at this K per step")  # fmt: skip
    if r.known:
        assert r.r is not None
        net = "" if ratio is None else f": net {ratio / r.r:.2f}x"
        bound = "" if ratio is None or r.upper is None else f" ({ratio / r.upper:.2f}x at r's 95 % upper bound)"
        return f"Time to loss: {versus}; token overhead r = {r.text()} ({r.source}){net}{bound}."
    how = "by its per-step speed" if r.at_least is None else f"at r = {r.at_least:.2f}, its most favourable case"
    what = "unknown" if r.at_least is None else f"only bounded below, r > {r.at_least:.2f}"
    alt, even = result.alternative, result.break_even()
    if alt is None or even is None:
        rest = "no configuration with a known r fits, so nothing else is ranked against it."
    else:
        known = "" if alt.variant.schedule != "fdg" else f" with r = {result.r(alt).text()}"
        rest = f"it reaches the loss before {_named(alt)}{known} only if r < {even:.2f} (the break-even r)."
    return (f"CONDITIONAL: {versus}, but its token overhead r is {what} ({r.source}); ranked {how}, {rest} Measure "
            "r (python -m fdg_schedule.plan.token_overhead) and pass --token-overhead.")  # fmt: skip


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
