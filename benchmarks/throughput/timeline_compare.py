"""Trace the same 2-stage MLP job under 1F1B and under FDG and draw them one above the other.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    .venv/bin/deepspeed --num_gpus 2 --module benchmarks.throughput.timeline_compare --schedule 1f1b
    .venv/bin/deepspeed --num_gpus 2 --module benchmarks.throughput.timeline_compare --schedule fdg
    python -m fdg_schedule.observability.timeline compare --fdg runs/timeline/fdg --one-f-one-b runs/timeline/1f1b \\
        --out docs/results/performance/timeline.png

Both runs read the same synthetic micro-batches and record micro-batches [start, start + ticks)
after a warm-up: FDG through its ``pipeline.fdg.trace`` key, 1F1B by instrumenting DeepSpeed's own
engine with ``fdg_schedule.observability.timeline.trace_one_f_one_b``. Each schedule's stages are split by measured
layer times for that schedule (``--partition balanced``, the profile cached in ``runs/profiles``);
``--partition uniform`` gives DeepSpeed's equal layer counts instead.
"""

import argparse
from pathlib import Path

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

import fdg_schedule  # noqa: F401  (selects the engine from pipeline.schedule)
from fdg_schedule.observability import observe, timeline
from fdg_schedule.partitioning import pipe_partition

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", choices=["fdg", "1f1b"], required=True)
parser.add_argument("--out", default=None, help="trace directory (default runs/timeline/<schedule>)")
parser.add_argument("--width", type=int, default=768)  # hidden size: sets the compute per stage
parser.add_argument("--depth", type=int, default=8)  # Linear+ReLU blocks, split over 2 stages
parser.add_argument("--micro_batch", type=int, default=64)
parser.add_argument("--gas", type=int, default=4)  # micro-batches per train_batch() call
parser.add_argument("--calls", type=int, default=5)
parser.add_argument("--start", type=int, default=8)  # first traced micro-batch (after warm-up)
parser.add_argument("--ticks", type=int, default=8)  # traced micro-batches
parser.add_argument("--partition", default="balanced", help="balanced, or a DeepSpeed partition_method")
parser.add_argument("--local_rank", type=int, default=0)  # set by the deepspeed launcher
args = parser.parse_args()
out = Path(args.out or f"runs/timeline/{args.schedule}")

config = {
    "train_micro_batch_size_per_gpu": args.micro_batch,
    "gradient_accumulation_steps": args.gas,
    "steps_per_print": 10**9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
    "pipeline": {"schedule": args.schedule},
}
if args.schedule == "fdg":
    config["pipeline"]["fdg"] = {"trace": {"start_tick": args.start, "ticks": args.ticks, "dir": str(out)}}

deepspeed.init_distributed(dist_backend="gloo")
g = torch.Generator().manual_seed(1)
data = [
    (torch.randn(args.micro_batch, args.width, generator=g), torch.randint(0, 10, (args.micro_batch,), generator=g))
    for _ in range(args.gas * args.calls)
]
torch.manual_seed(0)
layers = [LayerSpec(nn.Linear, args.width, args.width) if i % 2 == 0 else nn.ReLU() for i in range(2 * args.depth)]
layers.append(LayerSpec(nn.Linear, args.width, 10))
method = args.partition
if method == "balanced":
    method = pipe_partition.profile_and_balance(layers, *data[0], nn.CrossEntropyLoss(), config, "runs/profiles")
model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method=method)
engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
recorder = None
if args.schedule == "1f1b":
    recorder = timeline.trace_one_f_one_b(engine, start_tick=args.start, ticks=args.ticks, dir=out)

it = iter(data)
for _ in range(args.calls):
    loss = engine.train_batch(it)
if args.schedule == "fdg":
    engine.drain()
    observe.close_observers(engine)
else:
    assert recorder is not None
    recorder.write()
print(f"rank {engine.global_rank}: wrote {out}, last loss {loss.item():.4f}")
# gloo's worker threads must not outlive the interpreter: exiting without this can abort (SIGABRT)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
