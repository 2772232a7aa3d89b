"""Train a ResNet as recipes/train_resnet.py does, but with fdg_reference: K stages in one process, no ranks.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.convergence.resnet_reference \\
        --deepspeed_config ds_configs/resnet_fdg_k4.json --stages 4 --model resnet56 --epochs 16 \\
        --train-subset 4096 --test-subset 2000 --seed 0 --final-full-test

(resnet_fdg_k4.json has ``corrections: "auto"``: here delay_momentum with delay_momentum_peak_lr 0.1, printed at
the start.) Why: FDG at K stages needs K ranks, more than a 2-core machine runs well; `fdg_reference` computes
the engine's update (equal to 1e-6 in tests/test_engine.py) tick by tick in one process. Everything
else is the recipe's, so a run here equals the recipe's run (checked in the staleness experiment log,
docs/results/staleness/experiment-log.md):

- the model split (`resnet.stage_parts`: the paper's presets, else DeepSpeed's "parameters") and the
  initial weights (every layer seeded as `PipelineModule(seed_layers=True)` seeds it);
- the data: the recipe's subsets, sampler, augmentation and loaders, consumed in the recipe's order
  (a new DataLoader iterator draws from torch's global RNG, which the augmentation also uses);
- the optimizer block of the DeepSpeed config (SGD, one per stage), its ``pipeline.fdg`` block,
  stage-local ``gradient_clipping``; the paper's step decay and ``--warmup-epochs``, set per epoch;
  ``--delay-lr-epochs`` as the recipe's (``delay_lr_ticks`` = that many epochs of ticks; refused with
  ``corrections`` "auto" or "none", which choose that key), and ``corrections: "auto"`` decided from the
  optimizer as ``deepspeed.initialize`` would (the config's lr, before the epoch's);
- one tick per micro-batch; the pipeline never drains between epochs; evaluation with the weights of
  the moment, in eval mode; a drain before the final evaluation; the same log lines, the per-stage
  staleness line of ``pipeline.fdg.staleness_every`` included (``StalenessProbe``: computed here from
  the reference's weights between ticks, not by the engine's code).
"""

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from deepspeed.runtime.utils import set_random_seed
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from fdg_schedule.base.config import FDGConfig
from fdg_schedule.corrections import auto_corrections
from fdg_schedule.corrections.reference import ReferenceState, fdg_reference
from fdg_schedule.sched import ticks as tick_math
from fdg_schedule.tools.staleness_log import format_line
from fdg_schedule.zoo import resnet, vision_data

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--deepspeed_config", required=True, help="optimizer, micro-batch and pipeline.fdg come from here")
parser.add_argument("--stages", type=int, default=1, help="K (1 = plain backprop)")
parser.add_argument("--model", default="resnet20", choices=list(resnet.MODELS))
parser.add_argument("--dataset", default="fashion-mnist", choices=vision_data.DATASETS)
parser.add_argument("--data-dir", default=None)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--train-subset", type=int, default=None)
parser.add_argument("--test-subset", type=int, default=None)
parser.add_argument("--partition", default="paper")
parser.add_argument("--lr-decay-epochs", type=int, nargs="*", default=None, help="default: the paper's, scaled")
parser.add_argument("--warmup-epochs", type=int, default=0, help="epochs at 0.1 x lr first")
parser.add_argument(
    "--delay-lr-epochs", type=float, default=None, help="pipeline.fdg.delay_lr_ticks in epochs of ticks"
)
parser.add_argument("--final-full-test", action="store_true", help="after training, also test on the whole test set")
parser.add_argument(
    "--validation", type=int, default=0, help="after training, also test on this many training-set images outside "
    "--train-subset, without augmentation (a validation split; Fashion-MNIST / MNIST)"
)  # fmt: skip
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

ds_config = json.loads(Path(args.deepspeed_config).read_text())
optimizer = ds_config.get("optimizer", {})
if optimizer.get("type", "").lower() != "sgd" or "scheduler" in ds_config:
    raise SystemExit("resnet_reference.py: error: only an SGD optimizer block and no scheduler block (the recipe's)")
if ds_config.get("gradient_accumulation_steps", 1) != 1 or ds_config.get("bf16", {}).get("enabled"):
    raise SystemExit("resnet_reference.py: error: gradient_accumulation_steps 1 and fp32 only")
pipeline = ds_config.get("pipeline", {})
fdg = FDGConfig.from_dict(pipeline.get("fdg")) if pipeline.get("schedule") == "fdg" else FDGConfig()
if args.stages > 1 and pipeline.get("schedule") != "fdg":
    raise SystemExit("resnet_reference.py: error: --stages > 1 needs a config with pipeline.schedule 'fdg'")
if args.delay_lr_epochs is not None and fdg.corrections in ("auto", "none"):  # as the recipe refuses it
    raise SystemExit(
        f"resnet_reference.py: error: --delay-lr-epochs {args.delay_lr_epochs:g} sets pipeline.fdg.delay_lr_ticks, "
        f'but pipeline.fdg.corrections is "{fdg.corrections}" in {args.deepspeed_config}, which decides that key '
        "itself; drop --delay-lr-epochs, or remove corrections and set the correction keys in the config"
    )
micro_batch = ds_config["train_micro_batch_size_per_gpu"]
torch.set_num_threads(1)

# The recipe's model, data and loaders (one data-parallel rank).
data = vision_data.load_vision_data(args.dataset, args.data_dir)
parts = resnet.stage_parts(args.model, args.stages, args.partition)
stages = resnet.build_stages(args.model, parts, data.num_classes, data.in_channels, base_seed=args.seed)
set_random_seed(args.seed)
optimizers = [torch.optim.SGD(s.parameters(), **optimizer["params"]) for s in stages]
# corrections "auto" decides here, from the optimizer as deepspeed.initialize gives it to the engine (the config's
# lr; the recipe sets each epoch's lr afterwards); fdg_reference keeps a resolved config (Note [the auto rule])
fdg, choice = auto_corrections.resolve(fdg, optimizers[0], None, args.stages)
if choice is not None:
    print(choice.line(), flush=True)
train_set = vision_data.subset(data.train, args.train_subset, args.seed)
test_set = vision_data.subset(data.test, args.test_subset, args.seed)
sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True)
train_iter = vision_data.forever(DataLoader(train_set, micro_batch, sampler=sampler, drop_last=True))
steps_per_epoch = len(train_set) // micro_batch
if args.delay_lr_epochs is not None:  # as the recipe: this many epochs of ticks (one tick per micro-batch)
    fdg = dataclasses.replace(fdg, delay_lr_ticks=max(1, round(args.delay_lr_epochs * steps_per_epoch)))
ticks = args.epochs * steps_per_epoch
base_lr = optimizer["params"]["lr"]


class MicroBatches:
    """Micro-batch i of the run, read from the training iterator when stage 0 first asks for it
    (so the reads interleave with evaluations as in the recipe); kept until the last stage used it."""

    def __init__(self, source: Iterator[tuple[Tensor, Tensor]], length: int, keep: int) -> None:
        self.source, self.length, self.keep = source, length, keep
        self.read: dict[int, tuple[Tensor, Tensor]] = {}
        self.count = 0  # micro-batches read so far

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        while self.count <= index:
            self.read[self.count] = next(self.source)
            self.read.pop(self.count - self.keep, None)
            self.count += 1
        return self.read[index]


def evaluate(dataset) -> tuple[float, float]:
    """Test accuracy and loss with the current weights (the recipe's padded micro-batches)."""
    loader = DataLoader(Subset(dataset, list(range(len(dataset)))), micro_batch, shuffle=False)
    correct = count = loss = 0.0
    for stage in stages:
        stage.eval()
    with torch.no_grad():
        for x, labels in vision_data.padded_batches(loader, micro_batch, math.ceil(len(dataset) / micro_batch)):
            logits = x
            for stage in stages:
                logits = stage(logits)
            counted = labels != -100
            correct += (logits.argmax(1) == labels)[counted].sum().item()
            count += counted.sum().item()
            loss += F.cross_entropy(logits.float(), labels, reduction="sum").item()
    for stage in stages:
        stage.train()
    return correct / count, loss / count


def set_lr(epoch: int) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = resnet.paper_lr(base_lr, epoch, args.epochs, args.lr_decay_epochs, args.warmup_epochs)


losses: list[float] = []  # every micro-batch's loss, in order (the last stage computes them)
criterion = nn.CrossEntropyLoss()


def loss_fn(outputs: Tensor, labels: Tensor) -> Tensor:
    loss = criterion(outputs, labels)
    if not math.isfinite(loss.item()):  # as the engine's default pipeline.fdg.nonfinite "error"
        raise FloatingPointError(f"non-finite loss {loss.item()} at micro-batch {len(losses)}: the run diverged")
    losses.append(loss.item())
    return loss


class StalenessProbe:
    """The engine's staleness metric (``pipeline.fdg.staleness_every`` N) from fdg_reference's weights.

    Within a tick, stage k steps before its forward and nothing changes its weights after it, so at the
    end of tick t its parameters W_k(t) (plus h·δ when predicting) are the weights the forward of tick t
    used, and the backward of that micro-batch, in tick t + d_k before that tick's step, applies its
    gradient to W_k(t + d_k − 1). For the micro-batch entering a delayed stage in a tick with t mod N = 0:
    ‖w_fwd − w_bwd‖ / ‖w_bwd‖ over the stage's trainable parameters.
    """

    def __init__(self, every: int, state: ReferenceState) -> None:
        self.every, self.state = (every if len(stages) > 1 else 0), state
        self.kept: list[dict[int, list[Tensor]]] = [{} for _ in stages]  # stage -> backward tick -> w_fwd
        # the delayed stages' trainable parameters (the optimizers update them in place)
        self.params = [[(name, p) for name, p in stage.named_parameters() if p.requires_grad] for stage in stages[:-1]]
        self.values: list[list[tuple[int, float]]] = [[] for _ in stages]  # (the backward's tick, value)

    def after_tick(self, tick: int) -> None:
        if not self.every:
            return
        K = len(stages)
        for k, params in enumerate(self.params):
            w_fwd = self.kept[k].pop(tick + 1, None)  # its backward comes in the next tick
            if w_fwd is not None:
                with torch.no_grad():
                    moved = [a - p for a, (_, p) in zip(w_fwd, params)]
                    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m) for m in moved]))
                    live = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p) for _, p in params]))
                self.values[k].append((tick + 1, float(norm / live)))
            if tick % self.every == 0 and 0 <= tick - k < ticks:  # a micro-batch entered stage k this tick
                delta = self.state.delta.get(k)
                h = tick_math.prediction_ticks(K, k, fdg.predict_horizon) / fdg.accumulate
                with torch.no_grad():
                    self.kept[k][tick + tick_math.delay(K, k)] = [
                        p + h * delta[name] if delta is not None and name in delta else p.clone() for name, p in params
                    ]

    def line(self, until: float) -> str | None:
        """The recipe's per-epoch line (fdg_schedule.tools.staleness_log) of the measurements whose backward ran
        before tick ``until`` (the engine reports one in the call of its backward) and not in an earlier line."""
        now = [[value for at, value in v if at < until] for v in self.values]
        self.values = [[(at, value) for at, value in v if at >= until] for v in self.values]
        return format_line({k: (statistics.median(v), len(v)) for k, v in enumerate(now) if v})


reference_state = ReferenceState()
staleness = StalenessProbe(fdg.staleness_every, reference_state)
epoch_start = wall_start = time.time()
train_time = 0.0
last_test: tuple[float, float] = (float("nan"), float("nan"))  # accuracy, loss


def end_of_epoch(epoch: int) -> None:
    """The recipe's epoch line: its train_loss is the mean of what stage 0's train_batch returned, the
    losses of the micro-batches stage 0 back-propagated in the epoch's ticks (the fill's are NaN)."""
    global epoch_start, train_time, last_test
    train_time += time.time() - epoch_start
    delay = 2 * (args.stages - 1)
    ticks_of_epoch = range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
    seen = [losses[t - delay] for t in ticks_of_epoch if t - delay >= 0]
    train_loss = sum(seen) / len(seen) if seen else float("nan")
    test_acc, test_loss = last_test = evaluate(test_set)
    lr = optimizers[0].param_groups[0]["lr"]
    print(
        f"epoch {epoch + 1}/{args.epochs}: train_loss {train_loss:.6f} test_loss {test_loss:.6f} "
        f"test_acc {test_acc:.2%} lr {lr:.4g} ({time.time() - epoch_start:.1f} s)",
        flush=True,
    )
    line = staleness.line(until=(epoch + 1) * steps_per_epoch if epoch + 1 < args.epochs else math.inf)
    if line:
        print(line, flush=True)
    if epoch + 1 < args.epochs:
        set_lr(epoch + 1)
    epoch_start = time.time()


def after_tick(tick: int) -> None:
    staleness.after_tick(tick)
    if (tick + 1) % steps_per_epoch == 0 and tick + 1 < ticks:  # the last epoch ends after the drain
        end_of_epoch(tick // steps_per_epoch)


print(
    f"{args.model} on {args.dataset}: {args.stages} stage(s) in one process (fdg_reference), partition {parts}, "
    f"{len(train_set)} train / {len(test_set)} test images, {steps_per_epoch} steps/epoch of {micro_batch}",
    flush=True,
)
set_lr(0)
fdg_reference(
    stages,
    optimizers,
    MicroBatches(train_iter, ticks, keep=2 * args.stages),
    loss_fn,
    fdg,
    drain=True,
    clip_grad_norm=float(ds_config.get("gradient_clipping", 0.0)),
    after_tick=after_tick,
    state=reference_state,
)
end_of_epoch(args.epochs - 1)
test_acc, test_loss = last_test
if args.final_full_test:
    full_acc, full_loss = evaluate(data.test)
    print(f"full test set: test_acc {full_acc:.2%} test_loss {full_loss:.6f} ({len(data.test)} images)")
if args.validation:  # the training images after the subset's, in the subset's order, without augmentation
    held_out = vision_data.held_out(args.dataset, args.data_dir, args.train_subset, args.validation, args.seed)
    val_acc, val_loss = evaluate(held_out)
    print(f"validation: test_acc {val_acc:.2%} test_loss {val_loss:.6f} ({len(held_out)} images)")
print(
    f"final: test_acc {test_acc:.2%} test_loss {test_loss:.4f} | "
    f"{ticks * micro_batch / max(train_time, 1e-9):.1f} samples/s | wall {time.time() - wall_start:.1f} s | "
    f"{args.model} {args.dataset} K={args.stages} fdg_reference",
    flush=True,
)
