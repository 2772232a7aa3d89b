"""ResNets (He et al.), wide ResNets and torchvision ResNets as DeepSpeed layer lists, with FDG paper splits.

Every model is a flat list of layers that `PipelineModule` can cut anywhere:

    layer 0            stem (conv [+ BN + ReLU [+ max-pool]])
    layers 1 .. B      one residual block each, in order
    layer B+1          global average pooling + flatten (WRN: BN + ReLU first, it is pre-activation)
    layer B+2          linear classifier

so any number of stages K <= B + 3 works, with DeepSpeed's own ``partition_method``s ("parameters",
"uniform", "type:BasicBlock") or with explicit boundaries (``"parts:0,5,12"``, see `SplitPipelineModule`).

Models (``MODELS``); parameter counts for 10 classes and 3 input channels:

    resnet20/32/44/56/110/1202   CIFAR ResNets, 3 groups of n BasicBlocks (16/32/64 channels),
                                  parameter-free "option A" shortcuts: 0.27M/0.46M/0.66M/0.85M/1.7M/19.4M
    wrn_16_4, wrn_28_10          wide ResNets (Zagoruyko & Komodakis), pre-activation blocks: 2.7M, 36.5M
    resnet18/50/101              torchvision's ImageNet ResNets (built by torchvision, split into children)

The input channel count is an argument of the stem (``in_channels=1`` for MNIST / Fashion-MNIST); no
model is special-cased for a data set.

Paper splits (`paper_split`): the stage boundaries of the FDG paper's code (github.com/ZHUANGHP/FDG,
``DG_models.py``), translated to indices into the layer list above. They balance compute rather than
parameters: ResNet-56 at K=2 cuts inside the second group, after its fourth block. ``|`` marks a cut:

    resnet20    K=2  stem layer1 layer2[:1] | layer2[1:] layer3 head                 [0, 5, 12]
                K=3  stem layer1 | layer2 | layer3 head                                [0, 4, 7, 12]
    resnet56    K=2  ... layer2[:4] | layer2[4:] ...                                   [0, 14, 30]
                K=3  stem layer1 | layer2 | layer3 head                                [0, 10, 19, 30]
                K=4  layer1[:6] | layer1[6:] layer2[:4] | layer2[4:] layer3[:2] | ...  [0, 7, 14, 21, 30]
    resnet110   K=2..5                                                                 see PAPER_SPLITS
    resnet1202  K=2..5                                                                 see PAPER_SPLITS
    wrn_28_10   K=2  stem layer1 layer2[:2] | ...                                      [0, 7, 15]
    resnet18    K=2..3, resnet50 K=2..4, resnet101 K=2..5                              see PAPER_SPLITS

Models or stage counts without a preset (resnet32, resnet44, wrn_16_4, K above the table) have none:
use a DeepSpeed ``partition_method`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
import torchvision
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime import utils as ds_utils
from torch import nn

from fdg_schedule.partitioning.pipe_partition import parse_parts
from fdg_schedule.zoo.resnet_shapes import CIFAR_DEPTHS, TORCHVISION_BLOCKS, WRN_SHAPES

Layer: TypeAlias = LayerSpec | nn.Module

PAPER_SPLITS: dict[str, dict[int, list[int]]] = {
    "resnet20": {2: [0, 5, 12], 3: [0, 4, 7, 12]},
    "resnet56": {2: [0, 14, 30], 3: [0, 10, 19, 30], 4: [0, 7, 14, 21, 30]},
    "resnet110": {
        2: [0, 28, 57],
        3: [0, 19, 37, 57],
        4: [0, 14, 28, 42, 57],
        5: [0, 11, 22, 33, 44, 57],
    },
    "resnet1202": {
        2: [0, 251, 603],
        3: [0, 201, 401, 603],
        4: [0, 76, 251, 426, 603],
        5: [0, 61, 221, 281, 441, 603],
    },
    "wrn_28_10": {2: [0, 7, 15], 3: [0, 5, 9, 15], 4: [0, 4, 7, 10, 15]},
    "resnet18": {2: [0, 5, 11], 3: [0, 3, 6, 11]},
    "resnet50": {2: [0, 8, 19], 3: [0, 6, 11, 19], 4: [0, 5, 9, 13, 19]},
    "resnet101": {
        2: [0, 17, 36],
        3: [0, 12, 23, 36],
        4: [0, 9, 17, 25, 36],
        5: [0, 7, 14, 21, 28, 36],
    },
}


def _kaiming(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


class CifarStem(nn.Module):
    """3x3 convolution, batch norm, ReLU: the first layer of the CIFAR ResNets."""

    def __init__(self, in_channels: int, width: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        _kaiming(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity shortcut (He et al., CIFAR variant).

    When the block halves the resolution and doubles the channels, the shortcut subsamples and
    zero-pads the channels ("option A" of the paper): it has no parameters, which is what makes
    ResNet-20 0.27M parameters.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.pad = planes - in_planes
        _kaiming(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.pad:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + shortcut)


class WideBlock(nn.Module):
    """Pre-activation wide block (BN-ReLU-conv-BN-ReLU-dropout-conv), 1x1 conv shortcut on shape change."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)
        _kaiming(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(x))
        # With a projection shortcut the projection sees the pre-activated input (as in the WRN code).
        shortcut = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(self.dropout(F.relu(self.bn2(out))))
        return out + shortcut


class PoolFlatten(nn.Module):
    """Global average pooling to 1x1, then flatten to (batch, channels)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


class PreActPoolFlatten(nn.Module):
    """The last BN + ReLU of a pre-activation network, then global average pooling and flatten."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1), 1)


def cifar_resnet_layers(depth: int, num_classes: int = 10, in_channels: int = 3) -> list[Layer]:
    """ResNet-`depth` for 32x32 (or 28x28) images: depth = 6n + 2, three groups of n blocks."""
    if (depth - 2) % 6:
        raise ValueError(f"CIFAR ResNet depth must be 6n + 2 (20, 32, 44, 56, 110, 1202), got {depth}")
    n = (depth - 2) // 6
    layers: list[Layer] = [LayerSpec(CifarStem, in_channels, 16)]
    in_planes = 16
    for group, planes in enumerate((16, 32, 64)):
        for block in range(n):
            stride = 2 if group > 0 and block == 0 else 1
            layers.append(LayerSpec(BasicBlock, in_planes, planes, stride))
            in_planes = planes
    layers += [LayerSpec(PoolFlatten), LayerSpec(nn.Linear, 64, num_classes)]
    return layers


def wide_resnet_layers(
    depth: int, widen: int, num_classes: int = 10, in_channels: int = 3, dropout: float = 0.0
) -> list[Layer]:
    """WRN-`depth`-`widen`: depth = 6n + 4, three groups of n pre-activation blocks."""
    if (depth - 4) % 6:
        raise ValueError(f"wide ResNet depth must be 6n + 4 (16, 22, 28, 40), got {depth}")
    n = (depth - 4) // 6
    layers: list[Layer] = [LayerSpec(nn.Conv2d, in_channels, 16, 3, padding=1, bias=False)]
    in_planes = 16
    for group, planes in enumerate((16 * widen, 32 * widen, 64 * widen)):
        for block in range(n):
            stride = 2 if group > 0 and block == 0 else 1
            layers.append(LayerSpec(WideBlock, in_planes, planes, stride, dropout))
            in_planes = planes
    layers += [LayerSpec(PreActPoolFlatten, in_planes), LayerSpec(nn.Linear, in_planes, num_classes)]
    return layers


def torchvision_resnet_layers(arch: str, num_classes: int = 1000, in_channels: int = 3) -> list[Layer]:
    """Torchvision's `arch` (random init, no download), split into stem, blocks, pool + flatten, fc.

    The layers are the torchvision model's own modules, so the list computes exactly what the
    torchvision model computes. Every rank builds the whole model (same seed, same weights) and
    `PipelineModule` keeps the modules of its own stage.
    """
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        _kaiming(model.conv1)
    layers: list[Layer] = [nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)]
    for group in (model.layer1, model.layer2, model.layer3, model.layer4):
        layers.extend(group.children())
    layers += [nn.Sequential(model.avgpool, nn.Flatten(1)), model.fc]
    return layers


def _builders() -> dict[str, Callable[[int, int], list[Layer]]]:
    """Model name -> builder(num_classes, in_channels)."""
    builders: dict[str, Callable[[int, int], list[Layer]]] = {}
    for name, depth in CIFAR_DEPTHS.items():
        builders[name] = partial(cifar_resnet_layers, depth)
    for name, (depth, widen) in WRN_SHAPES.items():
        builders[name] = partial(wide_resnet_layers, depth, widen)
    for name in TORCHVISION_BLOCKS:
        builders[name] = partial(torchvision_resnet_layers, name)
    return builders


MODELS: dict[str, Callable[[int, int], list[Layer]]] = _builders()


def resnet_layers(name: str, num_classes: int = 10, in_channels: int = 3) -> list[Layer]:
    """The layer list of model `name` (one of ``MODELS``)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name](num_classes, in_channels)


def num_layers(name: str) -> int:
    """Length of `resnet_layers(name)`, without building anything."""
    if name in CIFAR_DEPTHS:
        blocks = 3 * ((CIFAR_DEPTHS[name] - 2) // 6)
    elif name in WRN_SHAPES:
        blocks = 3 * ((WRN_SHAPES[name][0] - 4) // 6)
    elif name in TORCHVISION_BLOCKS:
        blocks = sum(TORCHVISION_BLOCKS[name])
    else:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return 1 + blocks + 2


def paper_split(name: str, stages: int) -> list[int]:
    """Stage boundaries [0, b1, ..., num_layers] of the FDG paper for `name` cut into `stages` stages."""
    if stages == 1:
        return [0, num_layers(name)]
    presets = PAPER_SPLITS.get(name, {})
    if stages not in presets:
        known = ", ".join(f"{model} K={sorted(ks)}" for model, ks in PAPER_SPLITS.items())
        raise ValueError(
            f"no paper split for {name} with {stages} stages (presets: {known}); "
            f"use partition_method 'parameters' or 'uniform' instead"
        )
    return list(presets[stages])


def stage_parts(name: str, stages: int, partition: str = "paper") -> list[int]:
    """The stage boundaries `build_pipeline` uses, without a process group.

    "paper" falls back to DeepSpeed's "parameters" (as the recipe does) where there is no preset;
    "parameters" and "uniform" are computed with DeepSpeed's own functions.
    """
    if partition == "paper":
        partition = "paper" if stages == 1 or stages in PAPER_SPLITS.get(name, {}) else "parameters"
    if partition == "paper":
        return paper_split(name, stages)
    if partition.startswith("parts:"):
        return parse_parts(partition, stages, num_layers(name))
    layers = resnet_layers(name)
    if partition == "uniform":
        return [int(p) for p in ds_utils.partition_uniform(num_items=len(layers), num_parts=stages)]
    if partition == "parameters":  # PipelineModule._count_layer_params: trainable parameters per layer
        built = [layer.build() if isinstance(layer, LayerSpec) else layer for layer in layers]
        counts = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in built]
        return [int(p) for p in ds_utils.partition_balanced(weights=counts, num_parts=stages)]
    raise ValueError(f"partition {partition!r}: use 'paper', 'parameters', 'uniform' or 'parts:...'")


def build_stages(
    name: str, parts: Sequence[int], num_classes: int = 10, in_channels: int = 3, base_seed: int = 0
) -> list[nn.Sequential]:
    """Model `name` cut at `parts` into one module per stage, in one process, with the initial weights
    `build_pipeline` gives (every layer built after seeding with ``base_seed + layer index``, as
    ``PipelineModule(seed_layers=True)`` does)."""
    built: list[nn.Module] = []
    for index, layer in enumerate(resnet_layers(name, num_classes, in_channels)):
        ds_utils.set_random_seed(base_seed + index)
        built.append(layer.build() if isinstance(layer, LayerSpec) else layer)
    return [nn.Sequential(*built[start:stop]) for start, stop in zip(parts, parts[1:], strict=False)]


def paper_lr(
    base_lr: float,
    epoch: int,
    epochs: int,
    decay_epochs: Sequence[int] | None = None,
    warmup_epochs: int = 0,
    decay: float = 0.1,
) -> float:
    """The FDG paper's learning rate for `epoch` (from 0): ``base_lr`` divided by 10 at each decay
    epoch reached (default: 150, 225 and 275 of 300, scaled to `epochs`), and 0.1 x that during the
    first `warmup_epochs` epochs (the paper's code warms up for 3 epochs at a constant 0.1 x lr)."""
    if decay_epochs is None:
        decay_epochs = sorted({round(f * epochs) for f in (0.5, 0.75, 0.9167)} - {0})
    lr = base_lr * decay ** sum(epoch >= e for e in decay_epochs)
    return lr * 0.1 if epoch < warmup_epochs else lr


def parts_method(parts: Sequence[int]) -> str:
    """The ``partition_method`` string that makes `SplitPipelineModule` use these exact boundaries."""
    return "parts:" + ",".join(str(p) for p in parts)


class SplitPipelineModule(PipelineModule):
    """`PipelineModule` that also accepts explicit boundaries, ``partition_method="parts:0,5,12"``.

    DeepSpeed's methods ("parameters", "uniform", "type:regex") balance a weight per layer and cannot
    reproduce a given split; this subclass sets ``self.parts`` directly and defers every other method
    to DeepSpeed.
    """

    def _partition_layers(self, method: str = "uniform") -> None:
        if method.lower().startswith("parts:"):
            self.parts = parse_parts(method, self.num_stages, len(self._layer_specs))
        else:
            super()._partition_layers(method=method)
            # "parameters" yields numpy integers, which `seed_layers` (random.seed) rejects.
            self.parts = [int(p) for p in self.parts]
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def build_pipeline(
    name: str,
    stages: int,
    num_classes: int = 10,
    in_channels: int = 3,
    partition: str = "paper",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    **kwargs: Any,
) -> SplitPipelineModule:
    """Model `name` as a `PipelineModule` of `stages` stages (needs an initialised process group).

    `partition` is "paper" (the FDG paper's split, `paper_split`), "parts:..." or any DeepSpeed
    ``partition_method``. Layers are seeded one by one (``seed_layers=True``) so the initial weights
    do not depend on the number of stages or the partition.

    Note [seeded layers reseed every forward]
        With ``seed_layers=True`` DeepSpeed's ``PipelineModule.forward`` also calls
        ``set_random_seed(base_seed * (forwards + 1) + layer)`` before every layer, which resets the
        global RNG that data augmentation draws from: the crops and flips then depend on the stage
        split, and with base seed 0 every micro-batch gets the same ones. Unless the caller asks for
        ``seed_layers`` itself, it is turned off once the layers are built (the weights are seeded
        already), so augmentation draws one RNG stream whatever K is.
    """
    layers = resnet_layers(name, num_classes, in_channels)
    if stages > len(layers):
        raise ValueError(f"{name} has {len(layers)} layers and cannot be cut into {stages} stages")
    method = parts_method(paper_split(name, stages)) if partition == "paper" else partition
    asked = "seed_layers" in kwargs
    kwargs.setdefault("seed_layers", True)
    module = SplitPipelineModule(
        layers=layers,
        num_stages=stages,
        loss_fn=loss_fn or nn.CrossEntropyLoss(),
        partition_method=method,
        **kwargs,
    )
    if not asked:
        module.seed_layers = False  # Note [seeded layers reseed every forward]
    return module
