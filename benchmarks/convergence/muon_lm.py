"""FDG with Muon on the LM tasks (issue 44): BP-Muon against FDG-Muon at K = 2 and 4, AdamW beside them.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.muon_lm run      # the queue; the same command continues a stopped one
    python -m benchmarks.convergence.muon_lm report   # docs/results/muon/report.{md,json} from the run files

The protocol is the auto test's (benchmarks/convergence/auto_test.py, docs/results/auto-preregistration.md): the
same two LM tasks (the LLaMA-style model on the King James Bible, 2 epochs; the benchmark's GPT-2 on Shakespeare, 3
epochs), the same data, splits, micro-batch 8, clipping 1.0, WarmupCosineLR with BP's frozen warm-up (10 % of
the steps), K = 4 split, ``weights: "stashed"``, ``grad_shrink`` 1, every arm on ``fdg_reference`` in one
process (K = 1 is plain backprop). Only the optimizer differs: DeepSpeed's Muon (``MuonWithAuxAdam``, built
as ``deepspeed.initialize`` builds it from ``{"type": "Muon"}``: the blocks' matrices on Muon, embeddings,
head, norms and biases on its Adam half, tagged by DeepSpeed's own ``set_optimizer_flags``) with the recipe's
settings (recipes/train_lm.py ``--optimizer muon``): momentum 0.95, the Adam half at AdamW's lr 1e-3, betas
(0.9, 0.95), eps 1e-8, weight decay 0.1 on both halves.

Order, fixed before any run:
1. BP-Muon's Muon lr, chosen per task on seed 99 among 0.01, 0.02, 0.04 (validation loss), then frozen.
2. Seeds 100-104 (the auto test's seeds, so the AdamW rows of its queue pair with these by seed), per seed:
   ``bp_muon`` (K = 1), ``muon_k4`` and ``muon_k2`` (FDG, ``corrections: "auto"``, rule v1, now ``"auto-v1"``: for
   Muon it chooses no correction, so these are also the ``"none"`` arms; each run file records the rule's line), and
   the AdamW K = 2 arms ``adamw_k2_none`` / ``adamw_k2_auto``. BP-AdamW and AdamW K = 4 (``none``, ``auto``) are the
   auto test's run files of the same seed (docs/results/auto/runs).
   Added after the runs began (2026-12-06; no run was chosen or dropped by it): where the auto test's BP-AdamW
   of a seed ran on another processor than the seed's Muon arms (so no arm of this queue pairs with it) and this
   machine is the Muon arms' processor, this queue runs BP-AdamW itself (``bp_adamw_here``: ``auto_test.one_run``
   of arm ``bp``, with its frozen warm-up) after every other run; the rows of this queue's arms against BP-AdamW
   use it for that seed. The auto test's own AdamW K = 4 rows keep its BP-AdamW.
   Added the same way (2026-12-06, before any of these runs): where the auto test's BP-AdamW of a seed ran on
   this machine and the seed's Muon arms on another, this queue reruns here the arms it compares with BP-AdamW
   (``<arm>_here``: ``bp_muon``, ``muon_k4``, ``adamw_k2_none``, ``adamw_k2_auto``, same seed, same lr); only
   the rows against BP-AdamW use them, every other row keeps the arm's first run.
3. The report: per task and arm, the paired relative differences of the test loss (%), their mean, sd and
   the one-sided 95 % upper bound (Student t), as the auto test computes them. Target: FDG-Muon at K = 4
   within 1 % of BP-Muon (bound below +1 %); and FDG-Muon K = 4 against BP-AdamW.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.common import provenance
from benchmarks.common.optimizers import muon  # also muon_lm.muon to time_to_loss.py and candidates_screen.py
from benchmarks.common.stats import t_quantile
from benchmarks.convergence import auto_test

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results" / "muon" / "runs"
REPORT = ROOT / "docs" / "results" / "muon" / "report"
AUTO_RUNS = ROOT / "docs" / "results" / "auto" / "runs"
TASKS = ("llama", "gpt2")
TUNING_SEED, TUNING_LRS = 99, (0.01, 0.02, 0.04)
SEEDS = tuple(range(100, 105))
ARMS = ("bp_muon", "muon_k4", "muon_k2", "adamw_k2_none", "adamw_k2_auto")
BP_ADAMW_HERE = "bp_adamw_here"  # BP-AdamW run by this queue where the auto test's ran on another processor
HERE = "_here"  # an arm of this queue rerun on the processor the auto test's BP-AdamW of the seed ran on


def arm_setup(arm: str) -> tuple[int, str, str | None]:
    """(stages, optimizer, corrections) of an arm; tuning arms are ``bp_lr<x>``."""
    if arm.startswith("bp"):
        return 1, "muon", None
    optimizer, k, *rest = arm.split("_")
    return int(k[1:]), optimizer, (rest[0] if rest else "auto")


def run_lm(task: str, arm: str, seed: int, muon_lr: float) -> dict[str, Any]:
    """One run of the auto test's LM protocol with the arm's optimizer and K.

    The data order, schedule, FDG block and evaluation restate ``auto_test.run_lm`` line for line rather than
    parameterise it: that runner is pre-registered (docs/results/auto-preregistration.md) and stays unchanged
    while its test runs."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR
    from transformers import LlamaConfig

    from fdg_schedule import FDGConfig, fdg_reference
    from fdg_schedule.corrections import auto_corrections
    from fdg_schedule.zoo import hf_lm

    torch.set_num_threads(1)
    train, val, test = auto_test.lm_data(task, smoke=False)
    torch.manual_seed(seed)
    config = LlamaConfig(**auto_test.LLAMA) if task == "llama" else hf_lm.load_config(auto_test.GPT2_MODEL)
    layers = hf_lm.pipeline_layers(hf_lm.build_model(config))
    stages, optimizer, corrections = arm_setup(arm)
    bounds = hf_lm.stage_bounds(layers, stages)
    modules = [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(stages)]
    if optimizer == "muon":
        optimizers = [muon(m, muon_lr) for m in modules]
    else:
        optimizers = [
            torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) for m in modules
        ]
    epochs, per_epoch = int(auto_test.LM[task]["epochs"]), len(train) // 8
    steps = epochs * per_epoch
    schedule = {"total_num_steps": steps, "warmup_num_steps": steps // 10, "warmup_min_ratio": 0.0,
                "cos_min_ratio": 0.1, "warmup_type": "linear"}  # fmt: skip
    schedulers = [WarmupCosineLR(o, **schedule) for o in optimizers]
    batches = []
    for epoch in range(epochs):  # auto_test.run_lm's order
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        for i in range(per_epoch):
            block = torch.stack([train[j][0] for j in order[i * 8 : i * 8 + 8]])
            batches.append((block, block))
    fdg = FDGConfig()
    choice = None
    if corrections is not None:
        rule = "auto-v1" if corrections == "auto" else corrections  # the rule these runs ran (v1: Muon uncorrected)
        fdg = FDGConfig(grad_shrink=1.0, weights="stashed", activations="stored", accumulate=1, corrections=rule)
        if rule == "auto-v1":
            fdg, made = auto_corrections.resolve(fdg, optimizers[0], schedulers[0], stages)
            choice = made.line() if made is not None else None
    start = time.time()
    losses = fdg_reference(modules, optimizers, batches, hf_lm.lm_loss, fdg, drain=True,
                           schedulers=schedulers, clip_grad_norm=1.0)  # fmt: skip
    if not all(math.isfinite(v) for v in losses):
        return {"failed": "non-finite training loss", "train_s": time.time() - start}
    return {
        "test": auto_test.lm_loss_on(modules, test),
        "validation": auto_test.lm_loss_on(modules, val),
        "train_loss_last_100": sum(losses[-100:]) / len(losses[-100:]),
        "auto_choice": choice,
        "corrections": {key: getattr(fdg, key) for key in auto_corrections.CORRECTION_KEYS},
        "bounds": bounds,
        "train_ticks": len(batches),
    }


def path(out: Path, task: str, arm: str, seed: int) -> Path:
    return out / task / f"{arm}_s{seed}.json"


def read(file: Path) -> dict[str, Any] | None:
    return json.loads(file.read_text()) if file.exists() else None


def tuned_lr(out: Path, task: str) -> float | None:
    """BP-Muon's Muon lr for ``task``: the tuning run with the lowest validation loss (None until all ran)."""
    runs = {lr: read(path(out, task, f"bp_lr{lr}", TUNING_SEED)) for lr in TUNING_LRS}
    if any(r is None for r in runs.values()):
        return None
    finite = {lr: r["validation"] for lr, r in runs.items() if r is not None and "validation" in r}
    return min(finite, key=lambda lr: finite[lr])


def plan(out: Path, auto_runs: Path = AUTO_RUNS) -> list[tuple[str, str, int, float | None]]:
    """Every run still to do, in order: per task, the tuning runs, then each seed's arms."""
    todo: list[tuple[str, str, int, float | None]] = []
    for task in TASKS:
        todo += [(task, f"bp_lr{lr}", TUNING_SEED, lr) for lr in TUNING_LRS]
        todo += [(task, arm, seed, None) for seed in SEEDS for arm in ARMS]
    here = provenance.machine()
    for task in TASKS:
        for seed in SEEDS:  # BP-AdamW where the auto test's ran on another processor than this seed's Muon arms
            theirs, ours = read(auto_test.run_path(auto_runs, task, "bp", seed)), read(path(out, task, "muon_k4", seed))
            if theirs is None or ours is None or theirs["machine"] == ours["machine"]:
                continue
            if ours["machine"] == here:
                todo.append((task, BP_ADAMW_HERE, seed, None))
            elif theirs["machine"] == here:  # the other way round: this queue's arms, rerun here
                todo += [(task, arm + HERE, seed, None) for arm in AGAINST_BP_ADAMW]
    return [t for t in todo if not path(out, t[0], t[1], t[2]).exists()]


def queue(out: Path, auto_runs: Path = AUTO_RUNS) -> None:
    while todo := plan(out, auto_runs):
        task, arm, seed, lr = todo[0]
        if arm == BP_ADAMW_HERE:  # the auto test's own BP-AdamW run, with its frozen warm-up choice
            print(f"muon_lm: {task} {arm} seed {seed} (the auto test's BP-AdamW)", flush=True)
            warmup = auto_test.selection(auto_runs, task)
            assert warmup is not None, "the auto test's BP-AdamW of this seed ran, so its selection did"
            record = {**auto_test.one_run(task, "bp", seed, warmup, smoke=False), "arm": BP_ADAMW_HERE}
        else:
            lr = lr if lr is not None else tuned_lr(out, task)
            assert lr is not None, "the plan runs a task's tuning first"
            print(f"muon_lm: {task} {arm} seed {seed} (muon lr {lr})", flush=True)
            start = time.time()
            result = run_lm(task, arm.removesuffix(HERE), seed, lr)
            record = {"task": task, "arm": arm, "seed": seed, "muon_lr": lr, "wall_s": time.time() - start,
                      "machine": provenance.machine(), "commit": provenance.commit(), **result}  # fmt: skip
        file = path(out, task, arm, seed)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(record, indent=1) + "\n")


def paired(a: dict[int, dict | None], b: dict[int, dict | None]) -> dict[str, Any]:
    """Relative paired differences (a - b) / b of the test loss, %, over the seeds both have (same machine)."""
    diffs = []
    for seed in SEEDS:
        x, y = a.get(seed), b.get(seed)
        if x is None or y is None or "test" not in x or "test" not in y or x["machine"] != y["machine"]:
            continue
        diffs.append((x["test"] - y["test"]) / y["test"] * 100)
    stats: dict[str, Any] = {"n": len(diffs), "differences": diffs}
    if len(diffs) >= 2:
        n, mean = len(diffs), sum(diffs) / len(diffs)
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        stats.update(mean=mean, sd=sd, upper_95=mean + t_quantile(0.95, n - 1) * sd / math.sqrt(n))
    return stats


COMPARISONS = (  # (row, arm, against); "adamw_*" of K = 4 and "bp_adamw" are the auto test's files
    ("FDG-Muon K=4 vs BP-Muon (target: bound < +1 %)", "muon_k4", "bp_muon"),
    ("FDG-Muon K=2 vs BP-Muon", "muon_k2", "bp_muon"),
    ("FDG-Muon K=4 vs BP-AdamW", "muon_k4", "bp_adamw"),
    ("BP-Muon vs BP-AdamW", "bp_muon", "bp_adamw"),
    ('FDG-AdamW K=4 "none" vs BP-AdamW', "adamw_k4_none", "bp_adamw"),
    ('FDG-AdamW K=4 "auto" vs BP-AdamW', "adamw_k4_auto", "bp_adamw"),
    ('FDG-AdamW K=2 "none" vs BP-AdamW', "adamw_k2_none", "bp_adamw"),
    ('FDG-AdamW K=2 "auto" vs BP-AdamW', "adamw_k2_auto", "bp_adamw"),
)
AUTO_TEST_ARMS = {"bp_adamw": "bp", "adamw_k4_none": "none", "adamw_k4_auto": "auto"}
AGAINST_BP_ADAMW = tuple(  # this queue's arms in the rows against BP-AdamW: the ones rerun ``HERE``
    arm for _, arm, against in COMPARISONS if against == "bp_adamw" and arm not in AUTO_TEST_ARMS
)


def runs_of(
    out: Path, auto_runs: Path, task: str, arm: str, for_arm: str = "", against: str = ""
) -> dict[int, dict | None]:
    """An arm's run per seed. BP-AdamW compared with an arm of this queue (``for_arm``) is this queue's own
    BP-AdamW run where there is one, else the auto test's; an arm of this queue compared ``against`` BP-AdamW
    is its rerun on BP-AdamW's processor where there is one, else its run (see the module's order, step 2)."""
    if arm in AUTO_TEST_ARMS:
        theirs = {s: read(auto_test.run_path(auto_runs, task, AUTO_TEST_ARMS[arm], s)) for s in SEEDS}
        if arm != "bp_adamw" or for_arm in AUTO_TEST_ARMS:
            return theirs
        here = {s: read(path(out, task, BP_ADAMW_HERE, s)) for s in SEEDS}
        return {s: here[s] or theirs[s] for s in SEEDS}
    runs = {s: read(path(out, task, arm, s)) for s in SEEDS}
    if against == "bp_adamw" and arm in AGAINST_BP_ADAMW:
        return {s: read(path(out, task, arm + HERE, s)) or runs[s] for s in SEEDS}
    return runs


def report(out: Path, auto_runs: Path) -> dict[str, Any]:
    lines = ["| task | comparison (test loss, relative) | n of 5 | mean | sd | one-sided 95 % upper bound |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    result: dict[str, Any] = {"commit": provenance.commit(), "tasks": {}}
    for task in TASKS:
        entry: dict[str, Any] = {"muon_lr": tuned_lr(out, task), "comparisons": {}}
        for row, arm, against in COMPARISONS:
            ours = runs_of(out, auto_runs, task, arm, against=against)
            stats = paired(ours, runs_of(out, auto_runs, task, against, for_arm=arm))
            entry["comparisons"][row] = stats
            shown = lambda key, s=stats: f"{s[key]:+.2f} %" if key in s else "–"  # noqa: E731
            lines.append(f"| {task} | {row} | {stats['n']} | {shown('mean')} | {shown('sd')} | {shown('upper_95')} |")
        result["tasks"][task] = entry
    result["table"] = "\n".join(lines)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["run", "report"])
    parser.add_argument("--out", type=Path, default=OUT, help="the run files (docs/results/muon/runs)")
    parser.add_argument("--auto-runs", type=Path, default=AUTO_RUNS, help="the auto test's run files (AdamW rows)")
    args = parser.parse_args()
    if args.what == "run":
        queue(args.out, args.auto_runs)
        return
    result = report(args.out, args.auto_runs)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    REPORT.with_suffix(".md").write_text(result["table"] + "\n")
    print(result["table"])


if __name__ == "__main__":
    main()
