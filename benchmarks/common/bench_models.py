"""The models the balance and throughput benchmarks split: flat layer lists and fixed synthetic micro-batches.

    resnet32, resnet56    CIFAR ResNets from the zoo (stem, 15 / 27 blocks, pool, linear), 32x32 RGB
    transformer           4 pre-norm encoder blocks (width 256, 4 heads), mean pool, linear; 64-token
                          sequences of synthetic embeddings
    gpt2                  the zoo's HF GPT-2 "small" preset (embedding, 6 blocks of width 384, head with
                          a vocabulary of 8192), as DeepSpeed layers; 128-token sequences
    convstack             a plain stack of 3x3 conv + batch norm + ReLU layers whose width doubles as the
                          resolution halves: equal time per layer group, parameters growing 4x per group
                          (DeepSpeed's "parameters" split puts most of the time on stage 0)
    plainconv             issue 48's plain conv net: Conv2d(3, 32) + ReLU, 8 x (Conv2d(32, 32), BatchNorm2d, ReLU),
                          pool, flatten, Linear(32, 10); 32x32 RGB, micro-batch 32 (4 MiB boundaries)
    widemlp               a wide MLP with a large boundary: 8 x (Linear(2048, 2048), ReLU), Linear(2048, 10);
                          micro-batch 256 of 2048 features (2 MiB boundaries, little compute per byte)
    smalltransformer      a transformer with a small boundary: 6 pre-norm encoder blocks of width 128, 4
                          heads, 32-token sequences, micro-batch 8 (128 KiB boundaries)
    plainconv_w16_d16, plainconv_w64_d6, mlp_1024, blockstack
                          issue 62's nets nobody tuned for, fixed in c20f673 before they were first measured
                          and not changed after: plainconv at 16 channels x 16 blocks
                          (2 MiB boundaries) and 64 channels x 6 blocks (8 MiB); 12 x (Linear(1024, 1024), ReLU),
                          micro-batch 128 (512 KiB); 8 pre-norm encoder blocks of width 192, 6 heads, 64-token
                          sequences, micro-batch 8 (384 KiB)
    ttl_lm, ttl_resnet    the time-to-loss test's LLaMA-style LM and MNIST ResNet-20 (:mod:`.ttl_models`)
    *_tiny                small versions for smoke tests

Every layer list is built the same way on every call (``LayerSpec``s, or modules built under a fixed
seed), so each rank of a pipeline and the profiler see the same model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks.common import ttl_models

CLASSES = 10

MODELS: dict[str, dict[str, Any]] = {
    "resnet32": dict(kind="resnet", depth=32, micro=32, image=32),
    "resnet56": dict(kind="resnet", depth=56, micro=32, image=32),
    "transformer": dict(kind="transformer", blocks=4, width=256, heads=4, seq=64, micro=16),
    "gpt2": dict(kind="gpt2", size="small", vocab=8192, seq=128, micro=8),
    "convstack": dict(kind="conv", widths=(32, 64, 128), per_group=6, micro=32, image=32),
    "plainconv": dict(kind="plainconv", width=32, blocks=8, micro=32, image=32),
    "widemlp": dict(kind="mlp", width=2048, layers=8, micro=256),
    "smalltransformer": dict(kind="transformer", blocks=6, width=128, heads=4, seq=32, micro=8),
    "plainconv_w16_d16": dict(kind="plainconv", width=16, blocks=16, micro=32, image=32),
    "plainconv_w64_d6": dict(kind="plainconv", width=64, blocks=6, micro=32, image=32),
    "mlp_1024": dict(kind="mlp", width=1024, layers=12, micro=128),
    "blockstack": dict(kind="transformer", blocks=8, width=192, heads=6, seq=64, micro=8),
    "plainconv_tiny": dict(kind="plainconv", width=8, blocks=2, micro=8, image=16),
    "widemlp_tiny": dict(kind="mlp", width=64, layers=3, micro=16),
    "resnet8_tiny": dict(kind="resnet", depth=8, micro=8, image=16),
    "transformer_tiny": dict(kind="transformer", blocks=2, width=64, heads=4, seq=16, micro=8),
    "gpt2_tiny": dict(kind="gpt2", size="tiny", vocab=256, seq=16, micro=4),
    "convstack_tiny": dict(kind="conv", widths=(8, 16), per_group=2, micro=8, image=16),
    # the time-to-loss runs' models (ttl_models, trained by benchmarks/convergence/time_to_loss.py): their K = 2
    # throughput ratio
    "ttl_lm": dict(
        kind="llama", vocab=ttl_models.LLAMA["vocab_size"], seq=ttl_models.LM_BLOCK, micro=ttl_models.LM_MICRO
    ),
    "ttl_resnet": dict(
        kind="resnet",
        depth=ttl_models.RESNET_DEPTH,
        micro=ttl_models.RESNET_MICRO,
        image=ttl_models.RESNET_IMAGE,
        channels=ttl_models.RESNET_CHANNELS,
    ),
}


class ConvBlock(nn.Sequential):
    """3x3 convolution (stride 1 or 2), batch norm, ReLU."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__(
            nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(channels_out),
            nn.ReLU(),
        )


class PoolLinear(nn.Module):
    """Global average pooling and a linear classifier."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class MeanPoolHead(nn.Module):
    """LayerNorm, mean over the sequence, linear classifier: (batch, seq, width) -> (batch, classes)."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


def model_layers(model: str) -> list[Any]:
    """The layer list of ``model`` (the same list on every call)."""
    from deepspeed.pipe import LayerSpec

    cfg = MODELS[model]
    if cfg["kind"] == "resnet":
        from fdg_schedule.zoo.resnet import cifar_resnet_layers

        return cifar_resnet_layers(cfg["depth"], CLASSES, cfg.get("channels", 3))
    if cfg["kind"] == "conv":
        layers: list[Any] = []
        channels = 3
        for group, width in enumerate(cfg["widths"]):
            for block in range(cfg["per_group"]):
                layers.append(LayerSpec(ConvBlock, channels, width, 2 if group > 0 and block == 0 else 1))
                channels = width
        return [*layers, LayerSpec(PoolLinear, channels, CLASSES)]
    if cfg["kind"] == "plainconv":  # as issue 48 states it, every layer its own LayerSpec
        width = cfg["width"]
        body = [
            spec
            for _ in range(cfg["blocks"])
            for spec in (
                LayerSpec(nn.Conv2d, width, width, 3, padding=1),
                LayerSpec(nn.BatchNorm2d, width),
                LayerSpec(nn.ReLU),
            )
        ]
        head = [LayerSpec(nn.AdaptiveAvgPool2d, 1), LayerSpec(nn.Flatten), LayerSpec(nn.Linear, width, CLASSES)]
        return [LayerSpec(nn.Conv2d, 3, width, 3, padding=1), LayerSpec(nn.ReLU), *body, *head]
    if cfg["kind"] == "mlp":
        width = cfg["width"]
        body = [spec for _ in range(cfg["layers"]) for spec in (LayerSpec(nn.Linear, width, width), LayerSpec(nn.ReLU))]
        return [*body, LayerSpec(nn.Linear, width, CLASSES)]
    if cfg["kind"] == "transformer":
        width = cfg["width"]
        blocks = [
            LayerSpec(
                nn.TransformerEncoderLayer, width, cfg["heads"], 4 * width, 0.0, batch_first=True, norm_first=True
            )
            for _ in range(cfg["blocks"])
        ]
        return [*blocks, LayerSpec(MeanPoolHead, width, CLASSES)]
    from fdg_schedule.zoo import hf_lm

    if cfg["kind"] == "llama":  # the time-to-loss LM, the only one
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return ttl_models.lm_layers()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = hf_lm.build_config("gpt2", cfg["size"], cfg["vocab"], cfg["seq"], tie_word_embeddings=False)
        return list(hf_lm.pipeline_layers(hf_lm.build_model(config)))


def build_layers(model: str) -> list[nn.Module]:
    """The layers of ``model`` as modules (``LayerSpec``s built), for a plain ``nn.Sequential``."""
    from deepspeed.pipe import LayerSpec

    return [layer.build() if isinstance(layer, LayerSpec) else layer for layer in model_layers(model)]


def loss_fn(model: str) -> Any:
    """The loss the last stage computes."""
    if MODELS[model]["kind"] in ("gpt2", "llama"):
        from fdg_schedule.zoo import hf_lm

        return hf_lm.lm_loss
    return nn.functional.cross_entropy


def fixed_data(model: str, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed synthetic micro-batches (inputs, labels), cycled through: no data loading is timed."""
    cfg = MODELS[model]
    g = torch.Generator().manual_seed(0)
    if cfg["kind"] in ("gpt2", "llama"):
        ids = [torch.randint(0, cfg["vocab"], (cfg["micro"], cfg["seq"]), generator=g) for _ in range(count)]
        return [(x, x) for x in ids]
    if cfg["kind"] == "transformer":
        shape: tuple[int, ...] = (cfg["micro"], cfg["seq"], cfg["width"])
    elif cfg["kind"] == "mlp":
        shape = (cfg["micro"], cfg["width"])
    else:
        shape = (cfg["micro"], cfg.get("channels", 3), cfg["image"], cfg["image"])
    return [
        (torch.randn(shape, generator=g), torch.randint(0, CLASSES, (cfg["micro"],), generator=g)) for _ in range(count)
    ]
