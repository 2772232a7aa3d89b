"""What the staleness corrections cost per tick on one stage, measured alone on one thread.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.correction_cost                      # resnet32 and transformer, stage 0 of K = 2
    python -m benchmarks.throughput.correction_cost --models resnet8_tiny --repeats 5    # a smoke run

The throughput benchmark (``throughput.py --variants fdg_stashed_stored,fdg_stashed_stored_predict,...``)
runs the corrections inside the pipeline, where two ranks on a shared machine put ±30 % of noise on
every ratio. This one isolates them: stage 0 of the benchmark's balanced K = 2 split of a model
(:mod:`bench_models`), one thread, and a tick as the engine runs it on that stage: a forward (inside
``Corrections.predicted()`` when prediction is on), the backward, and the optimizer step (inside
``Corrections.step``). Variants none / delay_lr / predict / both run interleaved, the order rotating
every round; the report gives each variant's median tick time, its paired ratio to ``none`` and
the bytes its corrections hold (δ, fp32). Stashed weights are not part of the measured tick: the
corrections cost the same with every weights/activations mode. The measurement the docs quote is
docs/results/staleness/correction_cost.{md,json} (written with ``--out docs/results/staleness``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common.bench_models import MODELS, build_layers, fixed_data  # noqa: E402
from benchmarks.common.layer_profile import model_profile  # noqa: E402
from benchmarks.common.throughput_variants import LR, MOMENTUM, split_objective  # noqa: E402
from fdg_schedule.base.config import FDGConfig  # noqa: E402
from fdg_schedule.corrections.staleness import Corrections  # noqa: E402
from fdg_schedule.partitioning.partition import balanced_partition  # noqa: E402

VARIANTS = {
    "none": {},
    "delay_lr": {"delay_lr_ticks": 1024},
    "predict": {"predict_decay": 0.9},
    "both": {"delay_lr_ticks": 1024, "predict_decay": 0.9},
}


class Stage:
    """Stage 0 of a K = 2 split, its optimizer and the corrections of one variant."""

    def __init__(self, layers: list[nn.Module], corrections: dict[str, Any], micro_batch: Any) -> None:
        self.module = nn.Sequential(*layers)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.corrections = Corrections(params, stages=2, stage_id=0, config=FDGConfig(**corrections))
        self.x = micro_batch
        self.tick = 0

    def run_tick(self) -> float:
        start = time.perf_counter()
        with self.corrections.predicted():
            out = self.module(self.x)
        out.float().square().mean().backward()  # a stand-in for the received gradient: same backward work
        with self.corrections.stepping(self.optimizer, self.tick) as step:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            step.taken = True
        self.tick += 1
        return time.perf_counter() - start

    def held_bytes(self) -> int:
        return sum(d.numel() * d.element_size() for d in self.corrections.delta or [])


def measure(model: str, repeats: int, window: int) -> dict[str, Any]:
    torch.manual_seed(0)
    profile = model_profile(model)  # the throughput benchmark's profile and split
    parts = balanced_partition(profile, 2, split_objective("2")).parts
    x = fixed_data(model)[0][0]
    stages = {}
    for name, corrections in VARIANTS.items():
        torch.manual_seed(0)  # the same weights for every variant
        stages[name] = Stage(build_layers(model)[parts[0] : parts[1]], corrections, x)
        for _ in range(3):
            stages[name].run_tick()
    per_round: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            per_round[name].append(statistics.median(stages[name].run_tick() for _ in range(window)))
    rows = {}
    for name in names:
        ratios = [t / base for t, base in zip(per_round[name], per_round["none"])]
        rows[name] = {
            "tick_ms_median": statistics.median(per_round[name]) * 1e3,
            "ratio_vs_none": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "held_bytes": stages[name].held_bytes(),
        }
    params = sum(p.numel() for p in stages["none"].module.parameters())
    return {"parts": parts, "stage0_params": params, "variants": rows}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Measured {report['date']}, {report['machine']}; command:", "", f"    {report['command']}", ""]
    for model, result in report["models"].items():
        lines += [
            f"### {model}: stage 0 of the K = 2 split {result['parts']} ({result['stage0_params']:,} parameters)",
            "",
            "| correction | tick ms (median) | × none, paired median [min–max] | held by the correction MB |",
            "|---|---|---|---|",
        ]
        for name, row in result["variants"].items():
            ratio = row["ratio_vs_none"]
            lines.append(
                f"| {name} | {row['tick_ms_median']:.1f} | {ratio['median']:.3f} [{ratio['min']:.3f}–"
                f"{ratio['max']:.3f}] | {row['held_bytes'] / 2**20:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="resnet32,transformer", help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--window", type=int, default=8, help="ticks per variant per round (their median counts)")
    parser.add_argument("--out", default=str(ROOT / "out" / "correction_cost"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.correction_cost " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    report: dict[str, Any] = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, torch {torch.__version__}",
        "models": {model: measure(model, args.repeats, args.window) for model in args.models.split(",")},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "correction_cost.json").write_text(json.dumps(report, indent=1))
    (out / "correction_cost.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return report


if __name__ == "__main__":
    main()
