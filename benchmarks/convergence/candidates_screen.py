"""A screen of staleness-correction candidates on the development LM tasks (issue 64): K = 4 and 8, AdamW and Muon.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.candidates_screen run --out runs/candidates_screen  # continues a stopped queue
    python -m benchmarks.convergence.candidates_screen report --out runs/candidates_screen  # the table so far

Candidates, not a test: every task here is development data (the auto test's LLaMA-style model on the King James
Bible, 2 epochs, and GPT-2 on Shakespeare, 3 epochs: ``auto_test.run_lm``'s protocol, data, splits, micro-batch
8, clipping 1.0, WarmupCosineLR with BP's frozen warm-up of 10 %), and the seeds (200-202) only screen. What it
finds chooses what a later pre-registered test tries, nothing more. Every arm runs on ``fdg_reference`` in this one
process (K = 1 is plain backprop), ``"weights": "stashed"``, ``grad_shrink`` 1, ``accumulate`` 1.

- Optimizers: AdamW lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1; DeepSpeed's Muon as
  ``muon_lm.muon`` builds it, Muon lr 0.01 (BP-Muon's choice on seed 99 for both tasks, docs/staleness.md);
  Lion (seed 200's LLaMA only): DeepSpeed's CPU Lion, lr 3e-4, betas (0.9, 0.99), weight decay 0.3 (AdamW's lr / 3
  and weight decay x 3, the Lion paper's advice; not tuned).
- K = 4: the decoder blocks spread evenly (``hf_lm.stage_bounds``), or with ``split`` the embedding alone on
  stage 0 (layers 0,1,2,4,8: the most delayed stages short). K = 8: one layer per stage (embedding, six blocks,
  head), the only split of these 8 layers.
- Arms (:data:`ARMS`; docs/staleness.md has each key's formula): ``none``; ``last_p1`` / ``last_p05``: the
  forwards on ``w + p * h_k * delta``, delta the last applied update (``predict_decay`` 0, ``predict_scale`` p);
  ``first_p1``: the same aimed at stage 0's update (``predict_horizon: "first_stage"``); ``look``: the momentum
  look-ahead (``predict_momentum`` = the optimizer's momentum: AdamW's first beta 0.9, Muon's 0.95); ``v1``: rule
  v1's AdamW keys (``predict_decay`` 0, ``"first_stage"``, ``delay_momentum_raise`` 1, ``delay_lr_ticks`` twice
  the run's ticks), for Muon too; ``v1_p05`` and ``v1_look``: v1 with ``predict_scale`` 0.5 or with the look-ahead;
  ``v1_nolr``: v1 without ``delay_lr_ticks`` (its K = 2 keys; added for AdamW at K = 8, where v1 closed a fifth
  of the gap on seed 200's LLaMA); ``nadam099``: AsyncPP's released recipe (NAdam with decoupled weight decay,
  beta1 0.99; no key), AdamW only; ``<arm>_split``: the arm on the K = 4 split above.
- Plan (:func:`plan`): seed 200's LLaMA K = 4 ran every arm; the rest is narrowed to the arms the first pass
  ranked best (:data:`SEED_200` for seed 200's other cells, :data:`LEADING` for seeds 201-202), and Lion on seed
  200's LLaMA K = 4 (:data:`LION_ARMS`), then ``accumulate`` 2 as a version bound (:data:`ACCUMULATE_ARMS`: the best
  keys at K = 4 and 8 with 2 micro-batches per step, paired with BP at 2 per step, ``bp_a2``): 89 runs, not 204.

Each run writes ``<out>/<task>/<optimizer>_k<K>_<arm>_s<seed>.json`` (``<optimizer>_bp_s<seed>.json`` for BP)
when it ends, so a stopped queue continues where it stopped. The report pairs an arm with BP of the same optimizer,
seed and machine (``provenance.machine``): the test-loss difference in % of BP's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import curve_runs, provenance
from benchmarks.common.stats import t_quantile
from benchmarks.convergence import auto_test, muon_lm

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "runs" / "candidates_screen"
TASKS = ("llama", "gpt2")
SEEDS = (200, 201, 202)
MUON_LR = 0.01
MOMENTUM = {"adamw": 0.9, "muon": 0.95, "lion": 0.9}  # the first beta (AdamW, Lion); Muon's momentum (muon_lm.MUON)
LION = {"lr": 3e-4, "betas": (0.9, 0.99), "weight_decay": 0.3}
SPLIT_K4 = [0, 1, 2, 4, 8]  # the embedding alone on stage 0

# arm -> the pipeline.fdg keys beyond the base block; "v1" stands for rule v1's AdamW keys (:func:`fdg_keys`)
ARMS: dict[str, dict[str, Any]] = {
    "none": {},
    "last_p1": {"predict_decay": 0.0},
    "last_p05": {"predict_decay": 0.0, "predict_scale": 0.5},
    "first_p1": {"predict_decay": 0.0, "predict_horizon": "first_stage"},
    "look": {"predict_decay": 0.0, "predict_momentum": "momentum"},
    "v1": {"v1": True},
    "v1_p05": {"v1": True, "predict_scale": 0.5},
    "v1_look": {"v1": True, "predict_momentum": "momentum"},
    "v1_nolr": {"predict_decay": 0.0, "predict_horizon": "first_stage", "delay_momentum_raise": 1.0},  # v1 at K = 2
    "nadam099": {},
}
# The first pass: seed 200's LLaMA K = 4 ran every arm (per optimizer, in this order; the split ones after).
PLAN = {
    "adamw": ("none", "v1", "last_p1", "last_p05", "look", "v1_look", "v1_p05", "first_p1", "nadam099"),
    "muon": ("none", "last_p1", "last_p05", "look", "v1", "first_p1"),
}
SPLIT_ARMS = {"adamw": ("v1_split",), "muon": ("none_split",)}
# Narrowed after the first pass (2026-12-07, experiment log "The first pass and the screen narrowed"): per
# optimizer, seed 200's other cells keep "none" (the reference), the two best arms of the first pass on the even
# split and the split ones, with the split joined to the best keys (Muon first_p1_split); seeds 201-202 run the best
# arm and the best split only. At K = 8 AdamW also runs first_p1 and v1_nolr (v1 closed a fifth of the gap there).
SEED_200 = {
    4: {
        "muon": ("none", "first_p1", "last_p1", "none_split", "first_p1_split"),
        "adamw": ("none", "v1", "v1_look", "v1_split"),
    },
    8: {"muon": ("none", "first_p1", "last_p1"), "adamw": ("none", "v1", "v1_look", "first_p1", "v1_nolr")},
}
LION_ARMS = ("none", "v1", "first_p1")  # seed 200's LLaMA K = 4 only: which family's keys Lion takes
# accumulate as a version bound (issue 64): the best keys with 2 micro-batches per step at K = 4 and 8, against BP
# at 2 per step (``bp_a2``), seed 200's LLaMA only, after Lion's cell
ACCUMULATE = 2
ACCUMULATE_ARMS = {"muon": ("first_p1_a2",), "adamw": ("v1_a2",)}
LEADING = {
    4: {"muon": ("first_p1", "first_p1_split"), "adamw": ("v1", "v1_split")},
    8: {"muon": ("first_p1",), "adamw": ("v1",)},
}


def accumulate_of(arm: str) -> int:
    """Micro-batches per optimizer step: ACCUMULATE for an ``_a2`` arm (``bp_a2`` too), else 1."""
    return ACCUMULATE if arm.endswith(f"_a{ACCUMULATE}") else 1


@dataclasses.dataclass(frozen=True)
class Run:
    task: str
    optimizer: str  # "adamw" | "muon" | "lion"
    stages: int  # 1: BP
    arm: str  # "bp" or "bp_a2", an ARMS key, or one with "_split" or "_a2"
    seed: int

    @property
    def name(self) -> str:
        return f"{self.optimizer}_{self.arm}" if self.stages == 1 else f"{self.optimizer}_k{self.stages}_{self.arm}"

    @property
    def accumulate(self) -> int:
        return accumulate_of(self.arm)

    @property
    def baseline(self) -> Run:
        """The BP run this run pairs with: the same optimizer, seed and micro-batches per step."""
        return Run(self.task, self.optimizer, 1, "bp" if self.accumulate == 1 else f"bp_a{ACCUMULATE}", self.seed)

    def path(self, out: Path) -> Path:
        return out / self.task / f"{self.name}_s{self.seed}.json"


def arms_of(seed: int, task: str, stages: int) -> dict[str, tuple[str, ...]]:
    """Per optimizer (AdamW, Muon), the arms a (seed, task, K) cell runs, in order."""
    if (seed, task, stages) == (SEEDS[0], TASKS[0], 4):  # the first pass, then what the narrowing added
        wide = {opt: PLAN[opt] + SPLIT_ARMS[opt] for opt in PLAN}
        return {opt: wide[opt] + tuple(a for a in SEED_200[4][opt] if a not in wide[opt]) for opt in wide}
    return (SEED_200 if seed == SEEDS[0] else LEADING)[stages]


def plan(seeds: tuple[int, ...] = SEEDS) -> list[Run]:
    """Every run, in order: per seed and task (LLaMA first, the shorter), BP of both optimizers, then K = 4 and
    K = 8 with Muon's arms and AdamW's interleaved; after seed 200's LLaMA K = 8, Lion's cell (BP and K = 4), then
    the accumulate-2 runs (BP at 2 micro-batches per step first)."""
    runs: list[Run] = []
    for seed in seeds:
        for task in TASKS:
            runs += [Run(task, opt, 1, "bp", seed) for opt in ("adamw", "muon")]
            for k in (4, 8):
                arms = arms_of(seed, task, k)
                longest = max(len(a) for a in arms.values())
                for i in range(longest):
                    runs += [Run(task, opt, k, arms[opt][i], seed) for opt in ("muon", "adamw") if i < len(arms[opt])]
            if (seed, task) == (SEEDS[0], TASKS[0]):
                runs += [Run(task, "lion", 1, "bp", seed), *(Run(task, "lion", 4, arm, seed) for arm in LION_ARMS)]
                runs += [Run(task, opt, 1, f"bp_a{ACCUMULATE}", seed) for opt in ("adamw", "muon")]
                runs += [Run(task, opt, k, arm, seed) for k in (4, 8) for opt in ("muon", "adamw")
                         for arm in ACCUMULATE_ARMS[opt]]  # fmt: skip
    return runs


def fdg_keys(arm: str, optimizer: str, ticks: int) -> dict[str, Any]:
    """The pipeline.fdg block of an arm (``ticks``: the run's training ticks, for v1's T)."""
    keys = dict(ARMS[arm.removesuffix("_split").removesuffix(f"_a{ACCUMULATE}")])
    if keys.pop("v1", False):  # rule v1's AdamW choice with a cosine schedule: T = twice the run's ticks
        keys = {
            "predict_decay": 0.0,
            "predict_horizon": "first_stage",
            "delay_momentum_raise": 1.0,
            "delay_lr_ticks": 2 * ticks,
            **keys,
        }  # fmt: skip  (T: ticks, whatever the accumulation)
    if keys.get("predict_momentum") == "momentum":
        keys["predict_momentum"] = MOMENTUM[optimizer]
    return {"grad_shrink": 1.0, "weights": "stashed", "activations": "stored", "accumulate": accumulate_of(arm), **keys}


def bounds_for(layers: list[Any], run: Run) -> list[int]:
    from fdg_schedule.zoo import hf_lm

    if run.stages == 8:
        return list(range(len(layers) + 1)) if len(layers) == 8 else hf_lm.stage_bounds(layers, 8)
    if run.arm.endswith("_split"):
        return SPLIT_K4
    return hf_lm.stage_bounds(layers, run.stages)


def make_optimizer(run: Run, module: Any) -> Any:
    import torch

    if run.optimizer == "muon":
        return muon_lm.muon(module, MUON_LR)
    if run.optimizer == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(module.parameters(), **LION)
    if run.arm == "nadam099":  # AsyncPP's released recipe: NAdamW with beta1 0.99
        return torch.optim.NAdam(module.parameters(), lr=1e-3, betas=(0.99, 0.95), eps=1e-8, weight_decay=0.1,
                                 decoupled_weight_decay=True)  # fmt: skip
    return torch.optim.AdamW(module.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def run_one(run: Run, max_ticks: int | None = None, smoke: bool = False) -> dict[str, Any]:
    """One run of ``auto_test.run_lm``'s protocol with the run's optimizer, K, split and keys."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR
    from transformers import LlamaConfig

    from fdg_schedule import FDGConfig, fdg_reference
    from fdg_schedule.zoo import hf_lm

    torch.set_num_threads(1)
    train, val, test = auto_test.lm_data(run.task, smoke)
    torch.manual_seed(run.seed)  # the initial weights
    config = LlamaConfig(**auto_test.LLAMA) if run.task == "llama" else hf_lm.load_config(auto_test.GPT2_MODEL)
    layers = hf_lm.pipeline_layers(hf_lm.build_model(config))
    bounds = bounds_for(layers, run)
    modules = [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(run.stages)]
    optimizers = [make_optimizer(run, m) for m in modules]
    epochs = 1 if smoke else int(auto_test.LM[run.task]["epochs"])
    per_epoch = len(train) // 8
    batches = []
    for epoch in range(epochs):  # auto_test.run_lm's order
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(run.seed * 1000 + epoch)).tolist()
        for i in range(per_epoch):
            block = torch.stack([train[j][0] for j in order[i * 8 : i * 8 + 8]])
            batches.append((block, block))
    batches = batches[:max_ticks]
    ticks = len(batches)
    steps = math.ceil(ticks / run.accumulate)  # optimizer (and scheduler) steps
    schedule = {"total_num_steps": steps, "warmup_num_steps": max(1, steps // 10), "warmup_min_ratio": 0.0,
                "cos_min_ratio": 0.1, "warmup_type": "linear"}  # fmt: skip
    schedulers = [WarmupCosineLR(o, **schedule) for o in optimizers]
    keys = fdg_keys(run.arm, run.optimizer, ticks) if run.stages > 1 else {"accumulate": run.accumulate}
    start = time.time()
    losses = fdg_reference(modules, optimizers, batches, hf_lm.lm_loss, FDGConfig(**keys), drain=True,
                           schedulers=schedulers, clip_grad_norm=1.0)  # fmt: skip
    out: dict[str, Any] = {"fdg": keys, "bounds": bounds, "train_ticks": ticks, "train_s": time.time() - start}
    if not all(math.isfinite(v) for v in losses):
        return {**out, "failed": "non-finite training loss"}
    return {
        **out,
        "test": auto_test.lm_loss_on(modules, test),
        "validation": auto_test.lm_loss_on(modules, val),
        "train_loss_last_100": sum(losses[-100:]) / len(losses[-100:]),
    }


def queue(out: Path, max_ticks: int | None = None, smoke: bool = False, pause_while: Path | None = None) -> None:
    """Run every planned run not written yet, one after another in this process; before each, wait while the file
    ``pause_while`` exists (a machine's quiet period for timing benchmarks)."""
    lock = curve_runs.lock_queue(out, "candidates_screen.py")  # noqa: F841 - held until the process ends
    for run in plan():
        path = run.path(out)
        if path.exists():
            continue
        curve_runs.wait_while(pause_while)
        start = time.time()
        result = {**dataclasses.asdict(run), **run_one(run, max_ticks, smoke), "wall_s": 0.0, "smoke": smoke,
                  "max_ticks": max_ticks, "machine": provenance.machine(), "commit": provenance.commit()}  # fmt: skip
        result["wall_s"] = time.time() - start
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.rename(path)  # written whole or not at all
        print(f"{time.strftime('%F %T')} {run.task} {run.name} s{run.seed}: test {result.get('test')} "
              f"({result['wall_s']:.0f} s){' FAILED' if 'failed' in result else ''}", flush=True)  # fmt: skip
    print(f"{time.strftime('%F %T')} every planned run is done", flush=True)


def read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def rows(out: Path) -> list[dict[str, Any]]:
    """Per task, optimizer, K and arm: the paired test-loss differences to BP (%) over the seeds in so far."""
    table: dict[tuple[str, str, int, str], list[float]] = {}
    for run in plan():
        if run.stages == 1:
            continue
        mine, bp = read(run.path(out)), read(run.baseline.path(out))
        if mine is None or bp is None or mine["machine"] != bp["machine"]:
            continue
        diff = math.inf if "failed" in mine else (mine["test"] - bp["test"]) / bp["test"] * 100
        table.setdefault((run.task, run.optimizer, run.stages, run.arm), []).append(diff)
    out_rows = []
    for (task, opt, k, arm), diffs in table.items():
        n = len(diffs)
        mean = statistics.fmean(diffs)
        sd = statistics.stdev(diffs) if n > 1 else math.nan
        bound = mean + t_quantile(0.95, n - 1) * sd / math.sqrt(n) if n > 1 else math.nan
        out_rows.append({"task": task, "optimizer": opt, "K": k, "arm": arm, "n": n, "mean": mean, "sd": sd,
                         "bound": bound, "diffs": diffs})  # fmt: skip
    return out_rows


def report(out: Path) -> str:
    lines = ["| task | optimizer | K | arm | n | test loss − BP: mean % (sd), one-sided 95 % bound |",
             "|---|---|---|---|---:|---|"]  # fmt: skip
    for r in rows(out):
        spread = f" ({r['sd']:.2f}), {r['bound']:+.2f} %" if r["n"] > 1 else " (one seed: no spread, no bound)"
        lines.append(f"| {r['task']} | {r['optimizer']} | {r['K']} | `{r['arm']}` | {r['n']} | "
                     f"{r['mean']:+.2f} %{spread} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("run", "report"))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--max-ticks", type=int, default=None, help="cut every run to this many ticks (a check)")
    parser.add_argument("--smoke", action="store_true", help="1 epoch of a 200,000-character corpus (a check)")
    parser.add_argument("--pause-while", type=Path, default=None, help="before each run, wait while this file exists")
    args = parser.parse_args()
    if args.command == "run":
        queue(args.out, args.max_ticks, args.smoke, args.pause_while)
    else:
        print(report(args.out))


if __name__ == "__main__":
    main()
