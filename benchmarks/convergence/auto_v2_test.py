"""Issue 64's pre-registered test of correction rule v2: FDG with ``"auto"`` against backprop on held-out tasks.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.auto_v2_test run --out /work/auto_v2_runs [--pause-while /work/QUIET]
    python -m benchmarks.convergence.auto_v2_test status --out /work/auto_v2_runs
    python -m benchmarks.convergence.auto_v2_test one lm_llama_adamw/bp_lr0.001_w0_s400 --out /work/auto_v2_runs
    python -m benchmarks.convergence.auto_v2_test analyze --out /work/auto_v2_runs --json r.json --markdown r.md
    python -m benchmarks.convergence.auto_v2_test power [--sd-log-r 0.05] [--sd-gap 0.3 | --screen DIR]

docs/results/auto-v2-preregistration.md fixes everything here before any run; the constants below are what it
fixes. The FDG arms run ``"auto-v2"`` (``"auto"`` names the newest rule, which may change after the test), as the
code at the queue's commit defines it: each FDG run file records the rule's version, its log line and the keys it
resolved per stage.

Tasks (benchmarks/common/auto_v2_tasks.py): ``lm_llama`` (LLaMA-style, the kernel's documentation) and ``lm_gpt2``
(GPT-2-style, a joined text) with AdamW and Muon, ``vgg`` (a VGG-style net on MNIST images no run used) with SGD
with momentum; K = 4 and K = 8 for each. Every run is one process on ``fdg_reference`` (equal to the DeepSpeed
engine tick by tick, tested), one thread.

Arms: ``bp``: backprop, K = 1, one micro-batch per step (FDG's optimizer steps with ``accumulate`` 1); ``fdg_k4``,
``fdg_k8``: FDG as a user switching by config gets it (``weights`` "stashed", ``activations`` "stored",
``grad_shrink`` 1, ``accumulate`` 1, ``corrections`` "auto-v2"); with ``--bp-a4`` also ``bp_a4`` (K = 1, 4
micro-batches per step: DeepSpeed's 1F1B at GAS 4); ``fdg_k4_eq``: FDG at K = 4 (each K with a gap margin) run
as ``fdg_k4`` for the baseline's budget, for the final-loss gap. A baseline and an ``_eq`` arm run ``BUDGET[task]``
micro-batches, FDG ``CAP`` x that (each run's lr schedule spans its own run, so an ``_eq`` run anneals where the
baseline does). Every run evaluates every ``BUDGET[task] / EVALS`` micro-batches and once
after the last (FDG: after the drain): the validation split on the tuning seed, the test split on report seeds.
Tokens (LM) or images (vgg) counted are the micro-batches entered so far.

Tuning (``TUNING_SEED``, validation split): every arm on the same lr x warm-up grid (``GRIDS`` x ``WARMUPS``). A
baseline takes the point with the lowest final validation loss; FDG the point that first reaches the chosen
``bp``'s final validation loss in the fewest tokens (none reaching: the lowest final loss); an ``_eq`` arm, as a
baseline, the lowest final validation loss. Ties: grid order. Amendment 1 (the pre-registration's): where the
chosen point has the grid's highest lr, the arm's grid gains twice that lr (both warm-ups), where it has the lowest,
half of it, and the choice is made again, up to ``EXTEND`` times each way (:func:`grid`); a choice still at an edge
then is reported as such.

Order (the queue): first every configuration's tuning grid (per configuration in ``CONFIGS``: the baselines' grids,
then FDG K = 4's and K = 8's, then ``fdg_k4_eq``'s), then the report seeds ``SEEDS`` configuration by configuration
(per seed: the baselines, then FDG K = 4, K = 8 and ``fdg_k4_eq`` at their chosen points). ``run`` takes the first
run without a file, runs it in a child process (``one``), writes
``<out>/<task>_<optimizer>/<arm>_lr<lr>_w<warm-up>_s<seed>.json`` when it ends (a failed run writes its error and
counts as done) and goes on; stopped and started again it continues.

Analysis (paired by seed, report seeds, test split), per configuration, K and baseline: r at the baseline's final
test loss (fdg_schedule.plan.token_overhead's measure; a seed not reaching it within the cap enters as "> CAP",
never dropped), its geometric mean, one-sided 95 % upper bound and two-sided 95 % interval (Student t on log r);
the final-loss gap at equal tokens, the ``_eq`` run's final test loss minus the baseline's, in % of the
baseline's, with its mean, one-sided 95 % upper bound and two-sided 95 % interval; each against ``MARGINS``. Also
reported, not judged: FDG's test loss at the baseline's last micro-batch in its ``CAP`` x run (its lr not annealed
there), minus the baseline's final. A failed FDG run fails its row; a failed or missing baseline leaves it
pending; failed runs are listed. A pair is two runs on one processor (``provenance.machine``): a seed whose FDG
run ran elsewhere than its baseline counts as missing until that FDG run is deleted and run again where the
baseline ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import auto_v2_tasks as tasks
from benchmarks.common import curve_runs
from benchmarks.common.curve_runs import read, write_result
from benchmarks.common.provenance import commit
from fdg_schedule.plan import token_overhead as to

ROOT = Path(__file__).resolve().parents[2]

TUNING_SEED = 400  # never used before here
SEEDS = tuple(range(401, 409))  # the report seeds
BUDGET = {"lm_llama": 1024, "lm_gpt2": 1024, "vgg": 1024}  # a baseline's micro-batches, per task
CAP = 2  # FDG's micro-batches = CAP x BUDGET
EVALS = 16  # evaluations in a baseline's run: one every BUDGET / EVALS micro-batches (and one after the last)
STAGES = (4, 8)  # FDG's K
BP_A4_GAS = 4  # the second baseline's micro-batches per step (off unless --bp-a4)
WARMUPS = (0.0, 0.1)  # linear warm-up over this fraction of the run's optimizer steps (0: one step)
GRIDS = {  # the lr grid per optimizer, the same for every arm
    "adamw": (5e-4, 1e-3, 2e-3),
    "muon": (0.01, 0.02, 0.04),  # Muon's lr (its Adam half at 1e-3: optimizers.MUON)
    "sgd": (0.05, 0.1, 0.2),
}
EXTEND = 2  # amendment 1: at most this many doublings (halvings) of an arm's grid where its top (bottom) lr wins
CONFIGS = (  # (task, optimizer) in queue order: the LMs first, cheapest first (docs/results/auto_v2/README.md)
    ("lm_llama", "adamw"),
    ("lm_gpt2", "adamw"),
    ("lm_gpt2", "muon"),
    ("lm_llama", "muon"),
    ("vgg", "sgd"),
)
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SGD = {"momentum": 0.9, "weight_decay": 5e-4}
CLIP = {"adamw": 1.0, "muon": 1.0, "sgd": 0.0}  # gradient clipping by norm per stage (0: off)
# per K, what the one-sided 95 % upper bounds must not exceed: r, and the gap in % (None: no margin)
MARGINS: dict[int, dict[str, float | None]] = {4: {"r": 1.15, "gap": 1.0}, 8: {"r": 1.30, "gap": None}}
FAMILY = {"lm_llama": "llama", "lm_gpt2": "gpt", "vgg": "vgg"}  # token_overhead.Setting's family
EQUAL = "_eq"  # the suffix of FDG's arm at the baseline's budget: fdg_k4_eq
PAUSE_WHILE: Path | None = None  # while this file exists, a run waits between ticks (the machine's quiet periods)


@dataclasses.dataclass(frozen=True)
class Run:
    task: str  # an auto_v2_tasks.TASKS key
    optimizer: str  # "adamw", "muon", "sgd"
    arm: str  # "bp", "bp_a4", "fdg_k<K>"
    lr: float
    warmup: float
    seed: int

    @property
    def stages(self) -> int:
        return int(self.arm[5:].removesuffix(EQUAL)) if self.arm.startswith("fdg_k") else 1

    @property
    def capped(self) -> bool:
        """FDG's long run (CAP x the budget, for r); an ``_eq`` run has the baseline's budget (for the gap)."""
        return self.stages > 1 and not self.arm.endswith(EQUAL)

    @property
    def accumulate(self) -> int:
        return BP_A4_GAS if self.arm == "bp_a4" else 1

    @property
    def micro_batches(self) -> int:
        return BUDGET[self.task] * (CAP if self.capped else 1)

    @property
    def split(self) -> str:
        return "validation" if self.seed == TUNING_SEED else "test"

    @property
    def name(self) -> str:
        return f"{self.task}_{self.optimizer}/{self.arm}_lr{self.lr:g}_w{self.warmup:g}_s{self.seed}"

    def path(self, out: Path) -> Path:
        return out / f"{self.name}.json"

    @staticmethod
    def parse(name: str) -> Run:
        try:
            folder, _, file = name.partition("/")
            task, optimizer = folder.rsplit("_", 1)
            arm, rest = file.split("_lr")
            lr, rest = rest.split("_w")
            warmup, seed = rest.split("_s")
            float(lr), float(warmup), int(seed)
        except ValueError:
            raise ValueError(f"run name {name!r} is not <task>_<optimizer>/<arm>_lr<lr>_w<warm-up>_s<seed> (e.g. "
                             "lm_llama_adamw/bp_lr0.001_w0_s400; `status` prints the next one)") from None  # fmt: skip
        run = Run(task, optimizer, arm, float(lr), float(warmup), int(seed))
        if (task, optimizer) not in CONFIGS or arm not in arms(True):
            known = ", ".join("_".join(c) for c in CONFIGS)
            raise ValueError(f"run name {name!r}: no configuration {task}_{optimizer} with arm {arm!r} (configurations "
                             f"{known}; arms {', '.join(arms(True))})")  # fmt: skip
        return run


def baselines(bp_a4: bool = False) -> tuple[str, ...]:
    return ("bp", "bp_a4") if bp_a4 else ("bp",)


def equal_arms() -> tuple[str, ...]:
    """FDG at the baseline's budget, for the K with a gap margin (the gap's runs)."""
    return tuple(f"fdg_k{k}{EQUAL}" for k in STAGES if MARGINS[k]["gap"] is not None)


def arms(bp_a4: bool = False) -> tuple[str, ...]:
    return baselines(bp_a4) + tuple(f"fdg_k{k}" for k in STAGES) + equal_arms()


# -- one run -------------------------------------------------------------------------------------------------


def make_optimizer(run: Run, module: Any) -> Any:
    import torch

    from benchmarks.common import optimizers

    if run.optimizer == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=run.lr, **ADAMW)  # type: ignore[arg-type]
    if run.optimizer == "muon":
        return optimizers.muon(module, run.lr)
    return torch.optim.SGD(module.parameters(), lr=run.lr, **SGD)  # type: ignore[arg-type]


def one_run(run: Run, budget: int | None = None, evals: int = EVALS, cache: Path = tasks.CACHE) -> dict[str, Any]:
    """Train ``run`` on ``fdg_reference``, evaluating every ``budget / evals`` micro-batches and after the drain;
    the result with its curve. ``budget`` (default ``BUDGET[task]``) and ``evals`` shrink a run for a check."""
    import torch

    from fdg_schedule import FDGConfig
    from fdg_schedule.corrections import auto_corrections

    budget = BUDGET[run.task] if budget is None else budget
    if budget % evals or (budget // evals) % run.accumulate:
        raise ValueError(f"the budget ({budget} micro-batches) must split into {evals} evaluation intervals, "
                         f"each a multiple of {run.accumulate} (the arm's micro-batches per step): fix BUDGET "
                         "or EVALS")  # fmt: skip
    eval_every = budget // evals
    start = time.time()
    torch.set_num_threads(1)
    n = budget * (CAP if run.capped else 1)
    built = tasks.build(run.task, run.seed, run.stages, n, run.split, cache)
    modules = built.modules
    optimizers = [make_optimizer(run, m) for m in modules]
    schedulers = [curve_runs.warmup_cosine(o, math.ceil(n / run.accumulate), run.warmup) for o in optimizers]
    fdg = FDGConfig(grad_shrink=1.0, weights="stashed", activations="stored", accumulate=run.accumulate,
                    corrections="auto-v2" if run.stages > 1 else "none")  # fmt: skip
    choices = [auto_corrections.resolve(fdg, o, s, run.stages)[1] for o, s in zip(optimizers, schedulers)]
    trained = curve_runs.train_curve(modules, optimizers, built.batches, built.loss_fn, fdg, schedulers=schedulers,
                                     clip=CLIP[run.optimizer], evaluation=built.evaluation, per_micro=built.per_micro,
                                     eval_every=eval_every, pause_while=PAUSE_WHILE, start=start)  # fmt: skip
    return {
        **dataclasses.asdict(run),
        "name": run.name,
        "stages": run.stages,
        "accumulate": run.accumulate,
        "budget": budget,
        "micro_batches": n,
        "eval_every": eval_every,
        "split": run.split,
        "bounds": built.bounds,
        "fdg": {k: v for k, v in dataclasses.asdict(fdg).items() if not k.startswith("_")},
        "auto_rule": auto_corrections.RULE_OF["auto-v2"] if run.stages > 1 else None,
        "auto_choice": None if choices[0] is None else choices[0].line(),  # the line rank 0 logs (stage 0's)
        "auto_keys": [None if c is None else c.keys for c in choices],  # what "auto" resolved, per stage
        **trained,
    }


def run_one(out: Path, run: Run) -> dict[str, Any]:
    """``run`` in this process; its result file is written when it ends (an error is written as a failure)."""
    return curve_runs.run_recorded(run.path(out), {**dataclasses.asdict(run), "name": run.name}, lambda: one_run(run))


# -- the queue -----------------------------------------------------------------------------------------------

Pending = tuple[str, str, str, int]  # (task, optimizer, arm, seed): the arm's chosen point at a seed, not known yet


def grid(task: str, optimizer: str, arm: str, out: Path | None = None, seed: int = TUNING_SEED) -> list[Run]:
    """The arm's tuning points: ``GRIDS`` x ``WARMUPS`` in grid order, then (amendment 1, with ``out``) the points
    the results in ``out`` have added so far: while the chosen point has the highest lr in the grid, twice that lr;
    while it has the lowest, half of it; each with both warm-ups, at most ``EXTEND`` times each way."""
    lrs = list(GRIDS[optimizer])
    points = [Run(task, optimizer, arm, lr, w, seed) for lr in lrs for w in WARMUPS]
    up = down = 0
    while out is not None and (index := _pick(out, task, optimizer, arm, points)) is not None:
        lr = points[index].lr
        if lr == max(lrs) and up < EXTEND:
            added, up = 2 * lr, up + 1
        elif lr == min(lrs) and down < EXTEND:
            added, down = lr / 2, down + 1
        else:
            break
        lrs.append(added)
        points += [Run(task, optimizer, arm, added, w, seed) for w in WARMUPS]
    return points


def choose(out: Path, task: str, optimizer: str, arm: str) -> Run | None:
    """The arm's grid point (the module docstring's rule); None until its grid, with the points amendment 1 adds
    (and, for FDG, bp's choice), is in."""
    points = grid(task, optimizer, arm, out)
    index = _pick(out, task, optimizer, arm, points)
    return None if index is None else points[index]


def at_edge(out: Path, task: str, optimizer: str, arm: str) -> bool:
    """The arm's choice has its grid's highest or lowest lr after amendment 1's extensions: its best lr may lie
    beyond what was tried (reported)."""
    points, chosen = grid(task, optimizer, arm, out), choose(out, task, optimizer, arm)
    return chosen is not None and chosen.lr in (max(p.lr for p in points), min(p.lr for p in points))


def _pick(out: Path, task: str, optimizer: str, arm: str, points: list[Run]) -> int | None:
    """The index of the chosen point among ``points``; None until each has a result (and, for FDG, bp's choice)."""
    results = [read(r.path(out)) for r in points]
    if any(r is None for r in results):
        return None
    if not arm.startswith("fdg") or arm.endswith(EQUAL):
        return curve_runs.pick(results)
    base = choose(out, task, optimizer, "bp")
    base_result = read(base.path(out)) if base is not None else None
    if base_result is None:
        return None
    if "failed" in base_result:
        return curve_runs.pick(results)
    return curve_runs.pick(results, float(base_result["final"]))


def queue_order(out: Path, bp_a4: bool = False) -> list[Run | Pending]:
    """Every run in queue order: all tuning grids, then the report seeds configuration by configuration."""
    order: list[Run | Pending] = []
    for task, optimizer in CONFIGS:
        for arm in arms(bp_a4):
            order += grid(task, optimizer, arm, out)
    for task, optimizer in CONFIGS:
        chosen = {arm: choose(out, task, optimizer, arm) for arm in arms(bp_a4)}
        for seed in SEEDS:
            for arm, point in chosen.items():
                order.append((task, optimizer, arm, seed) if point is None else dataclasses.replace(point, seed=seed))
    return order


def next_run(out: Path, bp_a4: bool = False) -> Run | None:
    """The first run in queue order without a file (a report run whose point is not chosen yet is skipped: its
    grid comes earlier in the order, so it is chosen before the queue gets there)."""
    return next((i for i in queue_order(out, bp_a4) if isinstance(i, Run) and not i.path(out).exists()), None)


def child_command(out: Path, run: Run) -> list[str]:
    """The command that runs ``run`` in its own process (``one``)."""
    pause = [] if PAUSE_WHILE is None else ["--pause-while", str(PAUSE_WHILE)]
    return [sys.executable, "-m", "benchmarks.convergence.auto_v2_test", "one", run.name, "--out", str(out), *pause]


def queue(out: Path, limit: int | None = None, bp_a4: bool = False) -> None:
    """Run every run not done, one at a time in a child process, in queue order; stops when all are done."""
    lock = curve_runs.lock_queue(out, "auto_v2_test.py")  # noqa: F841 - held until the process ends
    done = 0
    while (run := next_run(out, bp_a4)) is not None and (limit is None or done < limit):
        curve_runs.wait_while(PAUSE_WHILE)
        started = time.time()
        subprocess.run(child_command(out, run), cwd=ROOT, check=False)
        result = read(run.path(out))
        if result is None:  # the child died before writing: record it so the queue does not loop on it
            result = curve_runs.failed({**dataclasses.asdict(run), "name": run.name}, "the run's process died")
            write_result(run.path(out), result)
        state = "FAILED" if "failed" in result else f"final {result['final']:.4f}"
        print(f"{time.strftime('%F %T')} {run.name}: {state} ({time.time() - started:.0f} s)", flush=True)
        done += 1
    if next_run(out, bp_a4) is None:
        print(f"{time.strftime('%F %T')} every run is done", flush=True)


def status(out: Path, bp_a4: bool = False) -> str:
    order = queue_order(out, bp_a4)
    runs = [i for i in order if isinstance(i, Run)]
    done = [r for r in runs if r.path(out).exists()]
    failed = [r.name for r in done if "failed" in (read(r.path(out)) or {})]
    walls = [w for r in done if (w := (read(r.path(out)) or {}).get("wall_s"))]
    lines = [f"{len(done)} of {len(order)} runs done ({len(order) - len(runs)} wait for their grid's choice), "
             f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}"]  # fmt: skip
    if walls:
        lines.append(f"mean wall per run so far {statistics.fmean(walls):.0f} s")
    nxt = next_run(out, bp_a4)
    lines.append(f"next: {nxt.name if nxt else 'none'}")
    return "\n".join(lines)


# -- the analysis --------------------------------------------------------------------------------------------


def bounds(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sd, one-sided 95 % upper bound and two-sided 95 % interval (Student t); bounds None below 2 values."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "upper_95": None, "interval_95": None}
    mean = statistics.fmean(values)
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "upper_95": None, "interval_95": None}
    sd = statistics.stdev(values)
    one, two = (to.t_quantile(q, n - 1) * sd / math.sqrt(n) for q in (0.95, 0.975))
    return {"n": n, "mean": mean, "sd": sd, "upper_95": mean + one, "interval_95": [mean - two, mean + two]}


def gap_at_tokens(baseline: dict[str, Any], fdg: dict[str, Any]) -> float:
    """FDG's loss at the baseline's last evaluated tokens minus the baseline's final loss, in % of the latter (from
    FDG's CAP x run, whose lr has not annealed there: reported, not judged)."""
    tokens, final = baseline["val"][-1][0], float(baseline["final"])
    return (to.value_at(fdg["val"], tokens) - final) / final * 100


def final_gap(baseline: dict[str, Any], fdg: dict[str, Any]) -> float:
    """FDG's final loss minus the baseline's, in % of the latter: both runs of the same budget (the ``_eq`` arm)."""
    final = float(baseline["final"])
    return (float(fdg["final"]) - final) / final * 100


def verdict(bound: float | None, margin: float | None, complete: bool, fdg_failed: bool) -> str:
    """pass / fail against ``margin`` (None: no margin, "–"); "pending" until every planned pair is in."""
    if margin is None:
        return "–"
    if fdg_failed:
        return "fail"
    if not complete or bound is None:
        return "pending"
    return "pass" if bound <= margin else "fail"


Pair = tuple[dict[str, Any], dict[str, Any]]


def _pair(out: Path, base: Run, other: Run, seed: int) -> Pair | list[dict[str, str]] | None:
    """The two runs of a seed; None if one is missing or the two ran on different processors (not a pair: rerun
    the FDG run where the baseline ran), the failures if one failed."""
    runs = (dataclasses.replace(base, seed=seed), dataclasses.replace(other, seed=seed))
    results = [read(r.path(out)) for r in runs]
    if results[0] is None or results[1] is None or results[0].get("machine") != results[1].get("machine"):
        return None
    bad = [{"run": r.name, "failed": str(x["failed"])[-300:]} for r, x in zip(runs, results) if "failed" in x]
    return bad or (results[0], results[1])


def compare(out: Path, task: str, optimizer: str, k: int, base: str) -> dict[str, Any] | None:
    """FDG at K against one baseline over the report seeds (paired by seed): r from the CAP x runs and, where K has
    a gap margin, the final-loss gap from the ``_eq`` runs; None until the baseline's and FDG's choices are made."""
    b, d = choose(out, task, optimizer, base), choose(out, task, optimizer, f"fdg_k{k}")
    if b is None or d is None:
        return None
    equal = f"fdg_k{k}{EQUAL}" if f"fdg_k{k}{EQUAL}" in equal_arms() else None
    e = choose(out, task, optimizer, equal) if equal else None
    pairs, labels, at_tokens, failed, missing = [], [], [], [], []
    gaps, gap_failed, gap_missing = [], [], []
    for seed in SEEDS:
        got = _pair(out, b, d, seed)
        if got is None:  # not run yet, or not on the baseline's processor
            missing.append(seed)
        elif isinstance(got, list):
            failed += got
        else:
            pairs.append((got[0]["val"], got[1]["val"]))
            labels.append((dataclasses.replace(b, seed=seed).name, dataclasses.replace(d, seed=seed).name))
            at_tokens.append(gap_at_tokens(*got))
        if equal:
            eq = None if e is None else _pair(out, b, e, seed)
            if eq is None:
                gap_missing.append(seed)
            elif isinstance(eq, list):
                gap_failed += eq
            else:
                gaps.append(final_gap(*eq))
    fdg_failed = any(f["run"].split("/")[1].startswith("fdg") for f in failed)
    complete = not missing and not failed
    row: dict[str, Any] = {"baseline": base, "n_planned": len(SEEDS), "missing_seeds": missing, "failed": failed}
    margin = MARGINS[k]
    if pairs:
        m = to.measure(pairs, labels, to.Setting(FAMILY[task], optimizer, k, "auto-v2", 1, BP_A4_GAS if base ==
                                                 "bp_a4" else 1))  # fmt: skip
        row.update(m.to_dict())
        up = m.final.upper if m.final.r is not None else None
        beyond = m.final.r is None  # a seed beyond the cap: nothing bounds r from above
        row["r_verdict"] = verdict(up, margin["r"], complete, fdg_failed or beyond)
    else:
        row.update({"n": 0, "reached": 0, "r": None, "r_at_least": None, "upper_95": None, "interval_95": None})
        row["r_verdict"] = verdict(None, margin["r"], False, fdg_failed)
    row["gap_at_tokens"] = {"per_seed": at_tokens, **bounds(at_tokens)}  # reported, not judged
    if equal:
        eq_failed = any(f["run"].split("/")[1].startswith("fdg") for f in gap_failed)
        row["gap"] = {
            "arm": equal,
            "per_seed": gaps,
            "missing_seeds": gap_missing,
            "failed": gap_failed,
            **bounds(gaps),
        }
        row["gap_verdict"] = verdict(row["gap"]["upper_95"], margin["gap"], not gap_missing and not gap_failed,
                                     eq_failed)  # fmt: skip
    else:
        row["gap"] = {"arm": None, "per_seed": [], "missing_seeds": [], "failed": [], **bounds([])}
        row["gap_verdict"] = verdict(None, margin["gap"], True, False)
    row["margins"] = margin
    return row


def auto_choices(out: Path, task: str, optimizer: str) -> list[str]:
    """The distinct lines "auto" logged in the configuration's FDG tuning runs (the rule at the queue's commit)."""
    lines = set()
    for k in STAGES:
        for run in grid(task, optimizer, f"fdg_k{k}", out):
            result = read(run.path(out))
            if result is not None and result.get("auto_choice"):
                lines.add(str(result["auto_choice"]))
    return sorted(lines)


def analyze(out: Path, bp_a4: bool = False) -> dict[str, Any]:
    """Per configuration and K: the choices, r and the gap against each baseline, verdicts, failed runs."""
    report: dict[str, Any] = {"commit": commit(), "seeds": list(SEEDS), "tuning_seed": TUNING_SEED, "configs": []}
    for task, optimizer in CONFIGS:
        chosen = {arm: choose(out, task, optimizer, arm) for arm in arms(bp_a4)}
        entry: dict[str, Any] = {
            "task": task,
            "optimizer": optimizer,
            "chosen": {a: None if c is None else {"lr": c.lr, "warmup": c.warmup} for a, c in chosen.items()},
            "grid": {arm: [{"lr": r.lr, "warmup": r.warmup, "final": curve_runs.score(read(r.path(out)))}
                           for r in grid(task, optimizer, arm, out) if r.path(out).exists()] for arm in arms(bp_a4)},
            "at_edge": [arm for arm in arms(bp_a4) if at_edge(out, task, optimizer, arm)],
            "auto_choices": auto_choices(out, task, optimizer),
            "K": {},
        }  # fmt: skip
        for k in STAGES:
            entry["K"][str(k)] = {base: compare(out, task, optimizer, k, base) for base in baselines(bp_a4)}
        report["configs"].append(entry)
    runs = [i for i in queue_order(out, bp_a4) if isinstance(i, Run)]
    report["failed_runs"] = [{"run": r.name, "failed": str(x["failed"])[-300:]} for r in runs
                             if (x := read(r.path(out))) is not None and "failed" in x]  # fmt: skip
    report["markdown"] = markdown(report)
    return report


def _num(value: float | None, digits: int = 3, sign: str = "") -> str:
    return "–" if value is None else f"{value:{sign}.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| task | optimizer | K | baseline | n (reached) of planned | r | r one-sided 95 % upper | r two-sided 95 % | "
        "r margin | r | gap % | gap one-sided 95 % upper | gap two-sided 95 % | gap margin | gap | "
        "gap at the baseline's tokens in FDG's 2x run (not judged) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["configs"]:
        for k, rows in e["K"].items():
            for base, row in rows.items():
                head = f"| {e['task']} | {e['optimizer']} | {k} | {base} |"
                margin = MARGINS[int(k)]
                r_margin = f"≤ {margin['r']:g}"
                gap_margin, gap_pending = ("–", "–") if margin["gap"] is None else (f"≤ +{margin['gap']:g}", "pending")
                if row is None:
                    lines.append(head + f" 0 of {len(SEEDS)} | – | – | – | {r_margin} | pending | – | – | – | "
                                 f"{gap_margin} | {gap_pending} | – |")  # fmt: skip
                    continue
                if row["r"] is None and row["r_at_least"] is not None:  # a seed beyond the cap
                    r = up = f"> {row['r_at_least']:.3f}"
                else:
                    r, up = _num(row["r"]), _num(row["upper_95"])
                iv = "–" if row["interval_95"] is None else "–".join(f"{v:.3f}" for v in row["interval_95"])
                g = row["gap"]
                giv = "–" if g["interval_95"] is None else " to ".join(f"{v:+.2f}" for v in g["interval_95"])
                gap_cells = f"{_num(g['mean'], 2, '+')} | {_num(g['upper_95'], 2, '+')} | {giv} | {gap_margin}"
                at = _num(row["gap_at_tokens"]["mean"], 2, "+")
                lines.append(f"{head} {row['n']} ({row['reached']}) of {row['n_planned']} | {r} | {up} | {iv} | "
                             f"{r_margin} | {row['r_verdict']} | {gap_cells} | {row['gap_verdict']} | "
                             f"{at} |")  # fmt: skip
    edges = [f"{e['task']} {e['optimizer']} `{arm}`" for e in report["configs"] for arm in e.get("at_edge", [])]
    lines += ["", "Choices at an edge of the grid after amendment 1's extensions (the best lr may lie beyond): "
              + (", ".join(edges) if edges else "none")]  # fmt: skip
    failed = report.get("failed_runs") or []
    lines += ["", f"Failed runs: {len(failed)}"] + [f"- `{f['run']}`: {f['failed'].strip().splitlines()[-1]}"
                                                   for f in failed]  # fmt: skip
    return "\n".join(lines)


# -- power ---------------------------------------------------------------------------------------------------


def screen_gaps(folder: Path) -> dict[str, list[float]]:
    """Paired test-loss gaps (%) of the candidates screen's runs (benchmarks/convergence/candidates_screen.py's
    files ``<task>/<optimizer>_k<K>_<arm>_s<seed>.json`` against ``<optimizer>_bp_s<seed>.json``, same machine),
    per ``<task>/<optimizer>_k<K>_<arm>``."""
    groups: dict[str, list[float]] = {}
    for path in sorted(folder.glob("*/*_k*_s*.json")):
        run = json.loads(path.read_text())
        bp = read(path.parent / f"{run['optimizer']}_bp_s{run['seed']}.json")
        if "failed" in run or bp is None or "failed" in bp or bp.get("machine") != run.get("machine"):
            continue
        key = f"{path.parent.name}/{path.name.rsplit('_s', 1)[0]}"
        groups.setdefault(key, []).append((run["test"] - bp["test"]) / bp["test"] * 100)
    return groups


def pooled_sd(groups: dict[str, list[float]]) -> float | None:
    """The pooled standard deviation of the groups with two values or more (None if there is none)."""
    df = sum(len(v) - 1 for v in groups.values() if len(v) > 1)
    if df == 0:
        return None
    return math.sqrt(sum((len(v) - 1) * statistics.variance(v) for v in groups.values() if len(v) > 1) / df)


def power_table(
    sd_log_r: float, sd_gap: float | None, ns: Sequence[int] = (6, 8, 10, 12, 16), draws: int = 20000
) -> str:
    """The power to pass each margin when the truth beats it by a headroom: log r (headroom 2.5 / 5 / 10 % of r)
    and the gap (0.25 / 0.5 / 1 point), per number of seeds."""
    lines = [f"sd of log r {sd_log_r:g}: power at headroom 2.5 / 5 / 10 % of r"]
    for n in ns:
        lines.append(f"  n {n:2d}: " + " / ".join(f"{curve_runs.power(n, sd_log_r, math.log1p(h), draws):.2f}"
                                                  for h in (0.025, 0.05, 0.1)))  # fmt: skip
    if sd_gap is None:
        lines.append("gap: no spread given (--sd-gap, or --screen with two seeds or more per arm)")
        return "\n".join(lines)
    lines.append(f"sd of the gap {sd_gap:g} points: power at headroom 0.25 / 0.5 / 1 point")
    for n in ns:
        lines.append(
            f"  n {n:2d}: " + " / ".join(f"{curve_runs.power(n, sd_gap, h, draws):.2f}" for h in (0.25, 0.5, 1.0))
        )
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("what", choices=["run", "one", "status", "analyze", "power"])
    parser.add_argument("name", nargs="?", help="one: the run's name (<task>_<optimizer>/<arm>_lr.._w.._s..)")
    parser.add_argument("--out", type=Path, default=None, help="the run files (kept outside the repository)")
    parser.add_argument("--limit", type=int, default=None, help="run: stop after this many runs")
    parser.add_argument("--pause-while", type=Path, default=None, help="run, one: wait while this file exists")
    parser.add_argument("--bp-a4", action="store_true", help="run, status, analyze: add the second baseline bp_a4")
    parser.add_argument("--json", type=Path, default=None, help="analyze: write the report here")
    parser.add_argument("--markdown", type=Path, default=None, help="analyze: write the table here")
    parser.add_argument("--sd-log-r", type=float, default=0.05, help="power: the spread of log r over seeds")
    parser.add_argument("--sd-gap", type=float, default=None, help="power: the spread of the paired gap (points)")
    parser.add_argument("--screen", type=Path, default=None,
                        help="power: the candidates screen's run folder; the gap's spread pooled from it")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser_ = parser()
    args = parser_.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.out is None and args.what in ("run", "one", "status", "analyze"):
        parser_.error(f"{args.what} needs --out DIR (the run files)")
    global PAUSE_WHILE
    PAUSE_WHILE = args.pause_while
    if args.what == "run":
        queue(args.out, args.limit, args.bp_a4)
    elif args.what == "one":
        if not args.name:
            parser_.error("one needs the run's name")
        result = run_one(args.out, Run.parse(args.name))
        print(json.dumps({k: v for k, v in result.items() if k != "val"}, indent=1))
    elif args.what == "status":
        print(status(args.out, args.bp_a4))
    elif args.what == "power":
        sd_gap = args.sd_gap
        if args.screen is not None:
            groups = screen_gaps(args.screen)
            for key, gaps in groups.items():
                sd = f"sd {statistics.stdev(gaps):.3f}" if len(gaps) > 1 else "one seed"
                print(f"{key}: n {len(gaps)}, mean {statistics.fmean(gaps):+.3f} %, {sd}")
            sd_gap = pooled_sd(groups) if sd_gap is None else sd_gap
            pooled = "none (no arm has two seeds)" if sd_gap is None else f"{sd_gap:.3f}"
            print(f"pooled sd of the paired gap: {pooled}")
        print(power_table(args.sd_log_r, sd_gap))
    else:
        report = analyze(args.out, args.bp_a4)
        print(report["markdown"])
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        if args.markdown:
            args.markdown.write_text(report["markdown"] + "\n")


if __name__ == "__main__":
    main()
