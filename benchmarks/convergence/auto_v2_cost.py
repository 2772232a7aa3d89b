"""What one run of issue 64's tasks costs on this machine: CPU-seconds per micro-batch and per evaluation.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.auto_v2_cost --task lm_llama --optimizer adamw --stages 1 --accumulate 4 \
        --micro-batches 128 [--json docs/results/auto_v2/cost/lm_llama_adamw_k1.json]
    python -m benchmarks.convergence.auto_v2_cost --estimate docs/results/auto_v2/cost   # the full test's CPU-hours

A run as issue 63's runner makes one (benchmarks/convergence/time_to_loss.py: its optimizers, schedule, clipping,
evaluation and FDG settings; ``corrections`` "auto" at K > 1), on a task of benchmarks/common/auto_v2_tasks.py, one
process, one thread, timed: the training ticks (evaluations excluded) and one evaluation. A full run's cost is
then ``budget x CAP(K) x per micro-batch + evaluations x per evaluation`` (``estimate``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.common import auto_v2_tasks as tasks
from benchmarks.common.provenance import machine
from benchmarks.convergence import time_to_loss as ttl


def measure(task: str, optimizer: str, stages: int, accumulate: int, micro_batches: int, lr: float) -> dict[str, Any]:
    """Train ``micro_batches`` ticks of one run (no evaluation inside), then time one evaluation."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from fdg_schedule import FDGConfig, fdg_reference

    torch.set_num_threads(1)
    t0 = time.time()
    built = tasks.build(task, 300, stages, micro_batches, "validation")
    setup_s = time.time() - t0
    run = ttl.Run("lm" if tasks.TASKS[task].kind == "lm" else "resnet", optimizer, "bp_a1", lr, 0.0, 300)
    optimizers = [ttl.make_optimizer(run, m) for m in built.modules]
    steps = math.ceil(micro_batches / accumulate)
    schedule = {"total_num_steps": steps, "warmup_num_steps": 1, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1,
                "warmup_type": "linear"}  # fmt: skip
    schedulers = [WarmupCosineLR(o, **schedule) for o in optimizers]
    fdg = FDGConfig(grad_shrink=1.0, weights="stashed", activations="stored", accumulate=accumulate,
                    corrections="auto" if stages > 1 else "none")  # fmt: skip
    t0 = time.process_time()
    wall0 = time.time()
    losses = fdg_reference(built.modules, optimizers, built.batches, built.loss_fn, fdg, drain=True,
                           schedulers=schedulers, clip_grad_norm=ttl.CLIP[run.task])  # fmt: skip
    train_cpu, train_wall = time.process_time() - t0, time.time() - wall0
    t0 = time.process_time()
    loss = ttl.evaluate(built.modules, built.evaluation, built.loss_fn)
    eval_cpu = time.process_time() - t0
    return {
        "task": task, "optimizer": optimizer, "stages": stages, "accumulate": accumulate, "lr": lr,
        "micro_batches": micro_batches, "bounds": built.bounds, "setup_wall_s": setup_s,
        "train_cpu_s": train_cpu, "train_wall_s": train_wall, "cpu_s_per_micro_batch": train_cpu / micro_batches,
        "eval_cpu_s": eval_cpu, "eval_loss": loss, "last_train_loss": losses[-1], "machine": machine(),
    }  # fmt: skip


def estimate(measured: list[dict[str, Any]], budget: dict[str, int] | None = None, eval_every: int = 64, cap: int = 2,
             grid: int = 6, seeds: int = 8, equal: tuple[int, ...] = (4,)) -> dict[str, Any]:  # fmt: skip
    """CPU-hours of the full test from ``measure``'s results: per (task, optimizer) the BP arm (K = 1), FDG at each
    K measured and, at each K in ``equal``, FDG at the baseline's budget (the gap's ``_eq`` arm), each run on the
    ``grid`` lr x warm-up points of the tuning seed and on ``seeds`` report seeds; a baseline (and an ``_eq`` run)
    runs ``budget`` micro-batches (default each task's), FDG ``cap`` x that; an evaluation every ``eval_every``
    micro-batches and one at the end."""
    runs: dict[str, float] = {}
    for m in measured:
        base = (budget or {}).get(m["task"], tasks.TASKS[m["task"]].budget)
        lengths = {"": base * (cap if m["stages"] > 1 else 1)}
        if m["stages"] in equal:
            lengths["_eq"] = base
        for suffix, n in lengths.items():
            runs[f"{m['task']}/{m['optimizer']}/K{m['stages']}{suffix}"] = (
                n * m["cpu_s_per_micro_batch"] + (n // eval_every) * m["eval_cpu_s"]
            )
    total = sum(one * (grid + seeds) for one in runs.values())
    return {"per_run_cpu_s": runs, "runs_per_arm": grid + seeds, "total_cpu_hours": total / 3600}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--task", choices=sorted(tasks.TASKS))
    parser.add_argument("--optimizer", choices=["adamw", "muon", "sgd"])
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=128)
    parser.add_argument("--lr", type=float, default=None, help="default: the middle of issue 63's grid")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--estimate", type=Path, default=None, help="a folder of measurements: the full test's cost")
    args = parser.parse_args()
    if args.estimate is not None:
        result = estimate([json.loads(p.read_text()) for p in sorted(args.estimate.glob("*.json"))])
        for name, sec in result["per_run_cpu_s"].items():
            print(f"{name}: {sec / 60:.1f} CPU-min per run")
        print(f"{result['runs_per_arm']} runs per arm: {result['total_cpu_hours']:.1f} CPU-hours")
        return
    if args.task is None or args.optimizer is None:
        parser.error("--task and --optimizer are needed (or --estimate DIR)")
    lr = args.lr if args.lr is not None else ttl.GRIDS[args.optimizer][1]
    result = measure(args.task, args.optimizer, args.stages, args.accumulate, args.micro_batches, lr)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
