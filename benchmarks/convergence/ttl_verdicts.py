"""The time-to-loss test's verdicts, read off its analysis with the pre-registered rules (issue 63's goal).

    python -m benchmarks.convergence.ttl_verdicts docs/results/time_to_loss/analysis.json

The runner's ``analyze`` (benchmarks/convergence/time_to_loss.py, frozen at the queue's commit) computes numbers
only. The rules that turn them into verdicts are fixed in docs/results/time-to-loss-preregistration.md ("The
question and the goal"); this module applies them, and nothing else:

    row           goal   the ratio it divides by r
    K = 2         1.0    the measured FDG / DeepSpeed 1F1B (GAS 4) samples/s on this machine ("ratio")
    K = 4         1.3    the planner's FDG / DeepSpeed 1F1B per cluster and model ("over_1f1b")
    K = 8         1.1    the planner's FDG / the best synchronous schedule per cluster and model ("over_best_sync")

Per source, with r against ``bp_a4`` (the 1F1B job's batch):

- **meets**: ratio / (the upper end of r's two-sided 95 % interval) >= goal;
- **marginal**: ratio / (r's one-sided 95 % upper bound) >= goal, the two-sided end below it;
- **missed**: the one-sided lower bound is below the goal;
- a seed that did not reach the loss within the cap (r only "> c") cannot meet: **missed** when ratio / c is below
  the goal, else **undecided**.

A row's verdict is its worst source (missed < undecided < marginal < meets). A measured ratio counts for an LM row
only if it was measured with the row's own optimizer; a row without every planned seed is **incomplete**.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GOALS = {2: (1.0, "ratio"), 4: (1.3, "over_1f1b"), 8: (1.1, "over_best_sync")}  # K: (goal, the ratio's key)
ORDER = ("missed", "undecided", "marginal", "meets")  # worst first


def source_verdict(ratio: float, against: dict[str, Any], goal: float) -> str:
    """One throughput source's verdict for a row whose r (against ``bp_a4``) is ``against``."""
    if against["r"] is None:  # a seed did not reach: r > r_at_least
        return "missed" if ratio / against["r_at_least"] < goal else "undecided"
    if against["upper_95"] is None or ratio / against["upper_95"] < goal:
        return "missed"
    if ratio / against["interval_95"][1] >= goal:
        return "meets"
    return "marginal"


def row_verdict(config: dict[str, Any]) -> dict[str, Any]:
    """The verdict of one configuration of the analysis (its ``against_bp_a4`` and ``net_speedups``)."""
    k = int(config["K"])
    goal, key = GOALS[k]
    out: dict[str, Any] = {"task": config["task"], "optimizer": config["optimizer"], "K": k, "goal": goal,
                           "against": key, "sources": []}  # fmt: skip
    against = config.get("against_bp_a4")
    if against is None:
        return {**out, "verdict": "pending", "why": "no report seed yet"}
    for net in against.get("net_speedups") or []:
        if net.get("against") != key:
            continue
        if net.get("measured") and config["task"] == "lm" and not net.get("optimizer_matches"):
            continue  # the pre-registration: an LM row counts as measured only with its own optimizer's ratio
        label = "measured" if net.get("measured") else f"{net.get('cluster')}, {net.get('model')}"
        ratio = float(net[key])
        out["sources"].append({"source": label, "ratio": ratio, "verdict": source_verdict(ratio, against, goal),
                               "net": net.get("net"), "net_lower_95": net.get("net_lower_95"),
                               "net_interval_95": net.get("net_interval_95"),
                               "net_at_most": net.get("net_at_most")})  # fmt: skip
    if not out["sources"]:
        return {**out, "verdict": "pending", "why": f"no '{key}' throughput ratio for this row"}
    verdict = min((s["verdict"] for s in out["sources"]), key=ORDER.index)
    n, planned = int(against["n"]), int(against["n_planned"])
    if n < planned:
        return {**out, "verdict": "incomplete", "why": f"{n} of {planned} seeds (so far: {verdict})"}
    return {**out, "verdict": verdict, "why": f"worst of {len(out['sources'])} source(s)"}


def verdicts(analysis: dict[str, Any]) -> list[dict[str, Any]]:
    return [row_verdict(c) for c in analysis["configs"]]


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| task | optimizer | K | goal (net speed-up) | source | ratio | net | one-sided lower | two-sided | "
             "verdict |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        head = f"| {row['task']} | {row['optimizer']} | {row['K']} | ≥ {row['goal']:g} ({row['against']})"
        if not row["sources"]:
            lines.append(f"{head} | – | – | – | – | – | {row['verdict']}: {row['why']} |")
        for s in row["sources"]:
            net = "–" if s["net"] is None else f"{s['net']:.2f}"
            if s["net"] is None and s["net_at_most"] is not None:
                net = f"< {s['net_at_most']:.2f}"
            low = "–" if s["net_lower_95"] is None else f"{s['net_lower_95']:.2f}"
            two = "–" if s["net_interval_95"] is None else "{:.2f}–{:.2f}".format(*s["net_interval_95"])
            end = s["verdict"] if row["verdict"] == s["verdict"] else f"{s['verdict']} (row: {row['verdict']})"
            lines.append(f"{head} | {s['source']} | {s['ratio']:.3f} | {net} | {low} | {two} | {end} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("analysis", type=Path, help="the JSON that time_to_loss.py analyze --json wrote")
    parser.add_argument("--json", type=Path, default=None, help="also write the verdicts here")
    args = parser.parse_args(argv)
    rows = verdicts(json.loads(args.analysis.read_text()))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
