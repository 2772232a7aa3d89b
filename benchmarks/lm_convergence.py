"""BP vs FDG on one small GPT-2 and the same Shakespeare tokens; writes docs/lm_convergence.{md,png}.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python benchmarks/lm_convergence.py run --micro_batches 800     # the runs, one after another
    python benchmarks/lm_convergence.py report                       # table + loss curves

Every run starts from the same weights (seed 1234, docs/lm_convergence_model.json), reads the same
training blocks in the same order (the recipe's shuffled sampler, seed 1234) in micro-batches of 8
sequences × 128 tokens and takes one optimizer step per micro-batch: BP with batch 8; FDG with one
step per stage per tick (``accumulate: 1``). K=2 runs are real DeepSpeed jobs of recipes/train_lm.py
(2 gloo ranks). K=3 would need 3 ranks, more than this 2-core machine may use, so K=3 runs use
``fdg_schedule.fdg_reference`` (the single-process statement of the same update, same optimizer,
same stage-local clipping); a K=2 reference run checks that the reference tracks the engine.
"""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "docs" / "lm_convergence_model.json"
OUT = Path(os.environ.get("LM_CONVERGENCE_OUT", ROOT / "runs" / "lm_convergence"))
GAS = 4  # ticks per train_batch call in the FDG configs (lm_fdg_k2.json)

# name -> (kind, stages, grad_shrink)
RUNS = {
    "bp": ("deepspeed", 1, 1.0),
    "fdg_k2_b0.5": ("deepspeed", 2, 0.5),
    "fdg_k2_b1.0": ("deepspeed", 2, 1.0),
    "ref_k2_b0.5": ("reference", 2, 0.5),
    "ref_k3_b0.5": ("reference", 3, 0.5),
    "ref_k3_b1.0": ("reference", 3, 1.0),
}


def run_deepspeed(name: str, stages: int, grad_shrink: float, micro_batches: int, eval_every: int) -> None:
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    base = "lm_bp.json" if stages == 1 else "lm_fdg_k2.json"
    config = json.loads((ROOT / "ds_configs" / base).read_text())
    if stages > 1:
        config["pipeline"]["fdg"]["grad_shrink"] = grad_shrink
    (out / "ds_config.json").write_text(json.dumps(config, indent=2))
    per_call = 1 if stages == 1 else GAS
    command = [
        str(Path(sys.executable).parent / "deepspeed"),
        f"--num_gpus={stages}",
        f"--master_port={random.randint(30000, 39000)}",
        "recipes/train_lm.py",
        f"--deepspeed_config={out / 'ds_config.json'}",
        f"--model_config={MODEL}",
        "--vocab_size=4096",
        "--block_size=128",
        f"--max_steps={micro_batches // per_call}",
        f"--eval_interval={eval_every // per_call}",
        "--eval_sequences=512",
        "--log_interval=50",
        f"--out_dir={out}",
    ]
    start = time.time()
    with open(out / "log.txt", "w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
    (out / "wall.json").write_text(json.dumps({"wall_s": time.time() - start, "command": " ".join(command)}))


def run_reference(name: str, stages: int, grad_shrink: float, micro_batches: int, eval_every: int) -> None:
    import torch
    from torch.utils.data import DistributedSampler

    from fdg_schedule import FDGConfig, fdg_reference
    from fdg_schedule.zoo import hf_lm, text_data

    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # as the recipe: seed, then tokenizer (no torch RNG), then the model
    texts = text_data.read_texts("shakespeare")
    tokenizer = text_data.train_tokenizer(texts, 4096)
    train_set, val_set = text_data.split_blocks(text_data.encode(texts, tokenizer), 128, 0.1)
    layers = hf_lm.pipeline_layers(hf_lm.build_model(hf_lm.load_config(MODEL)))
    bounds = hf_lm.stage_bounds(layers, stages)
    stage_modules = [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(stages)]
    ds_config = json.loads((ROOT / "ds_configs" / "lm_fdg_k2.json").read_text())
    ds = ds_config["optimizer"]["params"]
    optimizers = [
        torch.optim.AdamW(
            m.parameters(), lr=ds["lr"], betas=ds["betas"], eps=ds["eps"], weight_decay=ds["weight_decay"]
        )
        for m in stage_modules
    ]
    order: list[int] = list(
        DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=1234)
    )  # the recipe's
    if micro_batches * 8 > len(order):
        raise ValueError(f"{micro_batches} micro-batches of 8 exceed one epoch ({len(order)} blocks)")
    batches = []
    for i in range(micro_batches):
        idx = order[i * 8 : i * 8 + 8]
        block = torch.stack([train_set[j][0] for j in idx])
        batches.append((block, block))
    val = torch.stack([val_set[j][0] for j in range(min(512, len(val_set)))])
    rows: list[dict] = []

    def evaluate(tick: int) -> None:
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
        rows.append({"step": tick, "tokens": tick * 1024, "val_loss": sum(losses) / len(losses)})

    def after_tick(tick: int) -> None:
        if (tick + 1) % eval_every == 0 and tick + 1 < micro_batches:
            evaluate(tick + 1)

    losses = fdg_reference(
        stage_modules,
        optimizers,
        batches,
        hf_lm.lm_loss,
        config=FDGConfig(grad_shrink=grad_shrink),
        drain=True,
        clip_grad_norm=float(ds_config["gradient_clipping"]),  # stage-local, as the engine does
        after_tick=after_tick,
    )
    evaluate(micro_batches)
    train_rows = [{"step": i + 1, "tokens": (i + 1) * 1024, "train_loss": v} for i, v in enumerate(losses)]
    with open(out / "metrics.jsonl", "w") as f:
        for row in train_rows + rows:
            f.write(json.dumps(row) + "\n")
    (out / "wall.json").write_text(json.dumps({"wall_s": time.time() - start, "command": "fdg_reference"}))


def report(names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    table = []
    bp_final = None
    for name in names:
        metrics = OUT / name / "metrics.jsonl"
        if not metrics.exists():
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
        final = val[-1][1]
        if name == "bp":
            bp_final = final
        table.append((name, val[-1][0], final, math.exp(final), wall))
    ax_train.set(xlabel="tokens", ylabel="train loss (moving mean)", title="training loss")
    ax_val.set(xlabel="tokens", ylabel="validation loss (512 sequences)", title="validation loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "lm_convergence.png", dpi=110)
    print("| run | tokens | final val loss | val ppl | gap to BP | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, tokens, final, ppl, wall in table:
        gap = f"{final - bp_final:+.3f}" if bp_final is not None else "n/a"
        print(f"| {name} | {tokens} | {final:.3f} | {ppl:.1f} | {gap} | {wall:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["run", "report"])
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--micro_batches", type=int, default=800)
    parser.add_argument("--eval_every", type=int, default=100, help="micro-batches between evaluations")
    args = parser.parse_args()
    names = args.runs.split(",")
    if args.what == "report":
        report(names)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in names:
        kind, stages, grad_shrink = RUNS[name]
        print(f"{time.strftime('%H:%M:%S')} {name}", flush=True)
        runner = run_deepspeed if kind == "deepspeed" else run_reference
        runner(name, stages, grad_shrink, args.micro_batches, args.eval_every)


if __name__ == "__main__":
    main()
