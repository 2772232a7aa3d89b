"""The staleness metric per stage, as the engine reports it, on docs/results/convergence/lm_convergence.md's GPT-2.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.studies.staleness_metric run --runs fdg_k2_b1.0,fdg_k2_b1.0_stashed_p0.0_first
    python -m benchmarks.studies.staleness_metric report --runs fdg_k2_b1.0,fdg_k2_b1.0_stashed_p0.0_first \\
        --picture docs/results/staleness/staleness_metric_gpt2.png

Each run is benchmarks/convergence/lm_convergence.py's DeepSpeed run of the same name (recipes/train_lm.py on the
FDG engine, one gloo rank per stage, the same model, data order and token budget) with two additions
to its ds_config: ``pipeline.fdg.staleness_every`` = 4, so that every ``train_batch()`` call (4 ticks)
measures one micro-batch on every delayed stage, and DeepSpeed's ``wandb`` block, offline: every
stage logs ``fdg/staleness`` (‖w_fwd − w_bwd‖ / ‖w_bwd‖, docs/staleness.md) into its own W&B run,
which this script reads back from the offline files. Without prediction the metric is the relative
size of the steps the stage took while the micro-batch was in flight; with it, what the prediction
did not foresee.

Writes <out>/<name>/ (the lm_convergence files plus wandb/), out = $STALENESS_METRIC_OUT or
runs/staleness_metric; a run already there is skipped. ``report`` prints, per run and stage, the
median of the metric over three windows of ticks and the final validation loss, and draws the
metric against the tick.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.common.lm_runs import ROOT, Run, finished, parse_run, run_deepspeed

OUT = Path(os.environ.get("STALENESS_METRIC_OUT", ROOT / "runs" / "staleness_metric"))
EVERY = 4  # pipeline.fdg.staleness_every: one measured micro-batch per train_batch() call (GAS 4)
WINDOWS = [(0, 100), (100, 400), (400, 10**9)]  # ticks: the first steps, the middle, the rest


def measured(run: Run) -> Run:
    if run.kind != "deepspeed" or run.stages < 2:
        raise SystemExit(
            f"staleness_metric.py: error: run {run.name!r}: the metric is the engine's; name an FDG DeepSpeed "
            "run (fdg_k<K>_...), not bp or ref_..."
        )
    return run


def run_one(run: Run, micro_batches: int, eval_every: int) -> None:
    def adjust(config: dict) -> None:
        config["pipeline"]["fdg"]["staleness_every"] = EVERY
        config["wandb"] = {"enabled": True, "project": "fdg-staleness-metric", "group": run.name}

    out = OUT / run.name
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(out), WANDB_SILENT="true")
    run_deepspeed(run, micro_batches, eval_every, root=OUT, adjust=adjust)


def stage_series(name: str) -> dict[int, list[tuple[int, float]]]:
    """Stage -> [(tick, staleness)] from the run's per-stage W&B runs (``stage<k>-dp0``)."""
    from fdg_schedule.observability.tracking import read_offline_run

    series: dict[int, list[tuple[int, float]]] = {}
    for folder in sorted((OUT / name / "wandb").glob("offline-run-*")):
        logged = read_offline_run(folder)
        if not (logged.get("name") or "").startswith("stage"):
            continue  # DeepSpeed's own rank-0 run
        stage = int(logged["name"].removeprefix("stage").split("-")[0])
        series[stage] = [(row["fdg/tick"], row["fdg/staleness"]) for row in logged["history"] if "fdg/staleness" in row]
    return series


def final_val_loss(name: str) -> float:
    rows = [json.loads(line) for line in (OUT / name / "metrics.jsonl").read_text().splitlines()]
    return [row["val_loss"] for row in rows if "val_loss" in row][-1]


def report(names: list[str], picture: Path | None) -> None:
    head = " | ".join(f"ticks {a}–{b - 1 if b < 10**9 else 'end'}" for a, b in WINDOWS)
    lines = [f"| run | stage | {head} | val loss |", "|---|---|" + "---:|" * (len(WINDOWS) + 1)]
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for name in names:
        series = curves[name] = stage_series(name)
        val = final_val_loss(name)
        for stage in sorted(series):
            medians = []
            for a, b in WINDOWS:
                values = [v for tick, v in series[stage] if a <= tick < b and v == v]
                medians.append(f"{statistics.median(values):.2e}" if values else "–")
            lines.append(f"| {name} | {stage} | " + " | ".join(medians) + f" | {val:.3f} |")
    print("\n".join(lines))
    if picture is not None:
        draw(curves, picture)


def draw(curves: dict[str, dict[int, list[tuple[int, float]]]], picture: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, series), color in zip(curves.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        for stage, points in sorted(series.items()):
            points = [(tick, v) for tick, v in points if v > 0]  # 0: the last stage, or no step taken yet
            if not points:
                continue
            ticks, values = zip(*points)
            style = ["-", "--", ":", "-."][stage % 4]
            ax.plot(ticks, values, style, color=color, label=f"{name}, stage {stage}", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("tick (micro-batch)")
    ax.set_ylabel("‖w_fwd − w_bwd‖ / ‖w_bwd‖")
    ax.set_title("FDG's staleness metric per stage (engine, W&B fdg/staleness)")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(picture, dpi=120)
    print(f"wrote {picture}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["run", "report"])
    parser.add_argument("--runs", required=True, help="comma-separated FDG DeepSpeed run names (lm_convergence.py's)")
    parser.add_argument("--micro_batches", type=int, default=800)
    parser.add_argument("--eval_every", type=int, default=100, help="micro-batches between evaluations")
    parser.add_argument("--picture", type=Path, default=None)
    args = parser.parse_args()
    runs = [measured(parse_run(name)) for name in args.runs.split(",")]  # a bad name fails before any run
    if args.what == "report":
        report([run.name for run in runs], args.picture)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for run in runs:
        if finished(run.name, root=OUT):
            print(f"{time.strftime('%H:%M:%S')} {run.name}: done already ({OUT / run.name})", flush=True)
            continue
        print(f"{time.strftime('%H:%M:%S')} {run.name}", flush=True)
        run_one(run, args.micro_batches, args.eval_every)


if __name__ == "__main__":
    main()
