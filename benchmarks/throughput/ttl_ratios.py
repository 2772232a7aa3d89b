"""The time-to-loss analysis' K = 2 throughput ratios, FDG over DeepSpeed's 1F1B (GAS 4), from throughput runs.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.ttl_ratios out/ttl_lm_adamw/throughput.json out/ttl_lm_muon/throughput.json \
        out/ttl_resnet_sgd/throughput.json --json out/ttl_ratios.json
    python -m benchmarks.convergence.time_to_loss analyze ... --throughput out/ttl_ratios.json

Each input is a ``benchmarks.throughput.throughput`` report with a ``ttl_<task>`` model (``ttl_lm``, ``ttl_resnet``)
and the variants ``fdg_stashed_stored`` and ``1f1b_m4``; its ``optimizer`` (``--optimizer``; a report without one
stepped SGD) names the row. The output is the plain file ``time_to_loss.throughput_ratio`` reads:

    {"lm_adamw": 1.31, "lm_muon": 1.18, "resnet_sgd": 1.52,
     "lm_adamw_rounds": {"paired": {"median": ..., "min": ..., "max": ..., "ci95": [...]}, "rounds": 7, ...}, ...}

``<task>_<optimizer>``: the ratio of the two variants' median samples/s (as the analysis computes it from a
benchmark file); ``<task>_<optimizer>_rounds`` beside it: the same ratio round by round (each round runs both
variants back to back), its median, range and the median's 95 % interval (from 6 rounds), the rounds, both
variants' samples/s, the source file and the optimizer's settings.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FDG, SYNC = "fdg_stashed_stored", "1f1b_m4"  # the measured FDG mode and the job it replaces
PREFIX = "ttl_"  # bench_models' names of the time-to-loss runs' models
ROUNDS = "_rounds"  # the key suffix of a ratio's rounds, beside it


def ratios(paths: Sequence[Path]) -> dict[str, Any]:
    """``{"<task>_<optimizer>": ratio, "<task>_<optimizer>_rounds": {...}}`` over every ``ttl_`` model of ``paths``."""
    out: dict[str, Any] = {}
    sources: dict[str, Path] = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        optimizer = report.get("optimizer", "sgd")  # reports from before --optimizer stepped SGD
        models = {m: r for m, r in report.get("models", {}).items() if m.startswith(PREFIX)}
        if not models:
            given = sorted(report.get("models", {}))
            raise ValueError(f"{path}: no time-to-loss model in this throughput report (models {given}): run the "
                             "benchmark with --models ttl_lm or ttl_resnet")  # fmt: skip
        for model, result in sorted(models.items()):
            key = f"{model.removeprefix(PREFIX)}_{optimizer}"
            if key in sources:
                raise ValueError(f"{key}: measured in both {sources[key]} and {path}: give one run per task and "
                                 "optimizer")  # fmt: skip
            sources[key] = Path(path)
            out[key], out[key + ROUNDS] = one_ratio(result["variants"], path, model)
            out[key + ROUNDS]["optimizer_settings"] = report.get("optimizer_settings")
    return out


def one_ratio(rows: dict[str, Any], path: Path, model: str) -> tuple[float, dict[str, Any]]:
    """FDG's median samples/s over 1F1B's, and the rounds behind it."""
    missing = [name for name in (FDG, SYNC) if name not in rows]
    if missing:
        raise ValueError(f"{path}: model {model} has no variant {', '.join(missing)} (it has {sorted(rows)}): run "
                         f"the benchmark with --variants {SYNC},{FDG}")  # fmt: skip
    fdg, sync = rows[FDG], rows[SYNC]
    rounds = {
        "paired": fdg["ratio_vs_1f1b_m4"],  # FDG / 1F1B in each round
        "rounds": len(fdg["samples_per_s_all"]),
        f"{FDG}_samples_per_s": fdg["samples_per_s"],
        f"{SYNC}_samples_per_s": sync["samples_per_s"],
        "source": str(path),
        "model": model,
    }
    return fdg["samples_per_s"]["median"] / sync["samples_per_s"]["median"], rounds


def table(found: dict[str, Any]) -> str:
    """One line per ratio: the ratio, and the rounds' median [min–max] (95 % CI)."""
    lines = []
    for key in sorted(k for k in found if not k.endswith(ROUNDS)):
        paired = found[key + ROUNDS]["paired"]
        ci = paired.get("ci95")
        interval = f" (95 % CI {ci[0]:.3f}–{ci[1]:.3f})" if ci else ""
        lines.append(f"{key}: {found[key]:.3f}; by round {paired['median']:.3f} [{paired['min']:.3f}–"
                     f"{paired['max']:.3f}]{interval} over {found[key + ROUNDS]['rounds']} rounds")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="throughput.json files of the benchmark")
    parser.add_argument("--json", type=Path, default=None, help="write the ratios here (the analysis' --throughput)")
    args = parser.parse_args(argv)
    try:
        found = ratios(args.reports)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    print(table(found), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=1))
        print(f"wrote {args.json}", flush=True)
    return found


if __name__ == "__main__":
    main()
