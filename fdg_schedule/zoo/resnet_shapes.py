"""The ResNets' names and shapes, torch-free: what the planner needs to list and count them.

:mod:`fdg_schedule.zoo.resnet` builds them (with torch); ``python -m fdg_schedule.plan --help`` lists
:data:`NAMES` without importing torch.
"""

# Blocks per group of the torchvision ResNets (the torchvision constructors know them too, but
# counting layers should not need to build a 44M-parameter model).
TORCHVISION_BLOCKS: dict[str, tuple[int, ...]] = {
    "resnet18": (2, 2, 2, 2),
    "resnet50": (3, 4, 6, 3),
    "resnet101": (3, 4, 23, 3),
}
CIFAR_DEPTHS = {
    "resnet20": 20,
    "resnet32": 32,
    "resnet44": 44,
    "resnet56": 56,
    "resnet110": 110,
    "resnet1202": 1202,
}
WRN_SHAPES = {"wrn_16_4": (16, 4), "wrn_28_10": (28, 10)}  # (depth, widen factor)

NAMES: tuple[str, ...] = (*CIFAR_DEPTHS, *WRN_SHAPES, *TORCHVISION_BLOCKS)  # the order of resnet.MODELS
