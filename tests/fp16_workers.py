"""Rank-side code of tests/test_fp16.py: fp16 engines on the CPU, overflows injected at chosen backward passes.

Note [fp16 on this CPU]: DeepSpeed's CPU accelerator says it supports fp16 only where oneDNN has fp16 kernels
(AVX512-FP16 or AMX-FP16); elsewhere ``deepspeed.initialize`` refuses ``"fp16": {"enabled": true}`` with
``ValueError: Type fp16 is not supported on your device.``, although torch computes fp16 on any CPU with its
own kernels. :func:`allow_fp16_on_cpu` lets the tests (and benchmarks/fp16_evidence.py) run there: DeepSpeed's
fp16 optimizers, loss scaling and checkpoints are the same code on every device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import deepspeed
import torch
import toy
from deepspeed.pipe import PipelineModule
from torch import nn

# the pipeline.fdg keys a case may set
FDG_KEYS = ("grad_shrink", "weights", "activations", "accumulate", "nonfinite", "timeout", "transport",
            "delay_lr_ticks", "predict_decay", "delay_momentum")  # fmt: skip
FP16_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
             "min_loss_scale")  # fmt: skip


def allow_fp16_on_cpu() -> None:
    """Note [fp16 on this CPU]."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


class _Scaled(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by the injector's factor of that backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, injector: Injector) -> torch.Tensor:  # type: ignore[override]
        ctx.injector = injector
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.injector.factor(), None


class Injector(nn.Module):
    """An identity layer whose backward passes number ``at`` (0-based, one per micro-batch on its stage) multiply the
    gradient by inf: an fp16 overflow in the gradients of the stage's layers before it, and of its input. Only on the
    global ``ranks`` when given (one data-parallel replica). ``forward_at``: forwards whose output is NaN instead."""

    def __init__(
        self, at: Iterable[int] = (), ranks: Iterable[int] | None = None, forward_at: Iterable[int] = ()
    ) -> None:
        super().__init__()
        self.at, self.forward_at, self.backwards, self.forwards = set(at), set(forward_at), 0, 0
        self.ranks = None if ranks is None else set(ranks)

    def _here(self) -> bool:
        import torch.distributed as dist

        return self.ranks is None or not dist.is_initialized() or dist.get_rank() in self.ranks

    def factor(self) -> float:
        self.backwards += 1
        return float("inf") if self.backwards - 1 in self.at and self._here() else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.forwards - 1 in self.forward_at:
            x = x * float("nan")
        return _Scaled.apply(x, self)


def layers(inject: dict[str, dict[str, Any]] | None = None, spec: bool = True) -> list[Any]:
    """Nine layers: K = 3 (uniform) puts injector "a" on stage 0 and "b" on stage 1, K = 2 both on stage 0.
    ``inject``: each injector's keyword arguments (``{"a": {"at": [4]}}``)."""
    inject = inject or {}

    def make(cls: Any, *args: Any) -> Any:
        return deepspeed.pipe.LayerSpec(cls, *args) if spec else cls(*args)

    return [
        make(toy.SeededLinear, toy.IN, toy.HIDDEN, 1),
        Injector(**inject.get("a", {})),
        torch.tanh,
        make(toy.SeededLinear, toy.HIDDEN, toy.HIDDEN, 2),
        Injector(**inject.get("b", {})),
        torch.tanh,
        make(toy.SeededLinear, toy.HIDDEN, toy.HIDDEN, 3),
        torch.tanh,
        make(toy.SeededLinear, toy.HIDDEN, toy.CLASSES, 4),
    ]


def tied_layers(inject: dict[str, dict[str, Any]] | None = None, spec: bool = True) -> list[Any]:
    """Ten layers, an embedding tied to the head (toy.tied_layers' tie): uniform K = 2 splits them [0, 5, 10], K = 3
    [0, 4, 7, 10]. Injector "a" sits right after the embedding on stage 0: its overflow reaches the embedding's
    gradient alone (the tied copy), not the stage's own Linear; "b" ends stage 0 at K = 2 and starts stage 1 at
    K = 3 (an overflow of stage 0's whole gradient, through its input gradient at K = 3)."""
    inject = inject or {}

    def make(cls: Any, *args: Any) -> Any:
        return deepspeed.pipe.LayerSpec(cls, *args) if spec else cls(*args)

    def tied(forward_fn: Any = None) -> Any:
        if spec:
            return deepspeed.pipe.TiedLayerSpec("emb", toy.TiedWeight, toy.IN, toy.HIDDEN, 11, forward_fn=forward_fn)
        return toy.Tied("emb", lambda: toy.TiedWeight(toy.IN, toy.HIDDEN, 11), forward_fn)

    return [
        tied(), Injector(**inject.get("a", {})), torch.tanh, make(toy.SeededLinear, toy.HIDDEN, toy.HIDDEN, 2),
        Injector(**inject.get("b", {})), torch.tanh, make(toy.SeededLinear, toy.HIDDEN, toy.HIDDEN, 3), torch.tanh,
        make(toy.SeededLinear, toy.HIDDEN, toy.HIDDEN, 4), tied(toy.head),
    ]  # fmt: skip


def micro_batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """toy's micro-batches with fp16 inputs (DeepSpeed's fp16 expects first-stage inputs in fp16)."""
    return [(x.half(), y) for x, y in toy.micro_batches(n, size)]


def ds_config(case: dict[str, Any]) -> dict[str, Any]:
    fdg = {k: case[k] for k in FDG_KEYS if k in case}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case.get("gas", 1),
        "gradient_clipping": case.get("clip", 0.0),
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": True, **{k: case[k] for k in FP16_KEYS if k in case}},
        "pipeline": {"schedule": case.get("schedule", "fdg"), "fdg": fdg},
    }
    if case.get("schedule") == "1f1b":
        del cfg["pipeline"]["fdg"]
    if case.get("zero"):
        cfg["zero_optimization"] = {"stage": case["zero"]}
    if case.get("ds_optimizer"):  # DeepSpeed builds FusedAdam: its FP16_Optimizer (flat fp32 masters)
        cfg["optimizer"] = {"type": case["ds_optimizer"], "params": {"lr": 0.01}}
    if case.get("wandb"):
        cfg["wandb"] = {"enabled": True, "project": "fdg-fp16"}
    return cfg


def make_optimizer(case: dict[str, Any]) -> Any:
    if case.get("optimizer") == "adam":
        return lambda params: torch.optim.Adam(params, lr=0.01)
    return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)


def build(case: dict[str, Any], world: int, inject: bool = True) -> tuple[Any, PipelineModule, list[Any]]:
    import fdg_schedule  # noqa: F401  (selects the engine from the config)

    allow_fp16_on_cpu()
    torch.manual_seed(1234)
    build_layers = tied_layers if case.get("tied") else layers
    model = PipelineModule(layers=build_layers(case.get("inject") if inject else None), num_stages=case["stages"],
                           loss_fn=toy.loss_fn, partition_method="uniform")  # fmt: skip
    kwargs = {} if case.get("ds_optimizer") else {"optimizer": make_optimizer(case)}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(case), model_parameters=model.parameters(),
                                      **kwargs)  # fmt: skip
    dp = world // case["stages"]
    n = model._grid.data_parallel_id
    data = [(x[n * 4 : (n + 1) * 4], y[n * 4 : (n + 1) * 4]) for x, y in micro_batches(case["n"], 4 * dp)]
    return engine, model, data


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's fp16 weights, as fp32 in host memory."""
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def masters(engine: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 master of each of the stage's parameters, by name, from DeepSpeed's fp16 optimizer."""
    from torch._utils import _unflatten_dense_tensors

    names = {id(p): name for name, p in model.named_parameters()}
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer: one master per parameter
        pairs = [(p, m) for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups) for p, m in zip(g16, g32)]
    elif hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer: one flat master per group
        pairs = [(p, m) for g16, flat in zip(opt.fp16_groups, opt.fp32_groups_flat)
                 for p, m in zip(g16, _unflatten_dense_tensors(flat, g16))]  # fmt: skip
    else:  # ZeRO-1
        from deepspeed.utils import safe_get_full_fp32_param

        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
        tied_sync = getattr(engine, "_tied", None)  # FDG's: the tied copies are not ZeRO's
        own = model.parameters() if tied_sync is None else tied_sync.without(model.parameters())
        pairs = [(p, safe_get_full_fp32_param(p)) for p in own]
    # FDG's tied copies: the masters their tied optimizer steps
    pairs += [(c.tie.param, c.master) for c in getattr(getattr(engine, "_tied", None), "copies", [])]
    return {names[id(p)]: m.detach().float().cpu().clone() for p, m in pairs}


def scale_of(engine: Any) -> dict[str, Any]:
    """The stage's loss-scale view: the scale of its last step, its own scale and counters, steps skipped."""
    scaling = engine.fdg_state.scaling
    return {"step_scale": engine.fdg_stats["loss_scale"], "skipped": engine.fdg_stats["skipped"],
            "skipped_steps": engine.skipped_steps, "grad_norm": float(engine.get_global_grad_norm() or math.nan),
            **scaling.state.capture()}  # fmt: skip


def train(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train each case, one call per ``gas`` ticks; record weights, masters, loss and scale after every call."""
    import fdg_schedule

    out = []
    for case in cases:
        if case.get("wandb"):
            _offline_wandb(case["wandb"])
        engine, model, data = build(case, world)
        it = iter(data)
        record: dict[str, Any] = {"states": [], "masters": [], "losses": [], "scales": [], "error": None}
        try:
            for _ in range(case["calls"]):
                record["losses"].append(engine.train_batch(it).item())
                record["states"].append(state(model))
                record["masters"].append(masters(engine, model))
                record["scales"].append(scale_of(engine))
            if case.get("drain"):
                record["losses"].append(engine.drain().item())
                record["states"].append(state(model))
                record["masters"].append(masters(engine, model))
                record["scales"].append(scale_of(engine))
        except fdg_schedule.FDGRuntimeError as err:
            record["error"] = str(err)
        if case.get("wandb"):
            _close_wandb(engine)
        out.append({**record, "stage_id": engine.stage_id, "parts": model.parts, "dp_id": model._grid.data_parallel_id,
                    "optimizer": type(engine.optimizer).__name__, "global_steps": engine.global_steps})  # fmt: skip
    return out


def _offline_wandb(directory: str) -> None:
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_RUN_GROUP"):
        os.environ.pop(key, None)
    here = lambda name: os.path.join(directory, name)  # noqa: E731
    os.environ.update(NETRC=here("no-netrc"), WANDB_DIR=directory, WANDB_SILENT="true", WANDB_MODE="offline")
    os.environ.update(WANDB_CONFIG_DIR=here("config"), WANDB_CACHE_DIR=here("cache"), WANDB_DATA_DIR=here("data"))


def _close_wandb(engine: Any) -> None:
    import wandb

    from fdg_schedule.observability import observe

    observe.close_observers(engine)
    if wandb.run is not None:  # DeepSpeed's own run on rank 0
        wandb.run.finish()


def resume(rank: int, world: int, cases: list[dict[str, Any]], root: str, phase: str) -> list[dict[str, Any]]:
    """phase "straight": train ``calls_before`` calls, save undrained, train ``calls_after``; phase "resumed": a new
    process loads the save, its injectors counting on from the backward passes made before it, and trains
    ``calls_after``."""
    out = []
    for i, case in enumerate(cases):
        engine, model, data = build(case, world)
        save_dir = f"{root}/case{i}"
        if phase == "straight":
            it = iter(data)
            for _ in range(case["calls_before"]):
                engine.train_batch(it)
            engine.save_checkpoint(save_dir)
        else:
            torch.manual_seed(999)  # the resumed run must not depend on the process's own RNG
            engine.load_checkpoint(save_dir)
            it = iter(data[engine.micro_batches_read :])
            # stage k back-propagates micro-batch b at tick b + 2(K-1) - k: the passes made in the saved ticks
            made = max(0, engine.global_steps - 2 * (engine.num_stages - 1) + engine.stage_id)
            for injector in (m for m in model.modules() if isinstance(m, Injector)):
                injector.backwards = made
        at_save = scale_of(engine)
        losses, scales = [], []
        for _ in range(case["calls_after"]):
            losses.append(engine.train_batch(it).item())
            scales.append(scale_of(engine))
        losses.append(engine.drain().item())
        scales.append(scale_of(engine))
        out.append({"state": state(model), "masters": masters(engine, model), "losses": losses, "scales": scales,
                    "at_save": at_save, "stage_id": engine.stage_id})  # fmt: skip
    return out


def swap(rank: int, world: int, case: dict[str, Any], save_dir: str, phase: str) -> dict[str, Any]:
    """Save with one schedule (FDG drained), load with the other: weights, masters, optimizer state, the scale."""
    engine, model, data = build(case, world)
    it = iter(data)
    if phase == "save":
        for _ in range(case["calls"]):
            engine.train_batch(it)
        if case.get("schedule", "fdg") == "fdg":
            engine.save_checkpoint(save_dir, drain=True)
        else:
            engine.save_checkpoint(save_dir)
    else:
        engine.load_checkpoint(save_dir)
    fdg = getattr(engine, "fdg_state", None)
    return {"state": state(model), "masters": masters(engine, model), "optim": _basic_state(engine),
            "engine": type(engine).__name__, "stage_id": engine.stage_id,
            "deepspeed_scale": _deepspeed_scale(engine.optimizer),
            "fdg_scale": None if fdg is None else scale_of(engine)}  # fmt: skip


def load_refused(rank: int, world: int, case: dict[str, Any], save_dir: str) -> str | None:
    """Load a checkpoint FDG must refuse; the error (None: loaded)."""
    import fdg_schedule

    engine, _, _ = build(case, world)
    try:
        engine.load_checkpoint(save_dir)
    except fdg_schedule.FDGConfigError as err:
        return str(err)
    return None


def _basic_state(engine: Any) -> list[dict[str, Any]]:
    """The wrapped optimizer's per-tensor state (momentum buffers, Adam moments), in order."""
    inner = engine.optimizer.optimizer
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state.get(p, {})
            out.append({k: v.detach().float().cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()})
    return out


def _deepspeed_scale(optimizer: Any) -> dict[str, Any]:
    """What DeepSpeed's own fp16 scaler of the wrapper holds (under 1F1B: the scale it trains with)."""
    from fdg_schedule.precision import fp16_optimizer

    return fp16_optimizer.loaded_state(optimizer)


def refused(rank: int, world: int, case: dict[str, Any], tied_layers: bool) -> dict[str, Any]:
    """engine_workers.bad_config with fp16 allowed on this CPU (Note [fp16 on this CPU])."""
    import engine_workers

    allow_fp16_on_cpu()
    return engine_workers.bad_config(rank, world, case, tied_layers=tied_layers)


def errors(rank: int, world: int, cases: list[dict[str, Any]]) -> list[str | None]:
    """One stage (no neighbour to leave waiting): each case trains ``calls`` calls; the error it stopped with.
    ``fp32_inputs``: toy's fp32 micro-batches into the fp16 job."""
    import fdg_schedule

    out = []
    for case in cases:
        engine, _, data = build({"stages": 1, "n": 16, **case}, world)
        if case.get("fp32_inputs"):
            data = toy.micro_batches(16, 4)
        it, error = iter(data), None
        try:
            for _ in range(case.get("calls", 4)):
                engine.train_batch(it)
        except fdg_schedule.FDGRuntimeError as err:
            error = str(err)
        out.append(error)
    return out
