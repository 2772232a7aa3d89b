"""zoo.resnet: every model builds and cuts into K = 1..4 stages without losing a parameter; paper splits."""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torchvision
from deepspeed.runtime import utils as ds_utils
from torch import nn

from fdg_schedule.zoo import resnet
from tests.dist_harness import run_ranks

# Parameter counts for 10 classes and 3 input channels, as published (He et al.: 0.27M, 0.85M, 1.7M,
# 19.4M; Zagoruyko & Komodakis: WRN-28-10 36.5M), exact values from this implementation.
KNOWN_PARAMS = {
    "resnet20": 269_722,
    "resnet56": 853_018,
    "resnet110": 1_727_962,
    "resnet1202": 19_421_274,
    "wrn_28_10": 36_479_194,
}


@cache
def layer_params(name: str) -> tuple[int, ...]:
    """Trainable parameters of each layer of `name`, building one layer at a time."""
    torch.manual_seed(0)
    counts = []
    for layer in resnet.resnet_layers(name, num_classes=10, in_channels=3):
        module = layer.build() if isinstance(layer, resnet.LayerSpec) else layer
        counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad))
    return tuple(counts)


def deepspeed_parts(name: str, stages: int, method: str) -> list[int]:
    """The boundaries `PipelineModule._partition_layers` computes, without a process group."""
    counts = layer_params(name)
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(counts), num_parts=stages)
    if method == "parameters":
        return ds_utils.partition_balanced(weights=list(counts), num_parts=stages)
    assert method == "paper"
    return resnet.paper_split(name, stages)


@pytest.mark.parametrize("name", list(resnet.MODELS))
def test_layer_list_matches_model_size(name: str) -> None:
    counts = layer_params(name)
    assert len(counts) == resnet.num_layers(name)
    if name in KNOWN_PARAMS:
        assert sum(counts) == KNOWN_PARAMS[name]
    if name in resnet.TORCHVISION_BLOCKS:
        model = getattr(torchvision.models, name)(weights=None, num_classes=10)
        assert sum(counts) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(resnet.MODELS))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_every_partition_keeps_every_parameter(name: str, stages: int) -> None:
    counts = layer_params(name)
    methods = ["uniform", "parameters"]
    if stages == 1 or stages in resnet.PAPER_SPLITS.get(name, {}):
        methods.append("paper")
    for method in methods:
        parts = deepspeed_parts(name, stages, method)
        resnet.parse_parts(resnet.parts_method(parts), stages, len(counts))  # K+1 increasing bounds, 0..n
        per_stage = [sum(counts[a:b]) for a, b in zip(parts[:-1], parts[1:], strict=True)]
        assert sum(per_stage) == sum(counts), (name, stages, method, parts)


def test_paper_splits_are_valid_and_cut_resnet56_inside_layer2() -> None:
    for name, presets in resnet.PAPER_SPLITS.items():
        for stages, parts in presets.items():
            assert resnet.parse_parts(resnet.parts_method(parts), stages, resnet.num_layers(name)) == parts
    # ResNet-56: stem (layer 0), layer1 = 1..9, layer2 = 10..18, layer3 = 19..27.
    assert resnet.paper_split("resnet56", 2) == [0, 14, 30]
    assert 10 < resnet.paper_split("resnet56", 2)[1] < 19


def test_paper_split_without_preset_names_the_alternatives() -> None:
    with pytest.raises(ValueError, match="no paper split for resnet32 with 2 stages.*'parameters'"):
        resnet.paper_split("resnet32", 2)
    assert resnet.paper_split("resnet32", 1) == [0, 18]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("parts:0,5", "must list 3 boundaries from 0 to 12"),
        ("parts:0,5,11", "must list 3 boundaries from 0 to 12"),
        ("parts:0,5,5,12", "must list 3 boundaries"),
        ("parts:0,x,12", "comma-separated integers"),
    ],
)
def test_bad_explicit_parts_are_rejected(method: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resnet.parse_parts(method, 2, 12)
    with pytest.raises(ValueError, match="at least one layer"):
        resnet.parse_parts("parts:0,5,5,12", 3, 12)


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet9'; known models: resnet20"):
        resnet.resnet_layers("resnet9")


@pytest.mark.parametrize("name", ["resnet20", "wrn_16_4", "resnet18"])
@pytest.mark.parametrize("in_channels", [1, 3])
def test_grey_and_colour_inputs(name: str, in_channels: int) -> None:
    layers = [
        layer.build() if isinstance(layer, resnet.LayerSpec) else layer
        for layer in resnet.resnet_layers(name, 10, in_channels)
    ]
    out = nn.Sequential(*layers).eval()(torch.randn(2, in_channels, 28, 28))
    assert out.shape == (2, 10)


def test_torchvision_layers_compute_the_torchvision_model() -> None:
    torch.manual_seed(3)
    layers = nn.Sequential(*resnet.resnet_layers("resnet18", num_classes=7)).eval()
    torch.manual_seed(3)
    model = torchvision.models.resnet18(weights=None, num_classes=7).eval()
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(layers(x), model(x), rtol=0, atol=0)


def _two_stage_worker(rank: int, world_size: int, partition: str) -> tuple[list[int], int]:
    net = resnet.build_pipeline("resnet20", world_size, num_classes=10, in_channels=1, partition=partition)
    return list(net.parts), sum(p.numel() for p in net.parameters())


def _stage_state_worker(rank: int, world_size: int, partition: str) -> tuple[list[int], dict, bool]:
    net = resnet.build_pipeline("resnet20", world_size, num_classes=10, in_channels=1, partition=partition, base_seed=3)
    return list(net.parts), {k: v.clone() for k, v in net.state_dict().items()}, net.seed_layers


def _builds_worker(rank: int, world_size: int) -> dict:
    """Both workers' builds on one launch (the layers are seeded one by one: each build starts alike)."""
    parts = {partition: _two_stage_worker(rank, world_size, partition) for partition in ("paper", "parameters")}
    return {"parts": parts, "state": _stage_state_worker(rank, world_size, "paper")}


@pytest.fixture(scope="module")
def two_stage_builds(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """resnet20 built as a 2-stage PipelineModule three ways, in one launch; the results in rank order."""
    return run_ranks(_builds_worker, 2, tmp_path_factory.mktemp("builds"), deadline_s=200)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("partition", ["paper", "parameters"])
def test_pipeline_module_stages_hold_the_whole_model(two_stage_builds, partition: str) -> None:
    (parts0, params0), (parts1, params1) = (r["parts"][partition] for r in two_stage_builds)
    assert parts0 == parts1
    if partition == "paper":
        assert parts0 == [0, 5, 12]
    # One input channel instead of three: the stem conv has 2 x 16 x 3 x 3 fewer weights.
    assert params0 + params1 == KNOWN_PARAMS["resnet20"] - 2 * 16 * 9
    assert params0 > 0 and params1 > 0


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_build_stages_gives_each_stage_the_pipeline_modules_weights(two_stage_builds) -> None:
    """The one-process stages of benchmarks/convergence/resnet_reference.py start where the engine's do."""
    results = [r["state"] for r in two_stage_builds]
    parts = resnet.stage_parts("resnet20", 2, "paper")
    stages = resnet.build_stages("resnet20", parts, num_classes=10, in_channels=1, base_seed=3)
    for k, (engine_parts, state, reseeds) in enumerate(results):
        assert engine_parts == parts
        assert not reseeds  # Note [seeded layers reseed every forward]
        # PipelineModule names a layer by its global index; nn.Sequential by its index in the stage
        ours = {
            f"{int(key.split('.', 1)[0]) + parts[k]}.{key.split('.', 1)[1]}": v
            for key, v in stages[k].state_dict().items()
        }
        assert ours.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("partition", ["paper", "parameters", "uniform"])
def test_stage_parts_are_the_pipeline_modules_parts(partition: str, stages: int) -> None:
    want = deepspeed_parts("resnet56", stages, partition)
    assert resnet.stage_parts("resnet56", stages, partition) == [int(p) for p in want]
    # no preset (resnet20 at K=4): "paper" falls back to "parameters", as the recipe does
    assert resnet.stage_parts("resnet20", 4, "paper") == [int(p) for p in deepspeed_parts("resnet20", 4, "parameters")]


def test_paper_lr_decays_at_the_papers_epochs_and_warms_up_at_a_tenth() -> None:
    # 16 epochs: decay at round(0.5 * 16) = 8, 12 and round(0.9167 * 16) = 15
    lrs = [resnet.paper_lr(0.1, epoch, 16, warmup_epochs=2) for epoch in range(16)]
    assert lrs == pytest.approx([0.01] * 2 + [0.1] * 6 + [0.01] * 4 + [0.001] * 3 + [0.0001])
    assert resnet.paper_lr(0.1, 3, 16, decay_epochs=[2]) == pytest.approx(0.01)
