"""Per-layer costs of a pipeline model, measured on the device it trains on, and the file that keeps them.

:func:`profile_layers` times each layer of a DeepSpeed layer list (``LayerSpec``s, modules or plain
functions, as ``PipelineModule`` takes them) on a real micro-batch, one layer at a time, and measures
its sizes. The result, a :class:`ModelProfile`, is what :mod:`fdg_schedule.partitioning.partition` balances and
what ``PipelineModule(partition_method="balanced:<profile.json>")`` reads. :func:`cached_profile`
measures once per model, micro-batch, device, dtype and optimizer, on global rank 0, and hands every
rank (and every later run) the same file, so all stages agree on the split without re-profiling.

What one layer costs (medians over ``repeats`` rounds after ``warmup`` rounds that are not counted;
every round runs the four passes in this order on the same input, for every layer in turn, so a
slow moment of a shared machine falls on all layers alike):

    forward_s      forward with autograd recording (what "stored" activations and 1F1B run)
    backward_s     backward from the layer's outputs (from the loss, for the last layer when a
                   ``loss_fn`` is given) to its parameters and its floating inputs
    step_s         optimizer step on the layer's trainable parameters
    recompute_s    the extra forward of ``activations: "recomputed"``: the forward a recomputing
                   stage runs without autograd when the micro-batch arrives (the rerun with
                   autograd at backward time costs ``forward_s``)

and its sizes per micro-batch: ``param_bytes`` (all parameters), ``activation_bytes`` (the output
the next layer receives), ``saved_bytes`` (the tensors autograd saves for the backward, counted as
the engine's ``held_bytes()`` counts them: per save, parameters and buffers excluded) and
``optimizer_state_bytes`` (after one step). Layers are profiled on a deep copy (or a fresh build
of a ``LayerSpec``) under a forked RNG: the caller's weights and random stream are untouched.

The file (``ModelProfile.save`` / ``load``) is JSON in the one torch-free format the planner reads
too: :mod:`fdg_schedule.partitioning.profile_format` (this module re-exports its :class:`LayerCost` and
:class:`ModelProfile`).

Long because timing a layer is one procedure (forward, backward, optimizer step and memory, on one deep copy
under one forked RNG) for every kind of layer a pipeline holds.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fdg_schedule.base import host_memory
from fdg_schedule.base.tensors import cloned, detached, flat, leaves, map_tensors, nbytes
from fdg_schedule.partitioning.profile_format import FORMAT, LayerCost, ModelProfile

__all__ = ["FORMAT", "LayerCost", "ModelProfile", "cached_profile", "describe", "layer_name", "profile_layers"]
# How layers are timed; part of the cache key, so a profile cached by an older way of timing is measured
# again. 2: the input is copied before the clock starts (Note [the input is copied before the clock starts]).
TIMING = 2
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


# ---------------------------------------------------------------------------------------------------
# Measuring


def layer_name(layer: Any) -> str:
    """A layer's name as DeepSpeed prints it when it partitions: class for specs and modules, else ``__name__``."""
    from deepspeed.pipe import LayerSpec

    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return str(getattr(layer, "__name__", type(layer).__name__))


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum: the step every profile is timed with unless told otherwise."""
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def optimizer_from_ds_config(ds_config: dict[str, Any]) -> OptimizerFactory:
    """The torch optimizer closest to a DeepSpeed config's ``optimizer`` block, for timing its step.

    DeepSpeed builds ``SGD``, ``Adam`` and ``AdamW`` from the block (its fused or CPU Adam where
    available); the step cost of torch's implementation stands in for them. Other types (or no
    block: a client optimizer) time SGD with momentum.
    """
    block = ds_config.get("optimizer") or {}
    kind = str(block.get("type", "")).lower()
    params = dict(block.get("params", {}))
    if kind == "sgd":
        keep = {k: params[k] for k in ("lr", "momentum", "weight_decay", "nesterov") if k in params}
        return partial(torch.optim.SGD, **{"lr": 1e-3, **keep})
    if kind in ("adam", "adamw"):
        keep = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}
        return partial(torch.optim.AdamW if kind == "adamw" else torch.optim.Adam, **keep)
    return default_optimizer


def profile_layers(
    layers: Sequence[Any],
    inputs: Any,
    labels: Any = None,
    loss_fn: Callable[..., Tensor] | None = None,
    optimizer: OptimizerFactory = default_optimizer,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 7,
    warmup: int = 2,
    interleave: bool = True,
) -> ModelProfile:
    """Time and size every layer of ``layers`` on the micro-batch ``inputs`` (see the module docstring).

    Args:
        layers: what ``PipelineModule(layers=...)`` takes: ``LayerSpec``s, modules, functions.
        inputs: one micro-batch as the first stage receives it (a tensor or a tuple).
        labels, loss_fn: when both are given, the last layer's forward and backward include the loss.
        optimizer: builds the optimizer whose step is timed, from a layer's trainable parameters.
        device: where to run (default: DeepSpeed's accelerator's current device).
        dtype: floating dtype for weights and floating inputs (default: as they are).
        repeats: timed rounds per layer (medians are kept); warmup: rounds before them, not kept.
        interleave: every round times every layer in turn (a copy of every layer, its optimizer state
            and its input are alive at once); False times the layers one after another, one layer in
            memory at a time, for a model whose copy does not fit the device twice.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if not layers:
        raise ValueError("profile_layers needs at least one layer")
    device = torch.device(device) if device is not None else _default_device()
    x = _to(inputs, device, dtype)
    y = _to(labels, device, None)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        results, everyone = [], []
        for index, layer in enumerate(layers):
            last = index == len(layers) - 1
            loss = _loss_of(loss_fn, y) if (last and loss_fn is not None and y is not None) else None
            passes = _Passes(*_runnable(layer, device, dtype), x, index > 0, loss, optimizer, device)
            x = passes.output()
            if interleave:
                everyone.append(passes)
            else:
                (kept,) = _interleaved([passes], warmup, repeats)
                results.append(passes.cost(layer_name(layer), kept))
        if interleave:
            rounds = _interleaved(everyone, warmup, repeats)
            results = [passes.cost(layer_name(layer), kept) for passes, layer, kept in zip(everyone, layers, rounds)]
    return ModelProfile(
        layers=tuple(results),
        micro_batch=_leading_size(inputs),
        device=str(device),
        dtype=str(dtype or _floating_dtype(inputs) or torch.get_default_dtype()).replace("torch.", ""),
        input_bytes=_nbytes(inputs),
        key=profile_key(layers, inputs, device, dtype, optimizer),
        meta={
            "repeats": repeats,
            "warmup": warmup,
            "interleaved": interleave,
            "optimizer": _describe_optimizer(optimizer),
            "loss_in_last_layer": loss_fn is not None and labels is not None,
            "threads": torch.get_num_threads(),
            "timing": TIMING,
            "host_memory": host_memory.describe(),
            "device_name": _device_name(device),
            "torch": torch.__version__,
            "host": platform.node(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        },
    )


class _Passes:
    """A layer (or layers run back to back) set up for timing; :meth:`round` times its four passes once."""

    def __init__(
        self,
        run: Callable[[Any], Any],
        module: nn.Module | None,
        x: Any,
        input_needs_grad: bool,
        loss: Callable[[Any], Tensor] | None,
        optimizer: OptimizerFactory,
        device: torch.device,
    ) -> None:
        self.run, self.module, self.loss, self.device = run, module, loss, device
        self.params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
        self.opt = optimizer(self.params) if self.params else None
        # A stage's input needs a gradient unless it is the data (layer 0), as in DeepSpeed's pipeline.
        self.leaf = leaves(x, requires_grad=input_needs_grad)
        self.grads = _output_grads(run(cloned(self.leaf)))

    def round(self) -> tuple[float, float, float, float]:
        """Seconds of (forward with autograd, backward, optimizer step, forward without autograd).

        Note [the input is copied before the clock starts]: each pass gets a fresh copy of the input
        (a layer may write into it), made before its clock starts. Inside a stage a layer reads the
        previous layer's output as it is; a copy inside the timed window would add one read and one
        write of the input to every layer, most to the cheap layers on wide activations.
        """
        run, device = self.run, self.device
        x = _fresh(self.leaf)
        t0 = _now(device)
        out = run(x)
        target = self.loss(out) if self.loss is not None else None
        t1 = _now(device)
        _backward(out, target, self.grads)
        t2 = _now(device)
        if self.opt is not None:
            self.opt.step()
        t3 = _now(device)
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        del out, target, x
        x = _fresh(self.leaf)
        t4 = _now(device)
        with torch.no_grad():
            run(x)
        t5 = _now(device)
        return t1 - t0, t2 - t1, (t3 - t2 if self.opt is not None else 0.0), t5 - t4  # no parameters: no step

    def output(self) -> Any:
        """The output of a forward without autograd, detached: the next layer's input."""
        with torch.no_grad():
            return detached(self.run(cloned(self.leaf)))

    def cost(self, name: str, rounds: Sequence[tuple[float, float, float, float]]) -> LayerCost:
        """Medians of ``rounds`` (as :meth:`round` returns them) and the sizes, as a :class:`LayerCost`."""
        module, opt = self.module, self.opt
        state = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())} if module else set()
        saved = _saved_bytes(lambda: self.run(cloned(self.leaf)), state)
        states = opt.state.values() if opt else ()
        state_bytes = sum(_nbytes(v) for state_ in states for v in state_.values() if torch.is_tensor(v))
        out = self.output()
        forward, backward, step, recompute = (statistics.median(column) for column in zip(*rounds))
        return LayerCost(
            name=name,
            forward_s=forward,
            backward_s=backward,
            recompute_s=recompute,
            step_s=step,
            param_bytes=sum(p.numel() * p.element_size() for p in (module.parameters() if module else ())),
            activation_bytes=_nbytes(out),
            saved_bytes=saved,
            params=sum(p.numel() for p in self.params),  # trainable, as DeepSpeed's "parameters" method counts
            optimizer_state_bytes=state_bytes,
        )


Rounds = list[tuple[float, float, float, float]]


def _interleaved(everyone: Sequence[_Passes], warmup: int, repeats: int) -> list[Rounds]:
    """Per item, its ``repeats`` rounds after ``warmup``; round r times every item once, in an order rotated by r.

    A slow moment of a shared machine then falls on every item alike, not on one end of the model.
    """
    rounds: list[Rounds] = [[] for _ in everyone]
    for round_ in range(warmup + repeats):
        for j in range(len(everyone)):
            i = (round_ + j) % len(everyone)
            timed = everyone[i].round()
            if round_ >= warmup:
                rounds[i].append(timed)
    return rounds


def _loss_of(loss_fn: Callable[..., Tensor], labels: Any) -> Callable[[Any], Tensor]:
    return lambda outputs: loss_fn(outputs, labels)


def _backward(out: Any, loss: Tensor | None, grads: list[Tensor]) -> None:
    """Back-propagate from the loss, or from the floating outputs with fixed random gradients."""
    if loss is not None:
        if loss.requires_grad:
            loss.backward()
        return
    pairs = [(t, g) for t, g in zip(_floating(out), grads) if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _runnable(
    layer: Any, device: torch.device, dtype: torch.dtype | None
) -> tuple[Callable[[Any], Any], nn.Module | None]:
    """A callable for ``layer`` on a private copy (built specs, deep-copied modules), and its module."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if isinstance(layer, LayerSpec):
        module = layer.build()
    elif isinstance(layer, nn.Module):
        module = copy.deepcopy(layer)
    elif callable(layer):
        return layer, None
    else:
        raise TypeError(
            f"cannot profile layer of type {type(layer).__name__}: expected a LayerSpec, module or function"
        )
    module = module.to(device=device, dtype=dtype) if dtype is not None else module.to(device)
    module.train()
    if isinstance(layer, TiedLayerSpec) and layer.forward_fn is not None:
        return partial(layer.forward_fn, module), module
    return module, module


def _saved_bytes(run: Callable[[], Any], state_storages: set[int]) -> int:
    """Bytes autograd saves for one forward, as ``engine.held_bytes()`` counts them (per save, no weights)."""
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in state_storages:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def profile_key(
    layers: Sequence[Any],
    inputs: Any,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    optimizer: OptimizerFactory = default_optimizer,
) -> str:
    """A short hash of what a profile depends on: the layers, the micro-batch's shapes, device, dtype, optimizer.

    Layers are described without building them (``LayerSpec`` repr with its arguments, module repr
    and parameter shapes, function names); the device by its hardware name and thread count, and on
    a CPU whether freed memory is retained (:mod:`fdg_schedule.base.host_memory`: page faults change layer
    times by up to a third, so a profile taken under the other setting is measured again).
    """
    device = torch.device(device) if device is not None else _default_device()
    described = {
        "layers": [_describe_layer(layer) for layer in layers],
        "inputs": [(tuple(t.shape), str(t.dtype)) for t in flat(inputs)],
        "device": _device_name(device),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "optimizer": _describe_optimizer(optimizer),
        "torch": torch.__version__,
        "format": FORMAT,
        "timing": TIMING,
        "host_memory": host_memory.describe() if device.type == "cpu" else "",
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_profile(
    layers: Sequence[Any],
    inputs: Any,
    cache_dir: str | os.PathLike[str],
    labels: Any = None,
    loss_fn: Callable[..., Tensor] | None = None,
    optimizer: OptimizerFactory = default_optimizer,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 7,
    warmup: int = 2,
    interleave: bool = True,
) -> tuple[ModelProfile, Path]:
    """The profile of ``layers`` from ``cache_dir``, measured first if it is not there; every rank gets it.

    Global rank 0 reads the cached file or profiles (the other ranks wait, so rank 0 times on a
    quiet machine) and sends the profile to every rank, which writes it to its own ``cache_dir`` if
    missing (nodes need not share a file system). Call it on every rank, like a collective.
    Returns the profile and its path, ``<cache_dir>/profile-<key>.json``. ``interleave``: as for
    :func:`profile_layers` (False for a model whose copy does not fit the device twice).
    """
    import torch.distributed as dist

    key = profile_key(layers, inputs, device, dtype, optimizer)
    path = Path(cache_dir) / f"profile-{key}.json"
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    profile: ModelProfile | None = None
    if not distributed or dist.get_rank() == 0:
        profile = _read_cached(path, key)
        if profile is None:
            profile = profile_layers(
                layers, inputs, labels, loss_fn, optimizer, device, dtype, repeats, warmup, interleave
            )
            profile.save(path)
    if distributed:
        box: list[Any] = [profile.to_dict() if profile is not None else None]
        dist.broadcast_object_list(box, src=0)
        profile = ModelProfile.from_dict(box[0], source=f"profile broadcast from rank 0 ({path})")
        if dist.get_rank() != 0 and _read_cached(path, key) is None:
            profile.save(path)
    assert profile is not None
    return profile, path


def _read_cached(path: Path, key: str) -> ModelProfile | None:
    if not path.exists():
        return None
    try:
        profile = ModelProfile.load(path)
    except (ValueError, OSError):
        return None  # a damaged or older file is measured again
    return profile if profile.key == key else None


# ---------------------------------------------------------------------------------------------------
# Helpers


def _default_device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return f"{device.type}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def _now(device: torch.device) -> float:
    """Wall time after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()
    return time.perf_counter()


def _describe_layer(layer: Any) -> str:
    from deepspeed.pipe import LayerSpec

    if isinstance(layer, LayerSpec):
        return repr(layer)
    if isinstance(layer, nn.Module):
        shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in layer.named_parameters()]
        return f"{layer!r} {shapes}"
    return str(getattr(layer, "__qualname__", layer_name(layer)))


def _describe_optimizer(optimizer: OptimizerFactory) -> str:
    if isinstance(optimizer, partial):
        return f"{getattr(optimizer.func, '__name__', optimizer.func)}({sorted(optimizer.keywords.items())})"
    return str(getattr(optimizer, "__qualname__", optimizer))


def _floating(x: Any) -> list[Tensor]:
    return [t for t in flat(x) if t.is_floating_point()]


def _nbytes(x: Any) -> int:
    return nbytes(flat(x))


def _leading_size(x: Any) -> int:
    tensors = flat(x)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


def _floating_dtype(x: Any) -> torch.dtype | None:
    floating = _floating(x)
    return floating[0].dtype if floating else None


def _to(x: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    def move(t: Tensor) -> Tensor:
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        return t.to(device)

    return map_tensors(x, move)


def _fresh(x: Any) -> Any:
    """A copy of the leaf ``x`` that is a leaf itself (its gradient lands on the copy, as on a stage's input)."""
    return map_tensors(x, lambda t: t.detach().clone().requires_grad_(t.requires_grad))


def _output_grads(out: Any) -> list[Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(t.shape, generator=generator).to(t) for t in _floating(out)]


def describe(profile: ModelProfile, top: int | None = None) -> Iterable[str]:
    """Lines of a per-layer table in milliseconds and MB (``top``: only the most expensive layers)."""
    rows = list(enumerate(profile.layers))
    if top is not None:
        rows = sorted(rows, key=lambda r: -(r[1].forward_s + r[1].backward_s))[:top]
        rows.sort()
    header = ("fwd ms", "bwd ms", "recomp", "step ms", "saved MB", "out MB")
    yield f"{'#':>4} {'layer':<24} " + " ".join(f"{h:>8}" for h in header)
    for i, c in rows:
        yield (
            f"{i:>4} {c.name[:24]:<24} {c.forward_s * 1e3:>8.2f} {c.backward_s * 1e3:>8.2f} "
            f"{c.recompute_s * 1e3:>8.2f} {c.step_s * 1e3:>8.2f} {c.saved_bytes / 2**20:>8.2f} "
            f"{c.activation_bytes / 2**20:>8.2f}"
        )
