"""Before / after table of two runs of ``python -m benchmarks.throughput.scaling``: per setting and K, the fastest
FDG mode that fits against the fastest other schedule that fits.

    python -m benchmarks.throughput.scaling_compare docs/results/scaling/scaling-exchange-at-tick-end.json \
        docs/results/scaling/scaling.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def best(predictions: list[dict[str, Any]], stages: int, fdg: bool) -> dict[str, Any] | None:
    fits = [p for p in predictions if p["K"] == stages and p["fits"] and p["schedule"].startswith("fdg") == fdg]
    return max(fits, key=lambda p: p["samples_per_s"], default=None)


def table(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines = [
        "| setting | K | FDG before: samples/s | FDG after: samples/s (mode) | best other: samples/s | FDG / other "
        "before | after |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, setting in after.items():
        for stages in sorted({p["K"] for p in setting["predictions"]}):
            old = best(before[name]["predictions"], stages, True)
            new = best(setting["predictions"], stages, True)
            other = best(setting["predictions"], stages, False)
            if old is None or new is None or other is None:
                continue
            lines.append(
                f"| {name} | {stages} | {old['samples_per_s']:,.4g} | {new['samples_per_s']:,.4g} ({new['schedule']}) "
                f"| {other['samples_per_s']:,.4g} ({other['schedule']}) | "
                f"{old['samples_per_s'] / other['samples_per_s']:.2f}x | "
                f"**{new['samples_per_s'] / other['samples_per_s']:.2f}x** |"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("before", help="scaling.json of the earlier run")
    parser.add_argument("after", help="scaling.json of the later run")
    args = parser.parse_args(argv)
    with open(args.before) as f, open(args.after) as g:
        print("\n".join(table(json.load(f)["settings"], json.load(g)["settings"])))


if __name__ == "__main__":
    main()
