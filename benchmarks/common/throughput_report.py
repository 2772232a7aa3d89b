"""The throughput benchmark's report: per-variant medians, paired ratios and memory, as JSON rows and Markdown."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.common.bench_models import MODELS
from benchmarks.common.throughput_variants import (
    BOUND,
    COMPUTE_KINDS,
    CORRECTED,
    HALVES,
    HALVES_RECOMPUTED,
    SHM,
    split_key,
    split_objective,
)

WITH_MESSAGES = "ratio_vs_halves_with_its_messages"  # FDG stored over the halves exchanging its messages


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_ci95(values: list[float]) -> tuple[float, float] | None:
    """A distribution-free 95 % confidence interval of the median: order statistics x_(j), x_(n+1-j).

    j is the largest index with P(Binomial(n, 1/2) < j) <= 2.5 %, so the interval covers the true
    median with at least 95 % for any continuous distribution of independent rounds. None below six
    values (no such interval exists: at n = 5 even [min, max] covers only 93.75 %).
    """
    n = len(values)
    below = 0.0  # P(Binomial(n, 1/2) < j)
    j = 0
    while below + math.comb(n, j) / 2**n <= 0.025:
        below += math.comb(n, j) / 2**n
        j += 1
    if j == 0:
        return None
    ordered = sorted(values)
    return ordered[j - 1], ordered[n - j]


def summarize(plan: dict[str, Any], ranks: list[dict[str, Any]], memory: dict[str, list[dict[str, Any]]]) -> dict:
    """Per variant: samples/s, paired ratios, efficiency, stage balance, memory."""
    specs = {s["name"]: s for s in plan["variants"]}
    micro = MODELS[plan["model"]]["micro"]
    rows: dict[str, dict[str, Any]] = {}
    per_repeat: dict[str, dict[int, float]] = {name: {} for name in specs}
    for name, spec in specs.items():
        rank0 = [w for w in ranks[0]["windows"] if w["variant"] == name]
        samples_per_s, efficiency, compute, wait, other, cpu, share, loads = [], [], [], [], [], [], [], []
        usage: list[list[dict[str, float]]] = []
        for i, w0 in enumerate(rank0):
            windows = [[x for x in r["windows"] if x["variant"] == name][i] for r in ranks]
            used = [w for w, r in zip(windows, ranks) if r["stage_id"][name] is not None]
            samples = w0["micro_batches"] * micro * (spec["ranks"] if spec["kind"] == "dp" else 1)
            rate = samples / w0["wall_s"]
            samples_per_s.append(rate)
            per_repeat[name][w0["repeat"]] = rate
            stage_compute = [sum(w["stats"].get(k, 0.0) for k in COMPUTE_KINDS) for w in used]
            efficiency.append(sum(stage_compute) / (len(used) * w0["wall_s"]))
            compute.append([c / w0["micro_batches"] for c in stage_compute])
            wait.append([w["stats"].get("wait_s", 0.0) / w0["micro_batches"] for w in used])
            other.append(
                [(w["local_wall_s"] - c - w["stats"].get("wait_s", 0.0)) / w0["micro_batches"]
                 for w, c in zip(used, stage_compute)]
            )  # fmt: skip
            cpu.append([w["cpu_s"] for w in windows])
            share.append([w["cpu_s"] / w["local_wall_s"] for w in used])
            usage.append([{k: v / w0["micro_batches"] for k, v in w.get("usage", {}).items()} for w in used])
            loads.append((w0["load_before"], w0["load_after"]))
        stages = len(compute[0])
        rows[name] = {
            "kind": spec["kind"],
            "samples_per_s": _spread(samples_per_s),
            "samples_per_s_all": samples_per_s,
            "efficiency": _spread(efficiency),
            "stage_compute_s_per_micro_batch": [statistics.median(c[s] for c in compute) for s in range(stages)],
            "stage_wait_s_per_micro_batch": [statistics.median(c[s] for c in wait) for s in range(stages)],
            # the rest of each rank's own wall time: dispatch, exchange posting, data, Python
            "stage_other_s_per_micro_batch": [statistics.median(c[s] for c in other) for s in range(stages)],
            "cpu_s_per_rank_per_window": [statistics.median(c[r] for c in cpu) for r in range(len(ranks))],
            # CPU seconds a rank got per second of its wall time: < 1 while waiting or descheduled
            "cpu_share_per_stage": [statistics.median(c[s] for c in share) for s in range(stages)],
            # per micro-batch, per stage: user/kernel CPU seconds, other threads' CPU seconds, faults, switches
            "usage_per_micro_batch": [
                {k: statistics.median(u[s][k] for u in usage) for k in usage[0][s]} for s in range(stages)
            ],
            "load_avg_1min": loads,
            "optimizer_steps_per_micro_batch": 1.0 / spec["gas"] if spec["kind"] == "1f1b" else 1.0,
        }
    for name, row in rows.items():
        # a variant bound to cores is compared with the baselines bound the same way, where they ran
        bound = BOUND if name.endswith(BOUND) else ""
        bases = [
            (f"ratio_vs_{base}", base + bound if base + bound in per_repeat else base) for base in ("bp", "1f1b_m4")
        ]
        if "corrections" in specs[name]:  # a staleness correction: its cost next to the same mode without it
            bases.append((f"ratio_vs_{CORRECTED}", CORRECTED))
        if specs[name]["kind"] in ("fdg", "1f1b") or specs[name].get("exchange"):  # against what the cores allow
            bases.append((f"ratio_vs_{HALVES}", HALVES))  # FDG's stages without a pipeline (or with its messages)
        if specs[name]["kind"] == "fdg" and specs[name].get("activations") == "stored":  # the same messages, no engine
            exchange = HALVES + (SHM if specs[name].get("transport") == "shm" else "_exchange")
            bases.append((WITH_MESSAGES, exchange))
        if specs[name]["kind"] == "fdg" and specs[name].get("activations") == "recomputed":  # and its own ceiling
            bases.append((f"ratio_vs_{HALVES_RECOMPUTED}", HALVES_RECOMPUTED))
        for key, base in bases:
            if base not in per_repeat:
                continue
            paired = _paired(per_repeat, name, base)
            row[key] = _spread(paired)
            ci = median_ci95(paired)
            if ci is not None:
                row[key]["ci95"] = list(ci)
            row.setdefault("ratio_bases", {})[key] = base
        row["speedup_over_k"] = row["ratio_vs_bp"]["median"] / specs[name]["ranks"] if "ratio_vs_bp" in row else None
        in_process = sorted(
            ({"stage_id": r["stage_id"][name], "rank": r["rank"], **r["memory"][name]} for r in ranks
             if r["stage_id"][name] is not None),
            key=lambda m: (m["stage_id"], m["rank"]),
        )  # fmt: skip
        fresh = memory.get(name) or [{} for _ in in_process]
        row["memory"] = [
            {**m, **{k: v for k, v in f.items() if k.startswith("rss")}} for m, f in zip(in_process, fresh)
        ]
        split = split_key(specs[name]) if specs[name]["stages"] > 1 else None
        row["split_key"] = split
        row["split"] = plan["splits"].get(split) if split is not None else None
        predicted = plan.get("predicted", {}).get(split) if split is not None else None
        row["stage_predicted_s_per_micro_batch"] = predicted["predicted_s"] if predicted else None
    for name, row in rows.items():
        stored = name.replace("_recomputed", "_stored")  # fdg_current_recomputed[_shm] -> fdg_current_stored[_shm]
        if name.removesuffix(SHM).endswith("_recomputed") and stored in rows:
            row["recompute_bound"] = recompute_bound(row, rows[stored], _paired(per_repeat, name, stored))
    return rows


def _paired(per_repeat: dict[str, dict[int, float]], name: str, base: str) -> list[float]:
    """``name``'s samples/s over ``base``'s in each round both ran."""
    return [per_repeat[name][r] / per_repeat[base][r] for r in per_repeat[name] if r in per_repeat[base]]


IDEAL_RECOMPUTE_BOUND = 0.875  # K = 2, a forward a third of a layer's work, layers divisible at will


def recompute_bound(recomputed: dict[str, Any], stored: dict[str, Any], paired: list[float]) -> dict[str, float]:
    """How fast the recomputed mode can be at most, as a fraction of the stored mode's speed.

    ``profile``: the partitioner's predicted tick (slowest stage) of the stored split over that of the
    recomputed split, both on this model's measured layer times: the extra forward at its measured cost
    and the layers as they can be cut. ``ideal``: the same bound for a forward a third of a layer's
    work and layers divisible at will (7/8 at K = 2). ``measured``: the median over rounds of the
    recomputed mode's samples/s over the stored mode's in the same round.
    """
    bound = {"ideal": IDEAL_RECOMPUTE_BOUND}
    predicted = (stored.get("stage_predicted_s_per_micro_batch"), recomputed.get("stage_predicted_s_per_micro_batch"))
    if predicted[0] and predicted[1]:
        bound["profile"] = max(predicted[0]) / max(predicted[1])
    if paired:
        bound["measured"] = statistics.median(paired)
        ci = median_ci95(paired)
        if ci is not None:
            bound["measured_ci95_low"], bound["measured_ci95_high"] = ci
    return bound


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: one throughput table per model, then memory by K."""
    lines = [
        f"Measured {report['date']} on {report['machine']}, engine {report['engine']}; command:",
        "",
        f"    {report['command']}",
        "",
        *(
            [f"Summarized again from the run's raw windows by {report['summarized_by']}.", ""]
            if "summarized_by" in report
            else []
        ),
        f"Load average (1 min) at start {report['load_start'][0]:.2f}, at end {report['load_end'][0]:.2f}; "
        f"{report['seconds']:.0f} s in all. Freed host memory: {report.get('host_memory', 'system default')}; "
        f"every rank bound to a core of its own: {'yes' if report.get('bind_cores') else 'no'} "
        "(`_bound` variants: in their own windows). Every variant steps "
        f"{_optimizer(report)}.",
        "",
    ]
    for model, result in report["models"].items():
        cfg = MODELS[model]
        lines += [
            f"### {model} (micro-batch {cfg['micro']}, {report['repeats']} rounds of {report['window']} "
            "micro-batches per variant)",
            "",
            "| variant | split | samples/s median [min–max] | ×BP median [min–max] (95 % CI) | ×1F1B m=4 | efficiency "
            "| predicted ms/µb "
            "| compute ms/µb "
            "| wait ms/µb | other ms/µb | CPU share | peak RSS MB | ΔRSS MB | held (FDG) / saved (others) MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [_row(name, row) for name, row in result["variants"].items()]
        bound = [
            name
            for name, row in result["variants"].items()
            if any(base.endswith(BOUND) for base in row.get("ratio_bases", {}).values())
        ]
        if bound:
            lines += ["", f"{', '.join(bound)}: ×BP and ×1F1B against the baselines bound to cores the same way."]
        lines += _rebalanced(result)
        lines += _recompute_bounds(result)
        lines += _against_halves(result["variants"])
        lines += _corrections_table(result["variants"])
        loads = [load for row in result["variants"].values() for pair in row["load_avg_1min"] for load in pair]
        lines += ["", f"Load average (1 min) during the windows: {min(loads):.2f}–{max(loads):.2f}.", ""]
    for model, result in report.get("memory_by_stages", {}).items():
        lines += [
            f"### {model}: memory per stage by K (fresh processes)",
            "",
            "| variant | K | held (FDG) / saved (others) MB | ΔRSS MB |",
            "|---|---|---|---|",
        ]
        for k, per_variant in result.items():
            for name, mem in per_variant.items():
                held = _slash([m.get("held_max", m.get("saved_peak", 0)) for m in mem], 2**-20)
                rss = _slash([m["rss_peak"] - m["rss_build"] for m in mem], 2**-20, 0)
                lines.append(f"| {name} | {k} | {held} | {rss} |")
        lines.append("")
    return "\n".join(lines)


def _rebalanced(result: dict[str, Any]) -> list[str]:
    """Per pipeline variant, the split balanced on the profile rescaled to its measured stage compute."""
    from fdg_schedule.partitioning.partition import evaluate_partition
    from fdg_schedule.partitioning.profile import ModelProfile
    from fdg_schedule.tools.stage_times import rebalanced_advice

    if "profile" not in result:
        return []
    profile = ModelProfile.from_dict(result["profile"])
    lines = []
    for name, row in result["variants"].items():
        measured = row.get("stage_compute_s_per_micro_batch") or []
        if row.get("split_key") is None or row.get("split") is None or not all(t > 0 for t in measured):
            continue
        plan = evaluate_partition(profile, row["split"], split_objective(row["split_key"]))
        lines.append(f"- {name}: {rebalanced_advice(plan, measured)}")
    return ["", *lines] if lines else []


def _against_halves(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Per pipeline variant: its samples/s over the plain halves' (the machine's ceiling), paired per round;
    FDG stored also over the halves with its own transport's messages, a recomputed FDG variant over the
    recomputed halves' (its own ceiling: the extra forward included)."""
    what = {
        f"ratio_vs_{HALVES}": "FDG's stages in plain torch, both cores busy, no engine, no exchange, no lock-step",
        WITH_MESSAGES: "the halves plus the same messages through the same transport, no engine",
        f"ratio_vs_{HALVES_RECOMPUTED}": "the same in FDG's recomputed order on the recomputed split: its own ceiling",
    }
    lines = [
        f"- {name}: {_ratio(row, key)} × `{row['ratio_bases'][key]}` ({text}; paired per round)"
        for key, text in what.items()
        for name, row in rows.items()
        if key in row
    ]
    return ["", *lines] if lines else []


def _recompute_bounds(result: dict[str, Any]) -> list[str]:
    """Per recomputed variant: its speed over the stored mode's against the bounds its extra forward allows."""
    layers = result.get("profile", {}).get("layers", [])
    forward = sum(layer["forward_s"] for layer in layers)
    share = forward / (forward + sum(layer["backward_s"] for layer in layers)) if layers else None
    lines = []
    for name, row in result["variants"].items():
        bound = row.get("recompute_bound", {})
        if "measured" not in bound:
            continue
        ci = (
            f" (CI {bound['measured_ci95_low']:.3f}–{bound['measured_ci95_high']:.3f})"
            if "measured_ci95_low" in bound
            else ""
        )
        profile = (
            f"{bound['profile']:.3f} on this profile (forward {share:.0%} of forward + backward, "
            f"these splits; measured / bound {bound['measured'] / bound['profile']:.3f})"
            if "profile" in bound and share is not None
            else "– (no profile)"
        )
        lines.append(
            f"- {name}: {bound['measured']:.3f}{ci} × the stored mode's samples/s (paired per round). "
            f"Bound: {profile}; "
            f"{bound['ideal']} for a forward a third of the work, layers cut anywhere "
            f"(measured / bound {bound['measured'] / bound['ideal']:.3f})."
        )
    return ["", *lines] if lines else []


def _corrections_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The staleness corrections' cost: paired throughput ratio to the mode without them, and δ's bytes."""
    corrected = {name: row for name, row in rows.items() if f"ratio_vs_{CORRECTED}" in row}
    if not corrected:
        return []
    lines = [
        "",
        f"Staleness corrections against `{CORRECTED}` (paired per round; δ: the prediction's fp32 tensor):",
        "",
        f"| variant | ×{CORRECTED} median [min–max] | compute ms/µb | δ MB per stage |",
        "|---|---|---|---|",
    ]
    for name, row in corrected.items():
        delta = [m.get("delta_bytes", 0) for m in row["memory"] or []]
        cells = [
            name,
            _ratio(row, f"ratio_vs_{CORRECTED}"),
            _slash(row["stage_compute_s_per_micro_batch"], 1e3),
            _slash(delta, 2**-20, 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _optimizer(report: dict[str, Any]) -> str:
    """The optimizer line of a report (one from before ``--optimizer`` stepped SGD with momentum)."""
    name = report.get("optimizer", "sgd")
    given = report.get("optimizer_settings", {"params": {"lr": 0.01, "momentum": 0.9}, "gradient_clipping": 0.0})
    params = ", ".join(f"{k} {v}" for k, v in given["params"].items())
    clip = given["gradient_clipping"]
    return f"{name} ({params}; gradient clipping {clip if clip else 'off'})"


def _row(name: str, row: dict[str, Any]) -> str:
    """One table row; per-stage values are "stage 0 / stage 1"."""
    sps = row["samples_per_s"]
    mem = row["memory"] or []
    rss = [m for m in mem if "rss_peak" in m]
    cells = [
        name,
        "–" if row.get("split") is None else ",".join(map(str, row["split"])),
        f"{sps['median']:.1f} [{sps['min']:.1f}–{sps['max']:.1f}]",
        _ratio(row, "ratio_vs_bp"),
        _ratio(row, "ratio_vs_1f1b_m4"),
        f"{row['efficiency']['median']:.1%}",
        _slash(row.get("stage_predicted_s_per_micro_batch") or [], 1e3),
        _slash(row["stage_compute_s_per_micro_batch"], 1e3),
        _slash(row["stage_wait_s_per_micro_batch"], 1e3),
        _slash(row["stage_other_s_per_micro_batch"], 1e3),
        _slash(row["cpu_share_per_stage"], 1.0, 2),
        _slash([m["rss_peak"] for m in rss], 2**-20, 0),
        _slash([m["rss_peak"] - m["rss_build"] for m in rss], 2**-20, 0),
        _slash([m.get("held_max", m.get("saved_peak", 0)) for m in mem], 2**-20),
    ]
    return "| " + " | ".join(cells) + " |"


def _ratio(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return "–"
    ratio = row[key]
    ci = f" (CI {ratio['ci95'][0]:.2f}–{ratio['ci95'][1]:.2f})" if "ci95" in ratio else ""
    return f"{ratio['median']:.2f} [{ratio['min']:.2f}–{ratio['max']:.2f}]{ci}"


def _slash(values: list[float], scale: float, digits: int = 1) -> str:
    return " / ".join(f"{v * scale:.{digits}f}" for v in values) if values else "–"
