"""What one run of issue 64's tasks costs on this machine: CPU-seconds per micro-batch and per evaluation.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.auto_v2_cost --task lm_llama --optimizer adamw --stages 1 --accumulate 4 \
        --micro-batches 128 [--json out.json]

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


def estimate(per_micro: dict[tuple[str, str, int], float], per_eval: dict[str, float], budget: int = 1024,
             eval_every: int = 64, cap: int = 2, grid: int = 6, seeds: int = 8) -> dict[str, Any]:  # fmt: skip
    """CPU-hours of the full test: per (task, optimizer), the BP arm and FDG at each K measured, each on the
    ``grid`` lr x warm-up points of the tuning seed and the ``seeds`` report seeds; FDG runs ``cap`` x the budget."""
    runs: dict[str, float] = {}
    for (task, optimizer, k), sec in per_micro.items():
        n = budget * (cap if k > 1 else 1)
        one = n * sec + (n // eval_every) * per_eval[task]
        runs[f"{task}/{optimizer}/K{k}"] = one
    total = sum(one * (grid + seeds) for one in runs.values())
    return {"per_run_cpu_s": runs, "runs_per_arm": grid + seeds, "total_cpu_hours": total / 3600}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--task", choices=sorted(tasks.TASKS), required=True)
    parser.add_argument("--optimizer", choices=["adamw", "muon", "sgd"], required=True)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=128)
    parser.add_argument("--lr", type=float, default=None, help="default: the middle of issue 63's grid")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    lr = args.lr if args.lr is not None else ttl.GRIDS[args.optimizer][1]
    result = measure(args.task, args.optimizer, args.stages, args.accumulate, args.micro_batches, lr)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
