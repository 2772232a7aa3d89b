"""The GPT-2 runs the LM studies share: run names, their DeepSpeed and reference runs, the model, data and loss.

A run name says what runs (``bp``, ``fdg_k2_b0.5_stashed_s7``, ``ref_k3_b0.5_cos``, ...); the grammar is in
benchmarks/convergence/lm_convergence.py's docstring, the benchmark these runs were written for. The studies
(staleness_metric, staleness_gpt2_gaps, forecast_error, delay_anatomy, lm_split_times) and their tests
import them from here. Outputs go to ``$LM_CONVERGENCE_OUT`` or runs/lm_convergence/.
"""

from __future__ import annotations

import json
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


def finished(name: str, root: Path = OUT) -> bool:
    return (root / name / "wall.json").exists() and (root / name / "metrics.jsonl").exists()
