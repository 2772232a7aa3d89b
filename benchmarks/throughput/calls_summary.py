"""FDG by ``train_batch()`` size and transport across models: one table from several throughput reports (issue 62).

    python -m benchmarks.throughput.calls_summary out/i62/*/throughput.json > summary.md

Each report is a run of ``benchmarks.throughput.throughput`` with ``--fdg-gas 1,4,16`` (the same micro-batches
timed per variant, interleaved rounds). Per model and FDG variant the table gives the median over rounds of its
samples/s over the halves' (FDG's stages in plain torch, both cores busy: the ceiling) and over 1F1B m = 4's in
the same round, with [min-max] over the rounds; ``*`` marks a cell that meets issue 62's target (>= 0.95 x the
ceiling, >= 1.2 x 1F1B).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

CEILING, ONE_F_ONE_B = 0.95, 1.2  # issue 62's targets at GAS 4 over the default transport
NAME = re.compile(r"fdg_current_stored(?P<shm>_shm)?(_g(?P<gas>\d+))?$")  # no _g<N>: the run's one --fdg-gas


def cell(row: dict[str, Any], key: str, target: float) -> str:
    """``median [min-max]`` of one paired ratio, starred when the median meets ``target``; with the median's 95 %
    confidence interval where the report has one."""
    if key not in row:
        return "–"
    ratio = row[key]
    star = "*" if ratio["median"] >= target else ""
    ci = f" (CI {ratio['ci95'][0]:.3f}–{ratio['ci95'][1]:.3f})" if ratio.get("ci95") else ""
    return f"{ratio['median']:.3f}{star} [{ratio['min']:.2f}–{ratio['max']:.2f}]{ci}"  # 3 places: 0.949 is no 0.95


def rows(report: dict[str, Any]) -> list[str]:
    """One Markdown row per (model, transport, GAS) of a report."""
    out = []
    for model, result in report["models"].items():
        found = sorted(
            ((m.group("shm") is not None, int(m.group("gas") or report["fdg_gas"]), name) for name in result["variants"]
             if (m := NAME.match(name))),
        )  # fmt: skip
        for shm, gas, name in found:
            row = result["variants"][name]
            out.append(
                f"| {model} | {'shm' if shm else 'process group'} | {gas} | {len(row['samples_per_s_all'])} "
                f"| {cell(row, 'ratio_vs_halves', CEILING)} | {cell(row, 'ratio_vs_1f1b_m4', ONE_F_ONE_B)} |"
            )
    return out


def summary(paths: list[Path]) -> str:
    """The table over every report in ``paths``, each report's command and engine listed under it."""
    reports = [json.loads(p.read_text()) for p in paths]
    lines = [
        "| model | transport | GAS | rounds | × ceiling (halves) | × 1F1B m=4 |",
        "|---|---|---|---|---|---|",
    ]
    for report in reports:
        lines += rows(report)
    lines += ["", "`*`: the median meets the target (≥ 0.95 × the ceiling, ≥ 1.2 × 1F1B). Runs:", ""]
    for path, report in zip(paths, reports):
        load = f"load {report['load_start'][0]:.1f} → {report['load_end'][0]:.1f}"
        lines.append(f"- `{path.parent.name}`: engine {report['engine']}, {report['date']}, {load}: "
                     f"`{report['command']}`")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="throughput.json files")
    print(summary(parser.parse_args(argv).reports), end="")


if __name__ == "__main__":
    main()
