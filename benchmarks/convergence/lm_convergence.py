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
import time
from pathlib import Path

from benchmarks.common.lm_runs import (
    MODEL,
    OUT,
    Run,
    finished,
    gpt2_setup,
    gpt2_val_loss,
    parse_run,
    run_deepspeed,
    schedule,
    train_reference,
)

RUNS = "bp,fdg_k2_b0.5,fdg_k2_b1.0,ref_k2_b0.5,ref_k3_b0.5,ref_k3_b1.0"  # docs/results/convergence/lm_convergence.md
TIE_RUNS = "bp_tied,bp_untied,fdg_k2_b0.5_tied,fdg_k2_b0.5_untied"  # tied vs untied at K = 2


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
