"""Predicted FDG tick time of GPT-2 splits: what a staleness-friendly split costs in speed.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.studies.lm_split_times --out <file>.json [--split 4:0,1,2,4,8 ...]

Times every pipeline layer of benchmarks/convergence/lm_convergence.py's GPT-2 (embedding, 6 blocks, head with the
loss) on one micro-batch of 8 × 128 tokens with its AdamW step (fdg_schedule.partitioning.profile, one thread), then
predicts each split's per-stage tick time under FDG with ``"stashed"`` weights and stored activations
(fdg_schedule.partitioning.partition). The pipeline runs at its slowest stage's pace, so BP's time (the whole model on
one worker) over the slowest stage's time is the speed-up the split allows at best, with a core per stage
and no communication. Splits: the decoder blocks spread evenly (lm_convergence's default,
``type:BlockPipe``), DeepSpeed's ``uniform``, the recipe's default (``balanced``: least slowest-stage time),
and any ``--split K:b0,...,bK``.
"""

import argparse
import json
from pathlib import Path

import torch
from deepspeed.runtime.utils import partition_uniform

from benchmarks.common.lm_runs import MODEL, gpt2_setup
from fdg_schedule.partitioning import partition, profile
from fdg_schedule.zoo import hf_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--split", action="append", default=[], help="K:b0,...,bK, e.g. 4:0,1,2,4,8 (repeatable)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = hf_lm.pipeline_layers(hf_lm.build_model(hf_lm.load_config(MODEL)))
    _, optimizers, batches, _ = gpt2_setup(1234, 1, 1)
    ids, labels = batches[0]
    group = optimizers[0].param_groups[0]

    def adamw(params: list) -> torch.optim.Optimizer:  # lm_fdg_k2.json's, as the runs
        return torch.optim.AdamW(params, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                 weight_decay=group["weight_decay"])  # fmt: skip

    costs = profile.profile_layers(layers, ids, labels, hf_lm.lm_loss, optimizer=adamw, device="cpu",
                                   repeats=args.repeats)  # fmt: skip
    for line in profile.describe(costs):
        print(line)
    objective = partition.Objective(weights="stashed")
    bp_s = partition.evaluate_partition(costs, [0, len(layers)], objective).bottleneck_s
    splits: list[tuple[int, str, list[int]]] = []
    for stages in (2, 4):
        blocks = hf_lm.stage_bounds(layers, stages)
        uniform = partition_uniform(len(layers), stages)  # what partition_method "uniform" cuts
        splits += [(stages, "blocks evenly (type:BlockPipe)", blocks), (stages, "uniform", uniform)]
        splits.append((stages, "balanced", partition.balanced_partition(costs, stages, objective).parts))
    for text in args.split:
        stages, bounds = text.split(":")
        splits.append((int(stages), "given", [int(b) for b in bounds.split(",")]))
    rows = []
    print(f"BP, one stage: {bp_s * 1e3:.1f} ms per micro-batch")
    for stages, name, parts in splits:
        plan = partition.evaluate_partition(costs, parts, objective)
        row = {"K": stages, "split": name, "parts": parts, "stage_ms": [s.time_s * 1e3 for s in plan.stages],
               "slowest_ms": plan.bottleneck_s * 1e3, "speedup_bound": bp_s / plan.bottleneck_s}  # fmt: skip
        rows.append(row)
        times = " / ".join(f"{s.time_s * 1e3:.1f}" for s in plan.stages)
        print(f"K = {stages} {name:32} {parts}: {times} ms, at best {row['speedup_bound']:.2f} x BP")
    layer_ms = [{"name": c.name, "forward": c.forward_s * 1e3, "backward": c.backward_s * 1e3, "step": c.step_s * 1e3}
                for c in costs.layers]  # fmt: skip
    args.out.write_text(json.dumps({"bp_ms": bp_s * 1e3, "layers_ms": layer_ms, "splits": rows}, indent=1))


if __name__ == "__main__":
    main()
