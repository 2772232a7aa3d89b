"""Issue 64's held-out tasks: two LMs on text no run here had used and a new vision architecture on unused MNIST.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.common.auto_v2_tasks describe          # sizes: texts, tokens, blocks, layers, parameters

``build(task, seed, stages, micro_batches, split)`` gives what a run on ``fdg_reference`` needs: the stage
modules (the pipeline layers cut at ``bounds``), the training micro-batches, the evaluation batches and the loss.
Optimizers, schedules and the FDG settings are the runner's (the pre-registration's), not the task's.

- ``lm_llama``: LLaMA-style (``LlamaConfig``: RMSNorm, SwiGLU, rotary), **12** decoder layers, width 96, MLP
  256, 4 heads, 2 KV heads, untied: 14 pipeline layers; the kernel's documentation (Debian ``linux-doc-6.1``).
- ``lm_gpt2``: GPT-2-style (``GPT2Config``: LayerNorm, GELU MLP, learned positions), **8** blocks, width 128,
  4 heads, untied: 10 pipeline layers; the Jargon File, the Debian Reference, the GNU Coding Standards and
  PostgreSQL 15's manual joined (heldout_text.JOINED).
- ``vgg``: a VGG-style plain conv net (3x3 convolutions, batch norm, ReLU, max pooling, no skips): 9 pipeline
  layers; MNIST images issue 63 does not touch.

Text (Note [splits]): each source of a text (a top-level folder of the kernel's ``Documentation/``; each of the
three packages) is cut at 80 % and 90 % of its characters on line starts, in order; train, validation and test
join their parts (heldout_text.splits). A byte-level BPE of ``VOCAB`` tokens is trained on the train text alone,
each split is encoded on its own and cut into blocks of ``BLOCK`` tokens. Evaluation: ``LM_EVAL_BLOCKS`` blocks
spread evenly over the split, as issue 63's runner does.

Images: training images 16,384-49,999 train; validation: ``VISION_EVAL`` images spread evenly over training
images 52,048-59,999; test: ``VISION_EVAL`` spread evenly over test images 2,048-9,999. Issue 63 uses training
images 0-16,383 and 50,000-52,047 and test images 0-2,047 (benchmarks/convergence/time_to_loss.py): no overlap.

Training order (as issue 63's runner): the seed draws the initial weights (``torch.manual_seed(seed)`` before
the model is built) and each epoch's shuffle (``torch.Generator().manual_seed(seed * 1000 + epoch)``, a
``randperm`` of the training items, the last incomplete micro-batch dropped).

Note [splits]
    Issue 63 cut one text once (tokenizer on the first 80 % of the characters, then the token stream at 80 /
    90 %), so its test split is the last part of the last files. Here every source is cut, so train,
    validation and test hold every source in its own proportion; the tokenizer sees the train text only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.common import heldout_text, mnist_data

CACHE = heldout_text.CACHE
VOCAB, BLOCK = 4096, 128
LM_MICRO, LM_EVAL_BLOCKS = 8, 256  # blocks per micro-batch (1,024 tokens); evaluation blocks per split
VISION_MICRO, VISION_EVAL = 32, 2048
VISION_TRAIN = range(16384, 50000)  # MNIST training images
VISION_VALIDATION = range(52048, 60000)  # MNIST training images (VISION_EVAL of them, spread evenly)
VISION_TEST = range(2048, 10000)  # MNIST test images (VISION_EVAL of them, spread evenly)
TTL_IMAGES = {"train": (range(0, 16384), range(50000, 52048)), "t10k": (range(0, 2048),)}  # issue 63's

LLAMA: dict[str, Any] = {
    "model_type": "llama", "num_hidden_layers": 12, "hidden_size": 96, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": BLOCK, "vocab_size": VOCAB,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6,
}  # fmt: skip
GPT2: dict[str, Any] = {
    "model_type": "gpt2", "n_layer": 8, "n_embd": 128, "n_head": 4, "n_positions": BLOCK, "vocab_size": VOCAB,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}  # fmt: skip
VGG: tuple[tuple[int, int] | str, ...] = (  # (in, out) channels of a 3x3 convolution, or a 2x2 max pooling
    (1, 32), (32, 32), "pool", (32, 64), (64, 64), "pool", (64, 128), (128, 128), (128, 128), "pool", (128, 256),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "lm" or "vision"
    text: str | None  # heldout_text.auto_v2_sources' key (LM)
    budget: int  # a baseline's micro-batches (the pre-registration may change it; the runner passes its own)

    @property
    def per_micro(self) -> int:
        """Tokens (LM) or images (vision) per micro-batch."""
        return LM_MICRO * BLOCK if self.kind == "lm" else VISION_MICRO


TASKS = {
    "lm_llama": Task("lm_llama", "lm", "linux-doc", 1024),
    "lm_gpt2": Task("lm_gpt2", "lm", "joined", 1024),
    "vgg": Task("vgg", "vision", None, 1024),
}


@dataclasses.dataclass
class Built:
    """One run's task: stage modules, their bounds in the layer list, micro-batches, evaluation batches, loss."""

    modules: list[Any]
    bounds: list[int]
    batches: list[tuple[Any, Any]]
    evaluation: list[tuple[Any, Any]]
    loss_fn: Any
    per_micro: int


# -- text ----------------------------------------------------------------------------------------------------


def lm_texts(task: str, cache: Path = CACHE) -> tuple[str, str, str]:
    """Train, validation and test text of an LM task (heldout_text.splits of its sources)."""
    text = TASKS[task].text
    if text is None:
        raise ValueError(f"task {task!r} is not an LM task; LM tasks: {[t for t in TASKS if TASKS[t].text]}")
    return heldout_text.splits(heldout_text.auto_v2_sources(cache)[text])


def tokenizer(task: str, cache: Path = CACHE) -> Any:
    """The task's BPE (``VOCAB`` tokens), trained on its train text alone (cached by content)."""
    from fdg_schedule.zoo import text_data

    return text_data.train_tokenizer([lm_texts(task, cache)[0]], VOCAB, cache=cache)


def lm_data(task: str, cache: Path = CACHE) -> tuple[Any, Any, Any]:
    """Train, validation and test ``TokenBlocks`` of ``BLOCK`` tokens: each split encoded on its own."""
    from fdg_schedule.zoo import text_data

    tok = tokenizer(task, cache)
    return tuple(text_data.TokenBlocks(text_data.encode([t], tok, cache=cache), BLOCK) for t in lm_texts(task, cache))  # type: ignore[return-value]


def lm_layers(task: str) -> list[Any]:
    """The task's pipeline layers (random weights from the current torch seed): embedding, blocks, head."""
    from transformers import GPT2Config, LlamaConfig

    from fdg_schedule.zoo import hf_lm

    config = LlamaConfig(**LLAMA) if task == "lm_llama" else GPT2Config(**GPT2)
    return hf_lm.pipeline_layers(hf_lm.build_model(config))


# -- images --------------------------------------------------------------------------------------------------


def spread(indices: range, count: int) -> list[int]:
    """``count`` indices spread evenly over ``indices`` (the first one first), as issue 63 spreads its LM blocks."""
    stride = len(indices) / count
    return [indices[int(i * stride)] for i in range(count)]


def vision_indices() -> dict[str, tuple[str, list[int]]]:
    """Which MNIST file and images each split uses: ``{"train" | "validation" | "test": (file, indices)}``."""
    return {
        "train": ("train", list(VISION_TRAIN)),
        "validation": ("train", spread(VISION_VALIDATION, VISION_EVAL)),
        "test": ("t10k", spread(VISION_TEST, VISION_EVAL)),
    }


def vgg_layers() -> list[Any]:
    """The VGG-style net (``VGG``) as pipeline layers: each convolution with its batch norm and ReLU (a pooling
    before it joins it), then global average pooling and the linear head as the last layer: 9 layers."""
    from torch import nn

    layers: list[Any] = []
    pool = False
    for item in VGG:
        if isinstance(item, str):  # "pool": a max pooling before the next convolution
            pool = True
            continue
        c_in, c_out = item
        conv = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
        layers.append(nn.Sequential(*([nn.MaxPool2d(2)] if pool else []), *conv))
        pool = False
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_out, 10)))
    return layers


# -- one run ---------------------------------------------------------------------------------------------------


def layer_bounds(task: str, layers: list[Any], stages: int) -> list[int]:
    """LMs: the decoder blocks spread evenly, the embedding with the first and the head with the last
    (``type:BlockPipe``, hf_lm.stage_bounds); the vision net: the layers spread as evenly as they divide."""
    from fdg_schedule.zoo import hf_lm

    if TASKS[task].kind == "lm":
        return hf_lm.stage_bounds(layers, stages)
    if not 1 <= stages <= len(layers):
        raise ValueError(f"stages must be in 1..{len(layers)} for {task!r} ({len(layers)} layers), got {stages}")
    return [round(k * len(layers) / stages) for k in range(stages + 1)]


def shuffled(items: int, micro: int, count: int, seed: int) -> list[list[int]]:
    """``count`` micro-batches of item positions: a fresh ``randperm`` each epoch drawn from ``seed * 1000 +
    epoch``, the last incomplete micro-batch of an epoch dropped (issue 63's runner's order)."""
    import torch

    out: list[list[int]] = []
    epoch = 0
    while len(out) < count:
        order = torch.randperm(items, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        out.extend(order[i * micro : (i + 1) * micro] for i in range(items // micro))
        epoch += 1
    return out[:count]


def build(task: str, seed: int, stages: int, micro_batches: int, split: str, cache: Path = CACHE) -> Built:
    """Stage modules (weights drawn from ``seed``), ``micro_batches`` training micro-batches in ``seed``'s order,
    and the evaluation batches of ``split`` ("validation" or "test")."""
    import torch

    if split not in ("validation", "test"):
        raise ValueError(f"split must be 'validation' or 'test', got {split!r}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    if TASKS[task].kind == "lm":
        from fdg_schedule.zoo import hf_lm

        train, val, test = lm_data(task, cache)
        torch.manual_seed(seed)
        layers = lm_layers(task)
        batches = [(b, b) for b in (torch.stack([train[j][0] for j in idx])
                                    for idx in shuffled(len(train), LM_MICRO, micro_batches, seed))]  # fmt: skip
        part = val if split == "validation" else test
        blocks = torch.stack([part[i][0] for i in spread(range(len(part)), LM_EVAL_BLOCKS)])
        evaluation = [(c, c) for c in blocks.split(32)]
        loss_fn: Any = hf_lm.lm_loss
    else:
        data = mnist_data.mnist(cache)
        torch.manual_seed(seed)
        layers = vgg_layers()
        file, train_idx = vision_indices()["train"]
        x, y = data["images"][file], data["labels"][file]
        batches = [(x[[train_idx[i] for i in idx]], y[[train_idx[i] for i in idx]])
                   for idx in shuffled(len(train_idx), VISION_MICRO, micro_batches, seed)]  # fmt: skip
        file, eval_idx = vision_indices()[split]
        ex, ey = data["images"][file][eval_idx], data["labels"][file][eval_idx]
        evaluation = list(zip(ex.split(256), ey.split(256)))
        loss_fn = torch.nn.functional.cross_entropy
    bounds = layer_bounds(task, layers, stages)
    modules = [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(stages)]
    return Built(modules, bounds, batches, evaluation, loss_fn, TASKS[task].per_micro)


def describe(cache: Path = CACHE) -> dict[str, Any]:
    """Each task's sizes: text characters and tokens per split, blocks, layers, parameters, epochs per budget."""
    out: dict[str, Any] = {}
    for name, task in TASKS.items():
        entry: dict[str, Any] = {"budget_micro_batches": task.budget, "per_micro": task.per_micro}
        if task.kind == "lm":
            texts = lm_texts(name, cache)
            parts = lm_data(name, cache)
            entry["characters"] = dict(zip(("train", "validation", "test"), map(len, texts)))
            entry["tokens"] = {k: len(p) * BLOCK for k, p in zip(("train", "validation", "test"), parts)}
            entry["train_blocks"] = len(parts[0])
            entry["epochs_per_budget"] = task.budget * LM_MICRO / len(parts[0])
            layers = lm_layers(name)
        else:
            entry["images"] = {k: len(v[1]) for k, v in vision_indices().items()}
            entry["epochs_per_budget"] = task.budget * VISION_MICRO / len(VISION_TRAIN)
            layers = vgg_layers()
        entry["pipeline_layers"] = len(layers)
        entry["parameters"] = sum(p.numel() for m in layers for p in m.parameters())
        entry["bounds"] = {k: layer_bounds(name, layers, k) for k in (4, 8)}
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("what", choices=["describe"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = describe()
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
