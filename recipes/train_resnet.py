"""Train and evaluate a ResNet with FDG, 1F1B or plain backprop; the DeepSpeed config picks the schedule.

    # FDG, K=2 stages on 2 CPU processes, ResNet-20 on Fashion-MNIST (apt-get install dataset-fashion-mnist)
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 recipes/train_resnet.py \\
        --deepspeed_config ds_configs/resnet_fdg_k2.json --epochs 3 --train-subset 6000

    # the same with the 1F1B baseline, or single-stage backprop (one process = one stage)
    ... deepspeed --num_gpus 2 recipes/train_resnet.py --deepspeed_config ds_configs/resnet_1f1b.json ...
    ... deepspeed --num_gpus 1 recipes/train_resnet.py --deepspeed_config ds_configs/resnet_bp.json ...

The number of stages K is the number of processes divided by --data-parallel size (one process per
stage by default). On CPU ``--num_gpus N`` still starts N ranks (gloo). The DeepSpeed config holds the
batch size, the optimizer (the paper's SGD: lr 0.1, momentum 0.9, weight decay 5e-4) and the
pipeline schedule; this script owns the epoch loop. DeepSpeed has no step-decay scheduler block, so
unless the config has a "scheduler" block the learning rate is divided by 10 at the paper's epochs
(150, 225, 275 of 300, scaled to --epochs). ``--warmup-epochs N`` runs the first N epochs at a
constant 0.1 x lr, as the paper's code does (it warms up for 3); with the staleness corrections at K >= 3
the ResNets measured ended lower without it (docs/staleness.md). DeepSpeed's own warm-ups work through
the config instead: a "scheduler" block with "type": "WarmupLR" or "WarmupDecayLR" (FDG steps it once
per optimizer step: every `accumulate` ticks) replaces the step decay.

FDG's gradient shrinking factor beta ("grad_shrink") in ds_configs: 0.2 at K=2 (the paper's best for
ResNet-20 at K=2), no staleness correction. At K=3 and K=4 the configs set "corrections": "auto" with
"stashed" weights and beta 1 (docs/staleness.md): for SGD with momentum deepspeed.initialize then
chooses delay_momentum with delay_momentum_peak_lr = the peak lr (the config's lr; with
resnet_fdg_k4_warmuplr.json, DeepSpeed's WarmupLR, the scheduler's peak); at lr 0.1 "current" weights
diverge there. ``--delay-lr-epochs E`` sets pipeline.fdg.delay_lr_ticks to E epochs of ticks (one tick
per micro-batch), for a config that sets its correction keys itself: next to "corrections" "auto" or
"none" it is refused, since those choose the keys.

Time to a loss (docs/token-overhead.md): ``--eval-interval N`` also evaluates every N steps, ``--val-images N``
evaluates on N training images held out from ``--train-subset`` instead of the test set (MNIST, Fashion-MNIST),
``--target-loss L`` stops every rank at the first evaluation at or below L, and ``--metrics FILE`` writes a JSON
line per step and per evaluation with ``train_s``, the training seconds with evaluations and checkpoints left out
(the ranks meet at a barrier before each evaluation), which ``python -m fdg_schedule.plan.token_overhead BASE FDG
--by train_s`` reads.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import set_random_seed
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

import fdg_schedule  # noqa: F401  (installs the FDG pipeline engine before deepspeed.initialize)
from fdg_schedule.base import host_memory
from fdg_schedule.partitioning import pipe_partition
from fdg_schedule.tools.stage_times import StageClock, stage_report
from fdg_schedule.tools.staleness_log import StalenessLog
from fdg_schedule.zoo import resnet, vision_data

# -----------------------------------------------------------------------------
# defaults (a short CPU run; the paper trains 300 epochs on CIFAR)
model_name = "resnet20"
dataset = "fashion-mnist"
epochs = 3
train_subset = None  # use only this many training images (a fixed random subset)
test_subset = None
max_steps = None  # stop after this many train_batch calls in total
partition = (
    "balanced"  # measured layer times; or "paper" (the FDG paper's split), "parameters", "uniform", "parts:0,5,12"
)
profile_dir = "runs/profiles"  # layer profiles for "balanced", measured once per model / micro-batch / machine
freed_memory = "retain"  # on CPU: "retain" keeps freed memory in the process (fdg_schedule.base.host_memory); "system"
warmup_epochs = 0  # epochs at a constant 0.1 x lr before the schedule starts (the paper's code: 3)
delay_lr_epochs = None  # FDG's delay_lr_ticks in epochs, explicit keys only (ResNet-20 K=4: epochs before 1st decay)
checkpoint_every = 0  # epochs; 0 = never
eval_interval = 0  # also evaluate every N steps (train_batch calls); 0: at epoch ends only
val_images = 0  # evaluate on this many held-out training images instead of the test set (0: the test set)
target_loss = 0.0  # stop at the first evaluation at or below this loss (0: never; time-to-loss runs)
metrics_file = None  # JSON lines (rank 0): one per step and one per evaluation, with train_s
seed = 0
default_config = Path(__file__).resolve().parents[1] / "ds_configs" / "resnet_fdg_k2.json"
# -----------------------------------------------------------------------------

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=model_name, choices=list(resnet.MODELS))
parser.add_argument("--dataset", default=dataset, choices=vision_data.DATASETS)
parser.add_argument(
    "--data-dir", default=None, help="folder with the data set files (see fdg_schedule/zoo/vision_data.py)"
)
parser.add_argument("--download", action="store_true", help="let torchvision download CIFAR (needs internet)")
parser.add_argument("--epochs", type=int, default=epochs)
parser.add_argument("--train-subset", type=int, default=train_subset)
parser.add_argument("--test-subset", type=int, default=test_subset)
parser.add_argument("--max-steps", type=int, default=max_steps)
parser.add_argument("--pipeline-parallel-size", type=int, default=None, help="stages K (default: world size)")
parser.add_argument("--partition", default=partition)
parser.add_argument("--profile-dir", default=profile_dir, help="where --partition balanced caches layer timings")
parser.add_argument("--freed-memory", default=freed_memory, choices=("retain", "system"))
parser.add_argument("--lr-decay-epochs", type=int, nargs="*", default=None, help="default: the paper's, scaled")
parser.add_argument("--warmup-epochs", type=int, default=warmup_epochs, help="epochs at 0.1 x lr first")
parser.add_argument(
    "--delay-lr-epochs",
    type=float,
    default=delay_lr_epochs,
    help="FDG: set pipeline.fdg.delay_lr_ticks to this many epochs of ticks (K=4: the epochs before the first decay)",
)
parser.add_argument("--final-full-test", action="store_true", help="after training, also test on the whole test set")
parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (0 keeps the CPU for the model)")
parser.add_argument("--checkpoint-dir", default=None, help="default: checkpoints/<model>_<config name>")
parser.add_argument("--checkpoint-every", type=int, default=checkpoint_every)
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
parser.add_argument("--eval-interval", type=int, default=eval_interval, help="also evaluate every N steps")
parser.add_argument(
    "--val-images",
    type=int,
    default=val_images,
    help="evaluate on N training images outside --train-subset, not augmented, instead of the test set (MNIST, "
    "Fashion-MNIST)",
)
parser.add_argument("--target-loss", type=float, default=target_loss, help="stop at the first evaluation <= this")
parser.add_argument("--metrics", default=metrics_file, help="write JSON lines here: a row per step and evaluation")
parser.add_argument("--seed", type=int, default=seed)
parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
args.deepspeed_config = args.deepspeed_config or str(default_config)

# Everything that can be wrong with the command is checked here, before any process waits on another.
world_size = int(os.environ.get("WORLD_SIZE", "1"))
stages = args.pipeline_parallel_size or world_size
layer_count = resnet.num_layers(args.model)
if stages > layer_count:
    parser.error(f"{stages} pipeline stages but {args.model} has only {layer_count} layers; use at most {layer_count}")
if world_size % stages:
    parser.error(f"world size {world_size} is not a multiple of --pipeline-parallel-size {stages}")
if args.partition == "paper" and stages > 1 and stages not in resnet.PAPER_SPLITS.get(args.model, {}):
    args.partition = "parameters"  # no preset for this model and K: DeepSpeed balances parameters instead
if args.eval_interval < 0 or args.val_images < 0 or args.target_loss < 0:
    parser.error(
        f"--eval-interval {args.eval_interval}, --val-images {args.val_images}, --target-loss {args.target_loss:g}: "
        "none may be negative (0 turns each off)"
    )
if args.val_images and args.dataset not in ("mnist", "fashion-mnist"):
    parser.error(
        f"--val-images {args.val_images}: a held-out validation split is built for mnist and fashion-mnist, not "
        f"{args.dataset}; drop it to evaluate on the test set"
    )
config_path = args.deepspeed_config
with open(config_path) as f:
    ds_config = json.load(f)
if args.delay_lr_epochs is not None:
    fdg_block = ds_config.get("pipeline", {}).get("fdg")
    if not args.delay_lr_epochs > 0:
        parser.error(
            f"--delay-lr-epochs {args.delay_lr_epochs:g}: must be > 0 (omit it to keep the config's delay_lr_ticks)"
        )
    if ds_config.get("pipeline", {}).get("schedule") != "fdg" or fdg_block is None:
        parser.error(
            f"--delay-lr-epochs sets pipeline.fdg.delay_lr_ticks, but {config_path} is not an FDG config "
            '(pipeline.schedule "fdg" with a pipeline.fdg block); drop the option or use an FDG config'
        )
    if fdg_block.get("corrections") in ("auto", "none"):
        parser.error(
            f"--delay-lr-epochs {args.delay_lr_epochs:g} sets pipeline.fdg.delay_lr_ticks, but "
            f'pipeline.fdg.corrections is "{fdg_block["corrections"]}" in {config_path}, which decides that key '
            "itself; drop --delay-lr-epochs, or remove corrections and set the correction keys in the config"
        )
    if fdg_block.get("delay_lr_ticks"):
        parser.error(
            f"--delay-lr-epochs {args.delay_lr_epochs:g} and pipeline.fdg.delay_lr_ticks "
            f"{fdg_block['delay_lr_ticks']} in {config_path} both set the delay_lr ramp; keep one"
        )
try:
    data = vision_data.load_vision_data(args.dataset, args.data_dir, download=args.download)
except vision_data.DataMissingError as error:
    raise SystemExit(f"train_resnet.py: error: {error}") from None
if "wandb" in ds_config and ds_config["wandb"].get("enabled"):
    # Offline unless the user has logged in to W&B (an API key in the environment or in ~/.netrc).
    netrc = Path.home() / ".netrc"
    logged_in = "WANDB_API_KEY" in os.environ or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    os.environ.setdefault("WANDB_MODE", "online" if logged_in else "offline")
    os.environ.setdefault("WANDB_DIR", "runs")
    Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)  # so that `python recipes/train_resnet.py` runs as one process
os.environ.setdefault("MASTER_PORT", "29511")

deepspeed.init_distributed()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
if args.freed_memory == "retain" and get_accelerator().device_name() == "cpu":
    host_memory.retain_freed_memory()  # before profiling: otherwise page faults take a share of every step
input_dtype = torch.float32  # inputs match weights: bf16's or fp16's
if ds_config.get("bf16", {}).get("enabled"):
    input_dtype = torch.bfloat16
elif ds_config.get("fp16", {}).get("enabled"):
    input_dtype = torch.float16


def batch_shape(ds_config, dp_size):
    """(micro-batch per rank, micro-batches per step) from the config, as DeepSpeed derives them (any two of
    train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps), before initialize."""
    gas, micro, batch = (
        ds_config.get(key)
        for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")
    )
    per_step = gas or (batch // (micro * dp_size) if batch and micro else 1)
    return micro or batch // (per_step * dp_size), per_step


if args.partition == "balanced" and stages > 1:
    # Time every layer on one real micro-batch (rank 0, once per model and machine: cached), then split.
    micro, _ = batch_shape(ds_config, world_size // stages)
    sample_x, sample_y = next(iter(DataLoader(data.train, micro)))
    args.partition = pipe_partition.profile_and_balance(
        resnet.resnet_layers(args.model, data.num_classes, data.in_channels),
        sample_x.to(input_dtype),
        sample_y,
        F.cross_entropy,
        ds_config,
        args.profile_dir,
    )
elif args.partition == "balanced":
    args.partition = "uniform"  # one stage: nothing to balance
# Data: the first stage reads images; the last stage reads the labels of the same items in the same order.
train_set = vision_data.subset(data.train, args.train_subset, args.seed)
test_set = vision_data.subset(data.test, args.test_subset, args.seed)
if args.val_images:  # the training images after the subset's, in the subset's order (vision_data.held_out)
    try:
        eval_set = vision_data.held_out(args.dataset, args.data_dir, args.train_subset, args.val_images, args.seed)
    except ValueError as error:
        raise SystemExit(f"train_resnet.py: error: --val-images {args.val_images}: {error}") from None
else:
    eval_set = test_set
eval_name = "val" if args.val_images else "test"  # the metrics' and the log's names: val_loss or test_loss


def ticks_per_epoch(micro_batch, per_step, dp_size):
    """FDG runs one tick per micro-batch, and an epoch runs whole steps of `per_step` micro-batches."""
    return len(train_set) // (micro_batch * per_step * dp_size) * per_step


if args.delay_lr_epochs is not None:
    micro, per_step = batch_shape(ds_config, world_size // stages)
    ticks = ticks_per_epoch(micro, per_step, world_size // stages)
    ds_config["pipeline"]["fdg"]["delay_lr_ticks"] = max(1, round(args.delay_lr_epochs * ticks))
    args.deepspeed_config = None  # the edited config goes to deepspeed.initialize as a dict
set_random_seed(args.seed)
net = resnet.build_pipeline(
    args.model,
    stages,
    num_classes=data.num_classes,
    in_channels=data.in_channels,
    partition=args.partition,
    base_seed=args.seed,
)
set_random_seed(args.seed)  # building reseeded per layer; augmentation starts from the same state for every K
engine, _, _, _ = deepspeed.initialize(
    args=args,
    model=net,
    model_parameters=[p for p in net.parameters() if p.requires_grad],
    config=None if args.deepspeed_config else ds_config,
)
rank = dist.get_rank()
logging_rank = rank == 0  # DeepSpeed's monitors also write from global rank 0
first, last = engine.is_first_stage(), engine.is_last_stage()
dp_rank, dp_size = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
micro_batch, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
clock = StageClock(engine)  # per-stage compute and wait, reported against the split's prediction at the end
schedule = engine._config.pipeline.get("schedule", "1f1b")

samples_per_step = micro_batch * accumulation * dp_size
steps_per_epoch = len(train_set) // samples_per_step
if steps_per_epoch == 0:
    raise SystemExit(f"train_resnet.py: error: {len(train_set)} training images < one batch of {samples_per_step}")
delay_lr_ticks = ds_config.get("pipeline", {}).get("fdg", {}).get("delay_lr_ticks", 0)
if args.delay_lr_epochs is not None:
    expected = max(1, round(args.delay_lr_epochs * ticks_per_epoch(micro_batch, accumulation, dp_size)))
    if delay_lr_ticks != expected:  # the config's batch arithmetic above disagrees with DeepSpeed's
        raise SystemExit(
            f"train_resnet.py: error: --delay-lr-epochs gave {delay_lr_ticks} ticks, the engine's batch {expected}"
        )


def stage_view(dataset):
    return dataset if first else vision_data.LabelsOnly(dataset)


def test_loader_of(dataset):
    """This rank's share of a test set, in order (the stages that read no data get None)."""
    if not (first or last):
        return None
    shard = Subset(dataset, list(range(dp_rank, len(dataset), dp_size)))
    return DataLoader(stage_view(shard), micro_batch, shuffle=False, num_workers=args.num_workers)


train_iter = None
if first or last:
    sampler = DistributedSampler(
        train_set, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True
    )
    train_loader = DataLoader(
        stage_view(train_set), micro_batch, sampler=sampler, drop_last=True, num_workers=args.num_workers
    )
    train_iter = ((x.to(input_dtype), y) for x, y in vision_data.forever(train_loader))
eval_loader = test_loader_of(eval_set)


def evaluate(dataset=eval_set, loader=eval_loader):
    """Loss and accuracy on the test set (or --val-images) with the current weights, summed over the last stage's
    data-parallel ranks."""
    totals = torch.zeros(3, dtype=torch.float64)  # correct, count, summed loss
    eval_batches = math.ceil(math.ceil(len(dataset) / dp_size) / micro_batch)  # the same on every rank
    batches = vision_data.padded_batches(loader, micro_batch, eval_batches) if loader else None
    for _ in range(eval_batches):
        batch = next(batches) if batches else None
        data_iter = iter([(batch[0].to(input_dtype), batch[1])]) if batch else iter([])
        _, logits = engine.eval_batch(data_iter, return_logits=True, num_micro_batches=1, bcast_loss=False)
        if last:
            labels = batch[1]
            counted = labels != -100
            totals[0] += (logits.argmax(1) == labels)[counted].sum().item()
            totals[1] += counted.sum().item()
            totals[2] += F.cross_entropy(logits.float(), labels, reduction="sum").item()
    dist.all_reduce(totals)  # other stages add zeros; rank 0 needs the numbers for the log and the monitor
    return totals[0].item() / totals[1].item(), totals[2].item() / totals[1].item()


# FDG: every stage's pipeline.fdg.staleness_every metric, one line per epoch (docs/staleness.md)
staleness_log = StalenessLog(engine) if hasattr(engine, "fdg_stats") else None


def drain():
    if hasattr(engine, "drain"):  # FDG: finish the backwards still in flight
        engine.drain()
        if staleness_log:
            staleness_log.collect()


checkpoint_dir = args.checkpoint_dir or f"checkpoints/{args.model}_{Path(config_path).stem}"
base_lr = engine.optimizer.param_groups[0]["lr"]
start_epoch = 0
if args.resume:
    bf16 = engine.bfloat16_enabled()
    path, client_state = engine.load_checkpoint(checkpoint_dir, load_optimizer_states=not bf16)
    if path is None:
        raise SystemExit(f"train_resnet.py: error: --resume but no checkpoint in {checkpoint_dir}")
    if bf16:
        # DeepSpeed 0.19.8 saves the bf16 optimizer's state as one dict but loads it as a list indexed
        # by data-parallel rank (KeyError: 0, with 1F1B too); load it here, fp32 master weights included.
        state = torch.load(path, map_location="cpu", weights_only=False)["optimizer"]
        engine.optimizer.load_state_dict([state] * dp_size, load_from_fp32_weights=True)
    start_epoch = client_state["epoch"] + 1
    base_lr = client_state["base_lr"]
    if logging_rank:
        print(f"resumed from {path} at epoch {start_epoch}")

metrics = Path(args.metrics) if args.metrics else None
if metrics and logging_rank:
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text("")


def record(**row: object) -> None:
    if metrics and logging_rank:
        with open(metrics, "a") as f:
            f.write(json.dumps(row) + "\n")


if logging_rank:
    print(
        f"{args.model} on {args.dataset}: {stages} stage(s) x {dp_size} data-parallel, schedule {schedule}, "
        f"partition {net.parts}, {len(train_set)} train / {len(eval_set)} {eval_name} images, "
        f"{steps_per_epoch} steps/epoch of {samples_per_step}"
        + (f", delay_lr_ticks {delay_lr_ticks}" if delay_lr_ticks else "")
    )
step = 0
wall_start = train_start = time.time()
untimed_s = 0.0  # evaluations and checkpoints: the training seconds (train_s) leave them out
test_acc = test_loss = float("nan")
reached = False  # --target-loss: an evaluation at or below it ends the run on every rank


def timed_evaluation():
    """(accuracy, loss) now, recorded with the training seconds so far. The ranks meet first, so that the clock
    reads the pipeline's training time and not one stage's lead."""
    global untimed_s
    dist.barrier()
    eval_start = time.time()
    train_s = eval_start - train_start - untimed_s
    acc, loss = evaluate()  # every rank gets the numbers (all_reduce)
    untimed_s += time.time() - eval_start
    samples = step * samples_per_step
    row = {f"{eval_name}_loss": loss, f"{eval_name}_acc": acc}
    record(step=step, samples=samples, **row, time=time.time() - train_start, train_s=train_s)
    return acc, loss


def target_reached(loss):
    if args.target_loss and loss <= args.target_loss:
        if logging_rank:
            print(f"{eval_name} loss {loss:.4f} reached --target-loss {args.target_loss:g}: stopping at step {step}")
        return True
    return False


for epoch in range(start_epoch, args.epochs):
    if "scheduler" not in ds_config:
        for group in engine.optimizer.param_groups:
            group["lr"] = resnet.paper_lr(base_lr, epoch, args.epochs, args.lr_decay_epochs, args.warmup_epochs)
    epoch_start, losses = time.time(), []
    bar = tqdm(  # samples/s and ETA on the logging rank at a terminal; per-epoch lines otherwise
        total=steps_per_epoch * engine.train_batch_size(),
        desc=f"epoch {epoch + 1}/{args.epochs}",
        unit="sample",
        disable=None if logging_rank else True,
        mininterval=1.0,
        dynamic_ncols=True,
    )
    for index in range(steps_per_epoch):
        loss = engine.train_batch(data_iter=train_iter)
        if staleness_log:
            staleness_log.collect()
        if loss is not None and not math.isnan(loss):  # FDG: NaN until the first loss travels back
            losses.append(float(loss))
            bar.set_postfix(step=step, loss=f"{losses[-1]:.3f}", refresh=False)
        bar.update(engine.train_batch_size())
        step += 1
        elapsed = time.time() - train_start
        train_loss_now = float(loss) if loss is not None else float("nan")
        record(step=step, samples=step * samples_per_step, train_loss=train_loss_now, time=elapsed,
               train_s=elapsed - untimed_s)  # fmt: skip
        if args.max_steps is not None and step >= args.max_steps:
            break
        if args.eval_interval and step % args.eval_interval == 0 and index < steps_per_epoch - 1:
            test_acc, test_loss = timed_evaluation()  # (at the epoch's end the evaluation below runs)
            if logging_rank:
                print(f"step {step}: {eval_name}_loss {test_loss:.6f} {eval_name}_acc {test_acc:.2%}", flush=True)
            if target_reached(test_loss):
                reached = True
                break
    bar.close()
    final_epoch = epoch == args.epochs - 1 or (args.max_steps is not None and step >= args.max_steps) or reached
    if final_epoch:
        drain()
    if not reached:  # (a run stopped at the target ends with the evaluation that reached it)
        test_acc, test_loss = timed_evaluation()
        if target_reached(test_loss):
            reached = True
            if not final_epoch:
                drain()  # FDG: finish the backwards still in flight before the checkpoint and the report
            final_epoch = True
    train_loss = sum(losses) / len(losses) if losses else float("nan")
    staleness = staleness_log.line() if staleness_log else None  # every rank: a gather
    if logging_rank:
        print(
            f"epoch {epoch + 1}/{args.epochs}: train_loss {train_loss:.6f} {eval_name}_loss {test_loss:.6f} "
            f"{eval_name}_acc {test_acc:.2%} lr {engine.optimizer.param_groups[0]['lr']:.4g} "
            f"({time.time() - epoch_start:.1f} s)",
            flush=True,
        )
        if staleness:
            print(staleness, flush=True)
        if engine.monitor.enabled:
            samples = engine.global_samples
            split = "Validation" if args.val_images else "Test"
            engine.monitor.write_events(
                [(f"{split}/accuracy", test_acc, samples), (f"{split}/loss", test_loss, samples)]
            )
    if args.checkpoint_every and ((epoch + 1) % args.checkpoint_every == 0 or final_epoch):
        checkpoint_start = time.time()
        drain()
        engine.save_checkpoint(
            checkpoint_dir, tag=f"epoch{epoch + 1}", client_state={"epoch": epoch, "base_lr": base_lr}
        )
        untimed_s += time.time() - checkpoint_start
    if final_epoch:
        break
train_time = time.time() - train_start - untimed_s

if args.final_full_test:  # the curve may use a test subset; the final number the whole test set
    full_acc, full_loss = evaluate(data.test, test_loader_of(data.test))
    if logging_rank:
        print(f"full test set: test_acc {full_acc:.2%} test_loss {full_loss:.6f} ({len(data.test)} images)")
trained_samples = step * samples_per_step
if engine.fp16_enabled():  # each stage's loss scale at its last step and its skipped steps (FDG: docs/fdg.md)
    scale = getattr(engine, "fdg_stats", {}).get("loss_scale", engine.optimizer.loss_scale)
    scales = [None] * dist.get_world_size()
    dist.all_gather_object(scales, (engine.stage_id, scale, engine.skipped_steps))
    if logging_rank:
        stages_fp16 = sorted(set(scales))
        print("fp16: " + ", ".join(f"stage {k} loss scale {s:g}, {n} skipped" for k, s, n in stages_fp16), flush=True)
report = stage_report(engine, clock)
if logging_rank:
    print(report, flush=True)
    print(
        f"final: {eval_name}_acc {test_acc:.2%} {eval_name}_loss {test_loss:.4f} | "
        f"{trained_samples / max(train_time, 1e-9):.1f} samples/s | wall {time.time() - wall_start:.1f} s | "
        f"{args.model} {args.dataset} K={stages} {schedule}",
        flush=True,
    )
# gloo's worker threads must not outlive the interpreter: exiting without this can abort (SIGABRT)
dist.barrier()
dist.destroy_process_group()
