"""The optimizers the benchmarks step, by name: SGD with momentum; AdamW and Muon as the time-to-loss runs build them.

    sgd     torch's SGD, lr 0.01, momentum 0.9, no clipping: the throughput benchmark's own optimizer
    adamw   torch's AdamW, lr 1e-3 (the time-to-loss grid's middle), betas (0.9, 0.95), eps 1e-8, weight decay 0.1,
            gradient clipping 1.0 (benchmarks/convergence/time_to_loss.py: ``ADAMW``, ``CLIP["lm"]``)
    muon    DeepSpeed's Muon (``MuonWithAuxAdam``: the matrices on Muon, embeddings, head, norms and biases on its
            Adam half, tagged by DeepSpeed's own ``set_optimizer_flags``), Muon lr 0.02 (the grid's middle) and
            ``MUON``'s settings, gradient clipping 1.0; a DeepSpeed engine gets it as ``{"type": "Muon"}`` through
            ``deepspeed.initialize``, everything else from :func:`muon`, which builds what that does on the CPU

Only the optimizer's cost matters to a throughput measurement, but it is the cost of the step the runs take.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

NAMES = ("sgd", "adamw", "muon")
LR, MOMENTUM = 0.01, 0.9  # SGD: the throughput benchmark's settings
ADAMW: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# Muon (the muon_lm queue's, recipes/train_lm.py --optimizer muon): momentum, its Adam half's lr, betas, eps, decay
MUON: dict[str, Any] = {"momentum": 0.95, "adam_lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
MUON_LR = 0.02
CLIP = {"sgd": 0.0, "adamw": 1.0, "muon": 1.0}  # gradient clipping by norm (0: off), as the runs clip

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def check(name: str, option: str = "--optimizer") -> str:
    """``name`` if the benchmarks know it; else a ValueError naming it, where it came from and the choices."""
    if name not in NAMES:
        raise ValueError(f"{option} {name!r} is not an optimizer the benchmark builds: use one of {', '.join(NAMES)}")
    return name


def settings(name: str) -> dict[str, Any]:
    """What a report records next to the optimizer's name: its hyper-parameters and its clipping."""
    params: dict[str, Any] = {
        "sgd": {"lr": LR, "momentum": MOMENTUM},
        "adamw": ADAMW,
        "muon": {"muon_lr": MUON_LR, **MUON},
    }[check(name)]
    return {"params": params, "gradient_clipping": CLIP[name]}


def build(name: str, module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``module``'s parameters (a plain torch training loop's)."""
    if check(name) == "muon":
        return muon(module, MUON_LR)
    return parameter_factory(name)(list(module.parameters()))


def parameter_factory(name: str) -> Factory:
    """sgd / adamw: a callable building the optimizer from a parameter list (``deepspeed.initialize``'s
    ``optimizer=``, the layer profile's ``optimizer=``). Muon needs its parameters' names: :func:`build`."""
    if check(name) == "sgd":
        return functools.partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    if name == "adamw":
        return functools.partial(torch.optim.AdamW, **ADAMW)
    raise ValueError("muon tags its parameters by name: build it from the module (optimizers.build)")


def deepspeed_entries(name: str) -> tuple[dict[str, Any], Factory | None]:
    """The DeepSpeed config entries (clipping; Muon's ``"optimizer"`` block) and the client optimizer (None for
    Muon, which ``deepspeed.initialize`` builds from its block) that give a DeepSpeed engine optimizer ``name``."""
    entries: dict[str, Any] = {"gradient_clipping": CLIP[check(name)]}
    if name == "muon":
        entries["optimizer"] = {"type": "Muon", "params": {"muon_lr": MUON_LR, **MUON}}
        return entries, None
    return entries, parameter_factory(name)


def clip(name: str, params: Any) -> None:
    """Clip the gradients of ``params`` by their norm as the runs do with ``name`` (nothing for sgd)."""
    if CLIP[name] > 0:
        torch.nn.utils.clip_grad_norm_(params, CLIP[name])


def muon(stage: nn.Module, muon_lr: float) -> Any:
    """What ``deepspeed.initialize`` builds for a stage from ``{"type": "Muon", "params": {muon_lr, **MUON}}``
    on the CPU (tests/toy.py's ``ds_optimizer``, with DeepSpeed's own name-and-shape tagging)."""
    from types import SimpleNamespace

    from deepspeed import set_optimizer_flags

    params = {"muon_lr": muon_lr, **MUON}
    set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params=params), stage)
    return muon_on_tagged(list(stage.parameters()), muon_lr)


def muon_on_tagged(params: list[nn.Parameter], muon_lr: float) -> Any:
    """:func:`muon` on parameters already tagged ``use_muon``."""
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from fdg_schedule.base import optim

    groups = DeepSpeedEngine._muon_param_groups(params, {"muon_lr": muon_lr, **MUON})
    opt = MuonWithAuxAdam(groups, adam_optimizer=FusedAdam, adam_optimizer_kwargs={"adam_w_mode": True},
                          adam_w_mode=True, fallback_to_inline=True)  # fmt: skip
    optim.pure_steps(opt)  # one process holds several of them: each steps on its own state (issue 41)
    return opt


class LayerMuon:
    """The layer profile's Muon: a factory of parameter lists (:data:`Factory`) that tags each layer's parameters
    as DeepSpeed tags them in the whole model (by name), though the profiler hands over copies without names.

    A layer's copy is recognised by its parameters' shapes; two layers with the same shapes but a different
    tagging are refused (nothing would say which the profiler timed)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        from types import SimpleNamespace

        from deepspeed import set_optimizer_flags
        from deepspeed.pipe import LayerSpec

        self.tags: dict[tuple[tuple[int, ...], ...], tuple[bool, ...]] = {}
        flags = SimpleNamespace(optimizer_name="muon", optimizer_params={"muon_lr": MUON_LR, **MUON})
        with torch.random.fork_rng():
            built = [layer.build() if isinstance(layer, LayerSpec) else layer for layer in layers]
        whole = nn.ModuleList([m for m in built if isinstance(m, nn.Module)])
        set_optimizer_flags(flags, whole)  # names as the model's: "embed" / "lm_head" go to Adam
        for module in whole:
            params = [p for p in module.parameters() if p.requires_grad]
            shapes = tuple(tuple(p.shape) for p in params)
            tags = tuple(bool(p.use_muon) for p in params)  # type: ignore[attr-defined]
            if self.tags.setdefault(shapes, tags) != tags:
                raise ValueError(f"two layers with parameters of shapes {shapes} are tagged differently for Muon: "
                                 "the profile cannot tell their copies apart")  # fmt: skip

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        tags = self.tags[tuple(tuple(p.shape) for p in params)]
        for p, tag in zip(params, tags):
            p.use_muon = tag  # type: ignore[attr-defined]
        return muon_on_tagged(params, MUON_LR)

    def __repr__(self) -> str:  # the profile's cache key describes its optimizer by this
        return f"DeepSpeed Muon(muon_lr={MUON_LR}, {sorted(MUON.items())}, tagged by name)"
