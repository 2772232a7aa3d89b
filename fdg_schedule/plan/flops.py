"""Layer costs estimated from FLOPs and bytes for a named GPU, when nothing has been measured on it.

Each layer's time is a sum over the operators it runs (a roofline per operator): matrix products and
convolutions take ``flops / (peak * efficiency)``; every other operator is memory-bound and takes
``bytes read and written / (memory bandwidth * memory_efficiency)``; the optimizer step moves
``step_bytes_per_param`` bytes per parameter. The assumptions are the :class:`GPU` figures below
(vendor data sheets, dense, no sparsity) and the efficiencies, which the caller states.

Two model families:

* any DeepSpeed layer list (:func:`estimate_layers`), e.g. the ResNets of :mod:`fdg_schedule.zoo.resnet`
  (CIFAR ResNets, WRNs, torchvision ResNets): built on the meta device and run once, layer by layer,
  under a dispatch mode that counts each operator's FLOPs (PyTorch's own ``flop_counter`` formulas)
  or bytes, and saved-tensor hooks that count what autograd keeps. Nothing is allocated.
* decoder transformers (GPT/LLaMA shapes), by the standard formulas: per layer forward FLOPs
  ``24 b s h^2 + 4 b s^2 h`` (Narayanan et al. 2021) for a 4h MLP, and saved activations per
  Korthikanti et al. 2022 ("Reducing Activation Recomputation") with flash attention (no ``s^2``
  terms): attention ``15 s b h`` and MLP ``3 s b h + 4 s b f`` bytes in 16-bit. Each layer is two
  pipeline layers (attention, MLP), plus the embedding and the head with the loss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from fdg_schedule.plan.costs import DTYPE_BYTES, LayerCost, ModelProfile


@dataclasses.dataclass(frozen=True)
class GPU:
    """Peak dense FLOP/s per dtype, memory bandwidth (bytes/s) and memory (bytes) of one device."""

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    memory: float

    def peak(self, dtype: str) -> float:
        key = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
        if key not in self.flops:
            raise ValueError(f"{self.name} has no {dtype} peak in the table (known: {sorted(self.flops)}); "
                             "pick --dtype from those")  # fmt: skip
        return self.flops[key]


T = 1e12
GPUS: dict[str, GPU] = {
    # NVIDIA data sheets, SXM parts, dense tensor-core figures.
    "V100": GPU("V100", {"fp16": 125 * T, "fp32": 15.7 * T}, 0.9e12, 32e9),
    "A100": GPU("A100", {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}, 2.039e12, 80e9),
    "H100": GPU("H100", {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T, "fp32": 67 * T}, 3.35e12, 80e9),
    "H200": GPU("H200", {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T, "fp32": 67 * T}, 4.8e12, 141e9),
    # The FDG paper's era of GPU (no tensor cores): fp32 only.
    "GTX1080Ti": GPU("GTX1080Ti", {"fp32": 11.3 * T}, 0.484e12, 11e9),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of peak an implementation reaches; the defaults are typical large-batch training figures."""

    compute: float = 0.5  # of peak FLOP/s, for matrix products and convolutions
    memory: float = 0.7  # of peak memory bandwidth, for everything else
    step_bytes_per_param: float = 32.0  # Adam, mixed precision: fp32 master, m, v read+written, grad read


def gpu_named(name: str) -> GPU:
    key = {k.lower(): k for k in GPUS}.get(name.lower())
    if key is None:
        raise ValueError(f"unknown GPU {name!r} in --gpu; known: {sorted(GPUS)}")
    return GPUS[key]


# ---------------------------------------------------------------------------------------------------
# Transformers: formulas


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer; ``ffn`` is the MLP width, ``gated`` a SwiGLU MLP (three matrices)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: int | None = None  # grouped-query attention; None = heads
    gated: bool = False

    @property
    def params_per_layer(self) -> float:
        h, kv = self.hidden, (self.kv_heads or self.heads) / self.heads
        attention = 2 * h * h + 2 * h * h * kv  # q and output, k and v
        mlp = (3 if self.gated else 2) * h * self.ffn
        return attention + mlp


TRANSFORMERS: dict[str, TransformerShape] = {
    # GPT-3 "XL" shape (Brown et al. 2020): 1.3B parameters.
    "gpt-1.3b": TransformerShape(layers=24, hidden=2048, heads=16, ffn=8192, vocab=50257, seq=2048),
    # LLaMA-3 8B shape: 32 layers, GQA with 8 KV heads, SwiGLU MLP of 14336.
    "llama-8b": TransformerShape(32, 4096, 32, 14336, 128256, 8192, kv_heads=8, gated=True),
}


def estimate_transformer(
    shape: TransformerShape, micro_batch: int, gpu: GPU, dtype: str = "bfloat16", eff: Efficiency | None = None
) -> ModelProfile:
    """Per-layer costs of ``shape``: embedding, (attention, MLP) x layers, head with the loss."""
    eff = eff or Efficiency()
    e = DTYPE_BYTES[dtype]
    b, s, h, f, v = micro_batch, shape.seq, shape.hidden, shape.ffn, shape.vocab
    kv = (shape.kv_heads or shape.heads) / shape.heads
    flop_s = gpu.peak(dtype) * eff.compute
    byte_s = gpu.memory_bandwidth * eff.memory
    act = b * s * h * e  # one hidden-state tensor

    def layer(name: str, fwd_flops: float, params: float, saved: float, elementwise_bytes: float,
              out_bytes: float) -> LayerCost:  # fmt: skip
        # backward: twice the matrix FLOPs; the elementwise work is read again and its gradient written
        return LayerCost(
            name=name,
            forward_s=fwd_flops / flop_s + elementwise_bytes / byte_s,
            backward_s=2 * fwd_flops / flop_s + 2 * elementwise_bytes / byte_s,
            recompute_s=fwd_flops / flop_s + elementwise_bytes / byte_s,
            step_s=params * eff.step_bytes_per_param / gpu.memory_bandwidth,
            param_bytes=params * e,
            activation_bytes=out_bytes,
            saved_bytes=saved,
        )

    attention_flops = 2 * b * s * h * h * (2 + 2 * kv) + 4 * b * s * s * h  # projections + scores and values
    attention_params = 2 * h * h + 2 * h * h * kv
    mlp_flops = (6 if shape.gated else 4) * b * s * h * f
    mlp_params = (3 if shape.gated else 2) * h * f
    layers = [layer("Embedding", 0.0, v * h, 0.0, 2 * act, act)]
    for i in range(shape.layers):
        # attention: layer norm, QKV, flash attention (reads QKV, writes O), output, residual add
        layers.append(layer(f"Attention{i}", attention_flops, attention_params, 15 * s * b * h * (e / 2),
                            8 * act, act))  # fmt: skip
        # MLP: layer norm, up (and gate), activation, down, residual add
        mlp_saved = (3 * s * b * h + 4 * s * b * f) * (e / 2) + (2 * s * b * f * (e / 2) if shape.gated else 0)
        layers.append(layer(f"MLP{i}", mlp_flops, mlp_params, mlp_saved, 4 * act + 2 * b * s * f * e, act))
    logits = b * s * v * 4  # fp32 logits for the loss
    head = layer("Head", 2 * b * s * h * v, h * v, act + logits, 3 * logits, 4.0 * b)
    layers.append(head)
    return ModelProfile(
        layers=tuple(layers),
        micro_batch=micro_batch,
        device=gpu.name,
        dtype=dtype,
        input_bytes=b * s * 8,  # token ids (int64)
        meta={
            "source": "flops",
            "shape": dataclasses.asdict(shape),
            "gpu": dataclasses.asdict(gpu),
            "efficiency": dataclasses.asdict(eff),
        },  # fmt: skip
    )


# ---------------------------------------------------------------------------------------------------
# ResNets: counted on the meta device


def estimate_layers(
    layers: Sequence[Any],
    input_shape: Sequence[int],
    gpu: GPU,
    dtype: str = "bfloat16",
    eff: Efficiency | None = None,
    meta: dict[str, Any] | None = None,
) -> ModelProfile:
    """Per-layer costs of a DeepSpeed layer list (``LayerSpec``s or modules), counted operator by operator.

    The layers are built and run on the meta device: nothing is allocated. ``input_shape`` is one
    micro-batch's input (its first entry is the micro-batch size).
    """
    import torch
    from deepspeed.pipe import LayerSpec

    eff = eff or Efficiency()
    torch_dtype = getattr(torch, dtype)
    flop_s = gpu.peak(dtype) * eff.compute
    byte_s = gpu.memory_bandwidth * eff.memory
    x = torch.empty(*input_shape, device="meta", dtype=torch_dtype)
    out = []
    for i, layer in enumerate(layers):
        with torch.device("meta"):
            module = layer.build() if isinstance(layer, LayerSpec) else layer
        module = module.to(device="meta", dtype=torch_dtype)
        params = sum(p.numel() for p in module.parameters())
        counts = _count(module, x.detach().requires_grad_(i > 0))
        y = counts.pop("output")
        out.append(
            LayerCost(
                name=f"{type(module).__name__}{i}",
                forward_s=counts["fwd_flops"] / flop_s + counts["fwd_bytes"] / byte_s,
                backward_s=counts["bwd_flops"] / flop_s + counts["bwd_bytes"] / byte_s,
                recompute_s=counts["fwd_flops"] / flop_s + counts["fwd_bytes"] / byte_s,
                step_s=params * eff.step_bytes_per_param / gpu.memory_bandwidth,
                param_bytes=params * x.element_size(),
                activation_bytes=y.numel() * y.element_size(),
                saved_bytes=counts["saved"],
            )
        )
        x = y.detach()
    return ModelProfile(
        layers=tuple(out),
        micro_batch=int(input_shape[0]),
        device=gpu.name,
        dtype=dtype,
        input_bytes=math.prod(input_shape) * DTYPE_BYTES[dtype],
        meta={"source": "flops", **(meta or {}), "gpu": dataclasses.asdict(gpu), "efficiency": dataclasses.asdict(eff)},
    )


def estimate_resnet(
    name: str,
    micro_batch: int,
    gpu: GPU,
    dtype: str = "bfloat16",
    image: int | None = None,
    eff: Efficiency | None = None,
) -> ModelProfile:
    """A ResNet of :mod:`fdg_schedule.zoo.resnet` (CIFAR ResNets, WRNs, torchvision ResNets) as layers.

    CIFAR models default to 32-pixel images and 10 classes, torchvision ones to 224 pixels and 1000.
    """
    from fdg_schedule.zoo import resnet

    if name not in resnet.MODELS:
        raise ValueError(f"unknown ResNet {name!r}; known: {sorted(resnet.MODELS)}")
    imagenet = name in resnet.TORCHVISION_BLOCKS
    side = image or (224 if imagenet else 32)
    layers = resnet.resnet_layers(name, 1000 if imagenet else 10, 3)
    return estimate_layers(layers, (micro_batch, 3, side, side), gpu, dtype, eff, {"model": name, "image": side})


def _count(module: Any, x: Any) -> dict[str, Any]:
    """FLOPs and bytes of ``module``'s forward and backward on meta tensor ``x``; bytes autograd saves."""
    import torch

    params = {id(p) for p in module.parameters()}
    saved = [0.0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    forward, backward = _op_counter()(), _op_counter()()
    with forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    with backward:
        y.backward(torch.empty_like(y))
    return {"fwd_flops": forward.flops, "fwd_bytes": forward.bytes, "bwd_flops": backward.flops,
            "bwd_bytes": backward.bytes, "saved": saved[0], "output": y}  # fmt: skip


@functools.cache
def _op_counter() -> type:
    """The operator counter, defined on first use: the planner imports no torch until it counts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OpCounter(TorchDispatchMode):
        """Counts FLOPs of the operators PyTorch's flop counter knows, and bytes moved by all others."""

        def __init__(self) -> None:
            super().__init__()
            self.flops = 0.0
            self.bytes = 0.0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            import torch
            from torch.utils._pytree import tree_leaves
            from torch.utils.flop_counter import flop_registry

            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func._overloadpacket
            if packet in flop_registry:
                self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
            elif not func.is_view:
                tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            return out

    return _OpCounter
