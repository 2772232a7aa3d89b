"""BP vs FDG on one small GPT-2 and the same Shakespeare tokens; writes lm_convergence.{md,png} in
docs/results/convergence/.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.lm_convergence run --micro_batches 800     # the runs, one after another
    python -m benchmarks.convergence.lm_convergence report                       # table + loss curves

Tied against untied embeddings at K = 2 (issue 16; FDG needs the engine's tied-weight sync):

    python -m benchmarks.convergence.lm_convergence run --runs bp_tied,bp_untied,fdg_k2_b0.5_tied,fdg_k2_b0.5_untied
    python -m benchmarks.convergence.lm_convergence report \
        --runs bp_tied,bp_untied,fdg_k2_b0.5_tied,fdg_k2_b0.5_untied \
        --picture docs/results/convergence/lm_convergence_tied.png

Every run starts from the same weights (seed 1234, docs/results/convergence/lm_convergence_model.json), reads the same
training blocks in the same order (the recipe's shuffled sampler, seed 1234) in micro-batches of 8
sequences × 128 tokens and takes one optimizer step per micro-batch: BP with batch 8; FDG with one
step per stage per tick (``accumulate: 1``). K=2 runs are real DeepSpeed jobs of recipes/train_lm.py
(2 gloo ranks). K=3 would need 3 ranks, more than this 2-core machine may use, so K=3 runs use
``fdg_schedule.fdg_reference`` (the single-process statement of the same update, same optimizer,
same stage-local clipping); a K=2 reference run checks that the reference tracks the engine.

Run names say what runs (any combination; the runs of docs/results/staleness/experiment-log.md):

    bp[_s<seed>]                                  BP, a DeepSpeed job of the recipe
    fdg_k<K>_b<beta>[_stashed][_dlr<T>][_p<gamma>[_first]][_m|_r<c>][_s<seed>]
                                                  FDG on the DeepSpeed engine (K ranks): weights "stashed"
                                                  (default "current"), the staleness corrections
                                                  delay_lr_ticks T, predict_decay gamma (with _first:
                                                  predict_horizon "first_stage"), delay_momentum (_m) or
                                                  delay_momentum_raise c (_r<c>)
    ref_k<K>_b<beta>[_stashed][_dlr<T>][_p<gamma>[_first]][_m|_r<c>][_s<seed>]
                                                  the same with fdg_reference in one process
    <any FDG run above>_parts<b0-b1-...-bK>         after _m: the stages' layer boundaries (the recipe's
                                                  --partition parts:b0,...,bK; the model has 8 pipeline
                                                  layers: embedding, 6 blocks, head) instead of the blocks
                                                  spread evenly (type:BlockPipe), e.g. _parts0-2-4-6-8
    <any run above>_lr<LR>                        before _a: the optimizer's learning rate LR (AdamW's peak
                                                  with _cos) instead of the config's 0.001, e.g. _lr0.002
    <any run above>_a<A>                          before _cos: A micro-batches per optimizer step (BP:
                                                  gradient_accumulation_steps A, batch 8A; FDG: accumulate
                                                  A, so stage k's delay is 2(K-1-k)/A steps); default 1
    <any run above>_cos                           before _s<seed>: the learning rate warms up linearly from 0
                                                  over the first 10 % of the micro-batches and decays on a
                                                  cosine to 0.1 x at the last (DeepSpeed's WarmupCosineLR,
                                                  stepped once per optimizer step, fill and drain ticks
                                                  included); without it the rate is constant
    <any DeepSpeed run above>_tied / _untied      the model with its LM head tied to the input embedding
                                                  (docs/results/convergence/lm_convergence_model.json,
                                                  tie_word_embeddings true), or that same model untied by the recipe's
                                                  --untie (the head starts as a copy of the embedding);
                                                  without the suffix the model is the file's, untied
                                                  from the start (its own head initialisation)

The seed (default 1234) draws the initial weights and the data order. A run whose metrics are already
in the output folder is skipped, so the same command resumes a stopped queue.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "docs" / "results" / "convergence" / "lm_convergence_model.json"
OUT = Path(os.environ.get("LM_CONVERGENCE_OUT", ROOT / "runs" / "lm_convergence"))
GAS = 4  # ticks per train_batch call in the FDG configs (lm_fdg_k2.json)

RUNS = "bp,fdg_k2_b0.5,fdg_k2_b1.0,ref_k2_b0.5,ref_k3_b0.5,ref_k3_b1.0"  # docs/results/convergence/lm_convergence.md
TIE_RUNS = "bp_tied,bp_untied,fdg_k2_b0.5_tied,fdg_k2_b0.5_untied"  # tied vs untied at K = 2
NAME = re.compile(
    r"^(?:bp|(?P<kind>fdg|ref)_k(?P<K>\d+)_b(?P<beta>[\d.]+)(?:_(?P<weights>stashed))?"
    r"(?:_dlr(?P<T>\d+))?(?:_p(?P<gamma>[\d.]+)(?P<first>_first)?)?(?:(?P<momentum>_m)|_r(?P<raise>\d*\.?\d+))?(?:_parts(?P<parts>\d+(?:-\d+)+))?)(?:_lr(?P<lr>\d*\.\d+))?(?:_a(?P<A>\d+))?(?P<cos>_cos)?(?:_s(?P<seed>\d+))?(?:_(?P<tie>tied|untied))?$"
)


@dataclass(frozen=True)
class Run:
    """What a run name asks for."""

    name: str
    kind: str  # "deepspeed" or "reference"
    stages: int
    grad_shrink: float
    weights: str
    delay_lr_ticks: int
    predict_decay: float | None
    seed: int
    tie: str = ""  # "" (the model file as it is), "tied" or "untied" (the tied model, --untie)
    delay_momentum: bool = False
    cosine: bool = False  # the learning rate: warm-up then cosine decay (schedule()), else constant
    accumulate: int = 1  # micro-batches per optimizer step, BP and FDG alike
    lr: float | None = None  # the optimizer's learning rate; None: the config's
    predict_horizon: str = "own"  # "first_stage" with _first: the prediction aims at stage 0's update
    parts: tuple[int, ...] | None = None  # the stage boundaries over the pipeline layers; None: blocks evenly
    delay_momentum_raise: float | None = None  # c with _r<c>: the delayed stages' momentum mu ** (1 / (1 + c*h))

    @property
    def baseline(self) -> str:
        """The BP run with the same seed and embeddings (the paired comparison)."""
        protocol = (
            ("" if self.lr is None else f"_lr{self.lr:g}")
            + ("" if self.accumulate == 1 else f"_a{self.accumulate}")
            + ("_cos" if self.cosine else "")
        )
        return f"bp{protocol}" + ("" if self.seed == 1234 else f"_s{self.seed}") + (f"_{self.tie}" if self.tie else "")


def parse_run(name: str) -> Run:
    match = NAME.match(name)
    if match is None:
        raise SystemExit(f"lm_convergence.py: error: run name {name!r} does not read as {NAME.pattern}")
    kind = "reference" if match["kind"] == "ref" else "deepspeed"
    T, gamma = int(match["T"] or 0), float(match["gamma"]) if match["gamma"] else None
    stages = int(match["K"] or 1)
    weights = match["weights"] or "current"
    tie = match["tie"] or ""
    if tie and kind == "reference":
        raise SystemExit(
            f"lm_convergence.py: error: run {name!r}: fdg_reference runs have no tied variant here; "
            f"compare tied and untied embeddings with DeepSpeed runs (bp_{tie}, fdg_k2_b0.5_{tie})"
        )
    seed = int(match["seed"] or 1234)
    beta = float(match["beta"] or 1.0)
    accumulate = int(match["A"] or 1)
    if accumulate < 1:
        raise SystemExit(
            f"lm_convergence.py: error: run {name!r}: _a{accumulate} needs at least 1 micro-batch per step"
        )
    if kind == "deepspeed" and stages > 1 and GAS % accumulate:  # the FDG config's ticks per train_batch call
        raise SystemExit(f"lm_convergence.py: error: run {name!r}: _a{accumulate} must divide {GAS}")
    momentum, cos = bool(match["momentum"]), bool(match["cos"])
    lr = float(match["lr"]) if match["lr"] else None
    if lr is not None and not 0 < lr < 1:
        raise SystemExit(f"lm_convergence.py: error: run {name!r}: _lr{match['lr']} must be a learning rate in (0, 1)")
    horizon = "first_stage" if match["first"] else "own"
    parts = tuple(int(b) for b in match["parts"].split("-")) if match["parts"] else None
    if parts is not None and (len(parts) != stages + 1 or parts[0] != 0 or list(parts) != sorted(set(parts))):
        raise SystemExit(
            f"lm_convergence.py: error: run {name!r}: _parts{match['parts']} must be {stages + 1} increasing "
            "layer boundaries from 0, one more than the stages (e.g. _parts0-2-4-6-8 at K = 4)"
        )
    raised = float(match["raise"]) if match["raise"] else None
    if raised is not None and not raised > 0:
        raise SystemExit(f"lm_convergence.py: error: run {name!r}: _r{match['raise']} must be a number > 0")
    return Run(
        name, kind, stages, beta, weights, T, gamma, seed, tie, momentum, cos, accumulate, lr, horizon, parts, raised
    )


def schedule(steps: int) -> dict:
    """The ``_cos`` runs' DeepSpeed scheduler config over ``steps`` optimizer steps: linear warm-up from 0
    over the first 10 %, then a cosine to 0.1 x the optimizer's lr at the last (nanoGPT's shape)."""
    params = {"total_num_steps": steps, "warmup_num_steps": max(2, steps // 10),
              "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "warmup_type": "linear"}  # fmt: skip
    return {"type": "WarmupCosineLR", "params": params}


def model_config(run: Run, out: Path) -> tuple[Path, list[str]]:
    """The model file the run trains and the recipe's tie flag: Note [tied embeddings] in hf_lm."""
    if not run.tie:
        return MODEL, []
    config = json.loads(MODEL.read_text())
    config["tie_word_embeddings"] = True  # both variants start from the same tied model
    path = out / "model.json"
    path.write_text(json.dumps(config, indent=2))
    return path, ["--untie"] if run.tie == "untied" else []


def deepspeed_config(run: Run, micro_batches: int) -> dict:
    """The ds_config of a DeepSpeed run: lm_bp.json or lm_fdg_k2.json with what the name asks for."""
    stages = run.stages
    base = "lm_bp.json" if stages == 1 else "lm_fdg_k2.json"
    config = json.loads((ROOT / "ds_configs" / base).read_text())
    if stages > 1:
        config["pipeline"]["stages"] = stages  # the file says 2; one rank per stage
        config["pipeline"]["fdg"].pop("corrections", None)  # the file's "auto": the name sets every key below
        config["pipeline"]["fdg"]["grad_shrink"] = run.grad_shrink
        config["pipeline"]["fdg"]["weights"] = run.weights
        config["pipeline"]["fdg"]["delay_lr_ticks"] = run.delay_lr_ticks
        config["pipeline"]["fdg"]["predict_decay"] = run.predict_decay
        config["pipeline"]["fdg"]["predict_horizon"] = run.predict_horizon
        config["pipeline"]["fdg"]["delay_momentum"] = run.delay_momentum
        config["pipeline"]["fdg"]["delay_momentum_raise"] = run.delay_momentum_raise
        config["pipeline"]["fdg"]["accumulate"] = run.accumulate
        config["pipeline"]["fdg"]["timeout"] = 36000  # an experiment paused by quiet.sh must not time out
    else:
        config["gradient_accumulation_steps"] = run.accumulate
    if run.lr is not None:
        config["optimizer"]["params"]["lr"] = run.lr
    if run.cosine:
        config["scheduler"] = schedule(micro_batches // run.accumulate)
    return config


def partition_method(run: Run) -> str:
    """The recipe's ``--partition`` for a DeepSpeed run: the reference runs' fixed split (the decoder blocks
    spread evenly, or the name's ``_parts``), not the recipe's measured default."""
    return "type:BlockPipe" if run.parts is None else "parts:" + ",".join(map(str, run.parts))


def run_deepspeed(
    run: Run, micro_batches: int, eval_every: int, root: Path = OUT, adjust: Callable[[dict], None] | None = None
) -> None:
    """The run as a DeepSpeed job of recipes/train_lm.py, into ``root/<name>``; ``adjust`` edits its ds_config."""
    from fdg_schedule.tools.launch import free_port, remove_shared_memory

    name, stages = run.name, run.stages
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    config = deepspeed_config(run, micro_batches)
    if adjust is not None:
        adjust(config)
    (out / "ds_config.json").write_text(json.dumps(config, indent=2))
    per_call = run.accumulate if stages == 1 else GAS
    model, tie_flags = model_config(run, out)
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "deepspeed"),
        f"--num_gpus={stages}",
        f"--master_port={port}",
        "recipes/train_lm.py",
        f"--deepspeed_config={out / 'ds_config.json'}",
        f"--model_config={model}",
        *tie_flags,
        "--vocab_size=4096",
        "--block_size=128",
        f"--max_steps={micro_batches // per_call}",
        f"--eval_interval={eval_every // per_call}",
        "--eval_sequences=512",
        "--log_interval=50",
        f"--partition={partition_method(run)}",
        f"--out_dir={out}",
        f"--seed={run.seed}",
    ]
    start = time.time()
    try:
        with open(out / "log.txt", "w") as log:
            subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=36000)
    finally:
        remove_shared_memory(port)
    (out / "wall.json").write_text(json.dumps({"wall_s": time.time() - start, "command": " ".join(command)}))


def gpt2_setup(
    seed: int, stages: int, micro_batches: int, lr: float | None = None, parts: Sequence[int] | None = None
) -> tuple:
    """The reference runs' GPT-2 in ``stages`` stage modules (the decoder blocks spread evenly, as
    ``type:BlockPipe``, or split at the layer boundaries ``parts``), one AdamW each (lm_fdg_k2.json's, at ``lr``
    if given), the first ``micro_batches`` training micro-batches (8 blocks each, the recipe's order) and
    512 validation blocks; seeded as the recipe: seed, then tokenizer (no torch RNG), then the model."""
    import torch
    from torch.utils.data import DistributedSampler

    from fdg_schedule.zoo import hf_lm, text_data

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    texts = text_data.read_texts("shakespeare")
    tokenizer = text_data.train_tokenizer(texts, 4096)
    train_set, val_set = text_data.split_blocks(text_data.encode(texts, tokenizer), 128, 0.1)
    layers = hf_lm.pipeline_layers(hf_lm.build_model(hf_lm.load_config(MODEL)))
    bounds = hf_lm.stage_bounds(layers, stages) if parts is None else list(parts)
    if len(bounds) != stages + 1 or bounds[-1] != len(layers):
        raise ValueError(f"parts {bounds} must split the model's {len(layers)} layers into {stages} stages")
    stage_modules = [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(stages)]
    ds = json.loads((ROOT / "ds_configs" / "lm_fdg_k2.json").read_text())["optimizer"]["params"]
    optimizers = [
        torch.optim.AdamW(
            m.parameters(),
            lr=ds["lr"] if lr is None else lr,
            betas=ds["betas"],
            eps=ds["eps"],
            weight_decay=ds["weight_decay"],
        )
        for m in stage_modules
    ]
    order: list[int] = list(
        DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)
    )  # the recipe's
    if micro_batches * 8 > len(order):
        raise ValueError(f"{micro_batches} micro-batches of 8 exceed one epoch ({len(order)} blocks)")
    batches = []
    for i in range(micro_batches):
        idx = order[i * 8 : i * 8 + 8]
        block = torch.stack([train_set[j][0] for j in idx])
        batches.append((block, block))
    val = torch.stack([val_set[j][0] for j in range(min(512, len(val_set)))])
    return stage_modules, optimizers, batches, val


def gpt2_val_loss(stage_modules: list, val: Any) -> float:
    """The mean loss of :func:`gpt2_setup`'s validation blocks through the stage modules, in chunks of 32."""
    import torch

    from fdg_schedule.zoo import hf_lm

    with torch.no_grad():
        for m in stage_modules:
            m.eval()
        losses = []
        for chunk in val.split(32):
            x = chunk
            for m in stage_modules:
                x = m(x)
            losses.append(float(hf_lm.lm_loss(x, chunk)))
        for m in stage_modules:
            m.train()
    return sum(losses) / len(losses)


def train_reference(
    run: Run, stage_modules: list, optimizers: list, batches: list, after_tick: Callable[[int], None], schedulers: list
) -> list[float]:
    """``fdg_reference`` over :func:`gpt2_setup`'s stages with the run's FDG config and lm_fdg_k2.json's
    gradient clipping (stage-local, as the engine does); returns stage 0's losses."""
    from fdg_schedule import FDGConfig, fdg_reference
    from fdg_schedule.zoo import hf_lm

    ds_config = json.loads((ROOT / "ds_configs" / "lm_fdg_k2.json").read_text())
    config = FDGConfig(
        grad_shrink=run.grad_shrink,
        weights=run.weights,
        delay_lr_ticks=run.delay_lr_ticks,
        predict_decay=run.predict_decay,
        predict_horizon=run.predict_horizon,
        delay_momentum=run.delay_momentum,
        delay_momentum_raise=run.delay_momentum_raise,
        accumulate=run.accumulate,
    )
    clip = float(ds_config["gradient_clipping"])
    return fdg_reference(stage_modules, optimizers, batches, hf_lm.lm_loss, config=config, drain=True,
                         schedulers=schedulers, clip_grad_norm=clip, after_tick=after_tick)  # fmt: skip


def run_reference(run: Run, micro_batches: int, eval_every: int) -> None:
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    name, stages = run.name, run.stages
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    stage_modules, optimizers, batches, val = gpt2_setup(run.seed, stages, micro_batches, run.lr, run.parts)
    # what deepspeed.initialize builds from the _cos runs' "scheduler" config, one per stage
    steps = micro_batches // run.accumulate
    schedulers = [WarmupCosineLR(o, **schedule(steps)["params"]) for o in optimizers] if run.cosine else []
    rows: list[dict] = []

    def evaluate(tick: int) -> None:
        rows.append({"step": tick, "tokens": tick * 1024, "val_loss": gpt2_val_loss(stage_modules, val)})

    def after_tick(tick: int) -> None:
        if (tick + 1) % eval_every == 0 and tick + 1 < micro_batches:
            evaluate(tick + 1)

    losses = train_reference(run, stage_modules, optimizers, batches, after_tick, schedulers)
    evaluate(micro_batches)
    train_rows = [{"step": i + 1, "tokens": (i + 1) * 1024, "train_loss": v} for i, v in enumerate(losses)]
    with open(out / "metrics.jsonl", "w") as f:
        for row in train_rows + rows:
            f.write(json.dumps(row) + "\n")
    (out / "wall.json").write_text(json.dumps({"wall_s": time.time() - start, "command": "fdg_reference"}))


def finished(name: str, root: Path = OUT) -> bool:
    return (root / name / "wall.json").exists() and (root / name / "metrics.jsonl").exists()


def report(names: list[str], picture: Path, table_path: Path | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    table = []
    finals: dict[str, float] = {}
    for name in names:
        metrics = OUT / name / "metrics.jsonl"
        if not finished(name):
            continue
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        train = [(r["tokens"], r["train_loss"]) for r in rows if "train_loss" in r and math.isfinite(r["train_loss"])]
        val = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
        window = max(1, len(train) // 40)
        smooth = [
            (
                train[i][0],
                sum(v for _, v in train[max(0, i - window + 1) : i + 1]) / len(train[max(0, i - window + 1) : i + 1]),
            )
            for i in range(len(train))
        ]
        ax_train.plot(*zip(*smooth, strict=True), label=name)
        ax_val.plot(*zip(*val, strict=True), marker="o", label=name)
        wall = json.loads((OUT / name / "wall.json").read_text())["wall_s"]
        finals[name] = val[-1][1]
        table.append((name, val[-1][0], val[-1][1], wall))
    ax_train.set(xlabel="tokens", ylabel="train loss (moving mean)", title="training loss")
    ax_val.set(xlabel="tokens", ylabel="validation loss (512 sequences)", title="validation loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(picture, dpi=110)
    lines = [
        "| run | tokens | final val loss | val ppl | gap to BP (same seed) | relative gap | wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, tokens, final, wall in table:
        bp = finals.get(parse_run(name).baseline)
        gap = "n/a" if bp is None else f"{final - bp:+.3f}"
        relative = "n/a" if bp is None else f"{(final - bp) / bp:+.2%}"
        lines.append(f"| {name} | {tokens} | {final:.3f} | {math.exp(final):.1f} | {gap} | {relative} | {wall:.0f} |")
    print("\n".join(lines))
    if table_path is not None:
        table_path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["run", "report"])
    parser.add_argument("--runs", default=RUNS, help=f"comma-separated run names (see above); tied: {TIE_RUNS}")
    parser.add_argument("--micro_batches", type=int, default=800)
    parser.add_argument("--eval_every", type=int, default=100, help="micro-batches between evaluations")
    parser.add_argument("--picture", type=Path, default=MODEL.parent / "lm_convergence.png")
    parser.add_argument("--table", type=Path, default=None, help="also write the report's table here")
    args = parser.parse_args()
    runs = [parse_run(name) for name in args.runs.split(",")]  # a bad name fails before any run
    if args.what == "report":
        report([run.name for run in runs], args.picture, args.table)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for run in runs:
        if finished(run.name):
            print(f"{time.strftime('%H:%M:%S')} {run.name}: done already ({OUT / run.name})", flush=True)
            continue
        print(f"{time.strftime('%H:%M:%S')} {run.name}", flush=True)
        runner = run_deepspeed if run.kind == "deepspeed" else run_reference
        runner(run, args.micro_batches, args.eval_every)


if __name__ == "__main__":
    main()
