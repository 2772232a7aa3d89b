"""A small pipeline model with every kind of layer DeepSpeed accepts, and its data, for the engine tests.

Layers: ``LayerSpec``s, raw modules, plain functions, and a pair layer whose tuple activation
(two floating tensors) crosses a stage boundary. Weights come from per-layer seeds, so the engine
(which builds only its own stage) and the reference (which builds all) start equal.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import Tensor, nn

IN, HIDDEN, CLASSES = 6, 8, 3


class SeededLinear(nn.Linear):
    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        super().__init__(n_in, n_out)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
            self.bias.copy_(torch.randn(n_out, generator=g) * 0.1)


class Pair(nn.Module):
    """h -> (h, h^2): a tuple activation of two floating tensors."""

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return h, h * h


class PairMix(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.a = SeededLinear(HIDDEN, HIDDEN, seed)
        self.b = SeededLinear(HIDDEN, HIDDEN, seed + 100)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        h, sq = pair
        return self.a(h) + 0.5 * self.b(sq)


def layers(spec: bool = True, batch_norm: bool = False, dropout: float | None = None) -> list:
    """The layer list; ``spec=False`` gives built modules (for the reference).

    ``batch_norm`` adds a BatchNorm1d on each stage side of the K=2 split (running statistics are
    buffers a recomputed forward must not update twice). ``dropout`` (not None) adds a Dropout of that
    probability near each end (a model that draws random numbers in its forward; a recomputed forward
    must draw the same masks again); ``0.0`` gives the same layers drawing nothing.
    """

    def make(cls, *args):
        return LayerSpec(cls, *args) if spec else cls(*args)

    out = [
        make(SeededLinear, IN, HIDDEN, 1),
        torch.tanh,
        make(SeededLinear, HIDDEN, HIDDEN, 2),
        make(Pair),
        make(PairMix, 3),
        lambda h: torch.tanh(h),
        SeededLinear(HIDDEN, HIDDEN, 4),  # a raw module
        torch.tanh,
        make(SeededLinear, HIDDEN, CLASSES, 5),
    ]
    if batch_norm:
        out.insert(1, make(nn.BatchNorm1d, HIDDEN))
        out.insert(8, make(nn.BatchNorm1d, HIDDEN))
    if dropout is not None:
        out.insert(2, make(nn.Dropout, dropout))
        out.insert(len(out) - 1, make(nn.Dropout, dropout))
    return out


class Chain(nn.Module):
    """Layers applied in sequence, as ``PipelineModule`` does (a tuple is passed as one argument).

    Modules are registered under their global layer index, so ``state_dict()`` keys match the
    pipeline stage's (``"6.weight"``).
    """

    def __init__(self, funcs: list, start: int) -> None:
        super().__init__()
        self.funcs = funcs
        for i, f in enumerate(funcs):
            if isinstance(f, nn.Module):
                self.add_module(str(start + i), f)

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x


def reference_stages(parts: list[int], batch_norm: bool = False) -> list[Chain]:
    built = layers(spec=False, batch_norm=batch_norm)
    return [Chain(built[a:b], a) for a, b in zip(parts[:-1], parts[1:])]


def micro_batches(n: int, size: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, IN, generator=g), torch.randint(0, CLASSES, (size,), generator=g)) for _ in range(n)]


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels)


# -- tied layers across stages (Note [tied layers across stages] in fdg_schedule/exchange/tied.py) ------------


class TiedWeight(nn.Module):
    """A weight-only linear map (a word embedding applied to dense inputs), tied to an output head."""

    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(n_out, n_in, generator=g) / n_in**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


def head(module: TiedWeight, h: Tensor) -> Tensor:
    """Megatron's tied output head: the embedding's transpose gives logits over the IN inputs."""
    return F.linear(h, module.weight.t())


class Tied:
    """A tied layer of the reference's layer list: ``key``, how to build its module, an optional forward_fn."""

    def __init__(self, key: str, build, forward_fn=None) -> None:
        self.key, self.build, self.forward_fn = key, build, forward_fn


def tied_layers(spec: bool = True, three_owners: bool = False) -> list:
    """An embedding on stage 0 tied to the head on the last stage (8 layers: uniform splits [0, 4, 8] and
    [0, 3, 6, 8]); ``three_owners`` adds a key "mid" with a copy on each of 3 stages (10 layers, [0, 4, 7, 10])."""

    def make(cls, *args):
        return LayerSpec(cls, *args) if spec else cls(*args)

    def tied(key, n_in, n_out, seed, forward_fn=None):
        if spec:
            return TiedLayerSpec(key, TiedWeight, n_in, n_out, seed, forward_fn=forward_fn)
        return Tied(key, lambda: TiedWeight(n_in, n_out, seed), forward_fn)

    if three_owners:
        return [
            tied("emb", IN, HIDDEN, 11), torch.tanh, tied("mid", HIDDEN, HIDDEN, 12),
            make(SeededLinear, HIDDEN, HIDDEN, 2),  # stage 0 ends
            tied("mid", HIDDEN, HIDDEN, 12), torch.tanh, make(SeededLinear, HIDDEN, HIDDEN, 4),  # stage 1
            make(SeededLinear, HIDDEN, HIDDEN, 6), tied("mid", HIDDEN, HIDDEN, 12), tied("emb", IN, HIDDEN, 11, head),
        ]  # fmt: skip
    return [
        tied("emb", IN, HIDDEN, 11), torch.tanh, make(SeededLinear, HIDDEN, HIDDEN, 2), torch.tanh,
        make(SeededLinear, HIDDEN, HIDDEN, 4), torch.tanh, make(SeededLinear, HIDDEN, HIDDEN, 6),
        tied("emb", IN, HIDDEN, 11, head),
    ]  # fmt: skip


class TiedChain(nn.Module):
    """A reference stage with tied layers: its copy of each tied module under ``tied_modules.<key>``, as
    ``PipelineModule`` holds it (state_dict keys match the engine's)."""

    def __init__(self, items: list, start: int) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.funcs = []
        for i, item in enumerate(items):
            if isinstance(item, Tied):
                if item.key not in self.tied_modules:
                    self.tied_modules[item.key] = item.build()
                module = self.tied_modules[item.key]
                self.funcs.append(module if item.forward_fn is None else functools.partial(item.forward_fn, module))
                continue
            if isinstance(item, nn.Module):
                self.add_module(str(start + i), item)
            self.funcs.append(item)

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x


def tied_reference(parts: list[int], three_owners: bool = False) -> tuple[list[TiedChain], list[list[tuple[int, str]]]]:
    """The reference's stages for :func:`tied_layers` and its ``ties`` argument (per key, ``(stage, name)``)."""
    built = tied_layers(spec=False, three_owners=three_owners)
    stages = [TiedChain(built[a:b], a) for a, b in zip(parts[:-1], parts[1:])]
    owners: dict[str, set[int]] = {}
    for k, (a, b) in enumerate(zip(parts[:-1], parts[1:])):
        for item in built[a:b]:
            if isinstance(item, Tied):
                owners.setdefault(item.key, set()).add(k)
    ties = [[(k, f"tied_modules.{key}.weight") for k in sorted(stages_)] for key, stages_ in sorted(owners.items())]
    return stages, [t for t in ties if len(t) > 1]


# The config "optimizer" params of the DeepSpeed-built optimizers the engine tests use beyond SGD and Adam.
DS_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Muon": {"muon_lr": 0.02, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.01, "betas": [0.9, 0.95]},
    "Lion": {"lr": 0.001, "betas": [0.9, 0.99], "weight_decay": 0.01},
}


@contextlib.contextmanager
def newton_schulz_dtype(case: dict[str, Any]) -> Iterator[None]:
    """DeepSpeed Muon's Newton-Schulz iteration in ``case["ns_dtype"]`` ("float32") while the case runs, on either
    side of a comparison (None: DeepSpeed's choice, ``ns_compute_dtype``: fp16 where the CPU has fp16 matmuls).

    The toy's rank-deficient gradients make the iteration ill-conditioned: it scales their small singular values
    up to about 480 times, so where it runs in fp16 a last-bit difference between two equal computations (the
    data-parallel all-reduce against the reference's one batch) flips fp16 roundings and comes out at the size of
    a Muon step. The data-parallel comparison pins fp32, where the same difference stays below 1e-6."""
    dtype = case.get("ns_dtype")
    if dtype is None:
        yield
        return
    from deepspeed.runtime.zero.muon import original_muon

    chosen = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = lambda ns_method="gram": getattr(torch, dtype)
    try:
        yield
    finally:
        original_muon.ns_compute_dtype = chosen


def ds_optimizer(name: str, stage: nn.Module) -> Any:
    """What ``deepspeed.initialize`` builds on the CPU from ``{"type": name, "params": DS_OPTIMIZERS[name]}`` for
    a stage: Muon with its Adam half (FusedAdam; matrices on Muon, the rest on Adam, as DeepSpeed tags them),
    or DeepSpeed's CPU Lion (offloaded: DeepSpeed has no CPU FusedLion); steps a function of their own state."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from fdg_schedule.base import optim

    params = DS_OPTIMIZERS[name]
    if name == "Lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(stage.parameters(), **params)
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    for p in stage.parameters():
        p.use_muon = p.ndim >= 2  # type: ignore[attr-defined]  (no "embed" / "lm_head" names here)
    groups = DeepSpeedEngine._muon_param_groups(list(stage.parameters()), dict(params))
    opt = MuonWithAuxAdam(groups, adam_optimizer=FusedAdam, adam_optimizer_kwargs={"adam_w_mode": True},
                          adam_w_mode=True, fallback_to_inline=True)  # fmt: skip
    optim.pure_steps(opt)
    return opt


def reference_optimizers(stages: Sequence[nn.Module], case: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The reference's per-stage optimizers (SGD, or Adam / AdamW at lr/10) and WarmupLR schedulers, as a case asks."""
    lr = case.get("lr", 0.1)
    if case.get("ds_optimizer") in DS_OPTIMIZERS:
        opts: list[Any] = [ds_optimizer(case["ds_optimizer"], s) for s in stages]
    elif case.get("optimizer", "sgd") == "adam":
        opts = [torch.optim.Adam(s.parameters(), lr=lr * 0.1) for s in stages]
    elif case.get("optimizer") == "adamw":
        opts = [torch.optim.AdamW(s.parameters(), lr=lr * 0.1, weight_decay=0.01) for s in stages]
    else:
        opts = [torch.optim.SGD(s.parameters(), lr=lr, momentum=0.9) for s in stages]
    schedulers: list[Any] = []
    if case.get("warmup"):
        from deepspeed.runtime.lr_schedules import WarmupLR

        schedulers = [WarmupLR(o, warmup_min_lr=0.0, warmup_max_lr=lr, warmup_num_steps=case["warmup"]) for o in opts]
    return opts, schedulers
