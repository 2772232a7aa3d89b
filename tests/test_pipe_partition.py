"""``partition_method="balanced:..."`` and ``"parts:..."`` in real PipelineModules; stock methods unchanged.

Pure tests read the method strings and check the profile against the layers. The distributed test
builds real 2- and 3-stage pipelines: DeepSpeed's own methods give the same boundaries and the same
printout with and without fdg_schedule's hook, a balanced split lands where the partitioner says,
and the FDG engine then holds exactly the bytes the partitioner predicted for each stage.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import toy
from dist_harness import run_ranks

from fdg_schedule.partitioning import pipe_partition
from fdg_schedule.partitioning.partition import Objective, balanced_partition
from fdg_schedule.partitioning.profile import ModelProfile, profile_layers


@pytest.fixture(scope="module")
def toy_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    x, y = toy.micro_batches(1, 4)[0]
    profile = profile_layers(toy.layers(), x, y, toy.loss_fn, repeats=3, warmup=1)
    return profile.save(tmp_path_factory.mktemp("profile") / "toy.json")


def test_method_strings_round_trip(toy_profile: Path) -> None:
    assert pipe_partition.parse_balanced(f"balanced:{toy_profile}") == (toy_profile, Objective())
    fdg = {"train_micro_batch_size_per_gpu": 4, "pipeline": {"schedule": "fdg", "fdg": {"activations": "recomputed"}}}
    method = pipe_partition.balanced_method(toy_profile, fdg, memory_limit_mib=64)
    assert method == f"balanced:{toy_profile}?activations=recomputed&memory_mib=64"
    assert pipe_partition.parse_balanced(method)[1] == Objective(activations="recomputed", memory_limit=64 * 2**20)
    stock = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    method = pipe_partition.balanced_method(toy_profile, stock)
    assert pipe_partition.parse_balanced(method)[1] == Objective(schedule="1f1b", micro_batches=8)
    weighted = pipe_partition.parse_balanced(f"balanced:{toy_profile}?weights=stashed&delay_weight=0.5")[1]
    assert weighted == Objective(weights="stashed", delay_weight=0.5)  # Note [the delay-weighted split]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("balanced", "needs a layer profile: 'balanced:<profile.json>'"),
        ("balanced:p.json?beta=2", r"unknown key 'beta'; known keys: \['schedule'"),
        ("balanced:p.json?accumulate=two", "accumulate must be a number, got 'two'"),
        ("balanced:p.json?schedule=gpipe", r"schedule must be one of \['fdg', '1f1b'\], got 'gpipe'"),
        ("balanced:p.json?delay_weight=-1", r"balanced:p.json\?delay_weight=-1'\: delay_weight must be a number >= 0"),
        ("balanced:p.json?delay_weight=half", "delay_weight must be a number, got 'half'"),
    ],
)
def test_bad_balanced_methods_name_the_fix(method: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipe_partition.parse_balanced(method)


def test_profile_must_describe_the_layers_and_the_micro_batch(toy_profile: Path, tmp_path: Path) -> None:
    layers = toy.layers()
    pipe_partition.check_layers(ModelProfile.load(toy_profile), layers, "toy")
    with pytest.raises(ValueError, match="it has 9 layers, the PipelineModule 8; profile this PipelineModule"):
        pipe_partition.check_layers(ModelProfile.load(toy_profile), layers[:-1], "toy")
    swapped = [layers[1], layers[0], *layers[2:]]
    with pytest.raises(ValueError, match="layer 0 is 'SeededLinear' there and 'tanh' here"):
        pipe_partition.check_layers(ModelProfile.load(toy_profile), swapped, "toy")
    with pytest.raises(ValueError, match="micro-batches of 4 samples but train_micro_batch_size_per_gpu is 8"):
        pipe_partition.balanced_method(toy_profile, {"train_micro_batch_size_per_gpu": 8})
    with pytest.raises(FileNotFoundError, match="no layer profile at .*cached_profile"):
        pipe_partition.plan_for(f"balanced:{tmp_path / 'missing.json'}", layers, 2)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**json.loads(toy_profile.read_text()), "layers": [{"name": "x"}]}))
    with pytest.raises(ValueError, match=r"layer 0 lacks \['forward_s'"):
        pipe_partition.plan_for(f"balanced:{broken}", layers, 2)


def test_stock_methods_are_not_ours() -> None:
    for method in ("parameters", "uniform", "type:Linear", "Parameters", "profile"):
        assert not pipe_partition.is_ours(method)
    for method in ("balanced", "balanced:x.json", "Balanced:x.json", "parts:0,1,2"):
        assert pipe_partition.is_ours(method)


def _partition_worker(rank: int, world: int, profile: str) -> dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import fdg_schedule  # noqa: F401  (installs the hook)
    from fdg_schedule.partitioning import profile as profiling

    out: dict[str, Any] = {"stock": {}}
    # cached_profile: rank 0 measures, every rank gets the same profile and file; then it is cached.
    x, y = toy.micro_batches(1, 4)[0]
    cache = Path(profile).parent / "cache"
    shared, path = profiling.cached_profile(toy.layers(), x, cache, y, toy.loss_fn, repeats=1, warmup=0)
    out["shared"] = (shared.to_dict(), ModelProfile.load(path).to_dict())
    for method in ("parameters", "uniform", "type:SeededLinear", "TYPE:pair"):
        seen = {}
        for hooked in (False, True):
            (pipe_partition.install if hooked else pipe_partition.uninstall)()
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                module = PipelineModule(
                    layers=toy.layers(), num_stages=world, loss_fn=toy.loss_fn, partition_method=method
                )
            seen[hooked] = ([int(p) for p in module.parts], printed.getvalue(), type(module.parts).__name__)
        out["stock"][method] = seen
    pipe_partition.install()
    out["parts_method"] = (
        PipelineModule(layers=toy.layers(), num_stages=world, loss_fn=toy.loss_fn, partition_method="parts:0,4,9").parts
        if world == 2
        else None
    )
    out["held"] = {}
    for activations in ("stored", "recomputed"):
        for weights in ("current", "stashed"):
            method = f"balanced:{profile}?activations={activations}&weights={weights}"
            out["held"][(weights, activations)] = _held_in_steady_state(method, world, weights, activations)
    out["reports"] = {
        schedule: _report_after_training(f"balanced:{profile}", world, schedule) for schedule in SCHEDULES
    }
    del deepspeed
    return out


SCHEDULES = ("fdg", "1f1b")


def _report_after_training(method: str, stages: int, schedule: str) -> tuple[str | None, dict[str, float]]:
    """Train 4 calls of GAS 3 with a StageClock (warm-up: the first 6 micro-batches); the report and counts."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from fdg_schedule.tools.stage_times import StageClock, stage_report

    torch.manual_seed(0)
    module = PipelineModule(layers=toy.layers(), num_stages=stages, loss_fn=toy.loss_fn, partition_method=method)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}
    config["steps_per_print"] = 10**9
    if schedule == "fdg":
        config["pipeline"] = {"schedule": "fdg"}
    engine, *_ = deepspeed.initialize(
        model=module,
        config=config,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        model_parameters=module.parameters(),
    )
    clock = StageClock(engine, warmup=6)
    data = iter(toy.micro_batches(12, 4))
    for call in range(4):
        engine.train_batch(data)
        if call == 1:  # evaluation between calls is not counted
            engine.eval_batch(iter(toy.micro_batches(3, 4, seed=5)))
    return stage_report(engine, clock), clock.since_start()


def _held_in_steady_state(method: str, stages: int, weights: str, activations: str) -> tuple[list[int], int]:
    """Train FDG on a ``method`` split until the pipeline is full; this stage's parts and held bytes."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    module = PipelineModule(layers=toy.layers(), num_stages=stages, loss_fn=toy.loss_fn, partition_method=method)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2 * stages,
        "steps_per_print": 10**9,
        "pipeline": {"schedule": "fdg", "fdg": {"weights": weights, "activations": activations}},
    }
    engine, *_ = deepspeed.initialize(
        model=module,
        config=config,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        model_parameters=module.parameters(),
    )
    engine.train_batch(iter(toy.micro_batches(2 * stages, 4)))  # 2K ticks: past the 2(K-1)-tick fill
    return [int(p) for p in module.parts], engine.held_bytes()


@pytest.mark.distributed
@pytest.mark.parametrize("stages", [2, 3])
def test_in_real_pipelines(tmp_path: Path, toy_profile: Path, stages: int) -> None:
    results = run_ranks(_partition_worker, stages, tmp_path, str(toy_profile), deadline_s=240)
    assert all(r["shared"][0] == results[0]["shared"][0] == r["shared"][1] for r in results)
    for method, seen in results[0]["stock"].items():
        assert seen[False] == seen[True], method  # same boundaries, same printout, same type
    if stages == 2:
        assert results[0]["parts_method"] == [0, 4, 9]
    profile = ModelProfile.load(toy_profile)
    for (weights, activations), _ in results[0]["held"].items():
        plan = balanced_partition(profile, stages, Objective(weights=weights, activations=activations))
        for rank, result in enumerate(results):
            parts, held = result["held"][(weights, activations)]
            assert parts == plan.parts
            assert held == plan.stages[rank].held_bytes, (weights, activations, rank)
        assert results[0]["held"][(weights, activations)][1] > 0  # stage 0 holds micro-batches in flight
    plan = balanced_partition(profile, stages)
    for schedule in SCHEDULES:
        report, _ = results[0]["reports"][schedule]
        *table, advice = report.splitlines()[2:]
        rows = [line.split(" | ") for line in table]
        assert [int(row[0]) for row in rows] == list(range(stages)), report
        # The split balanced on the profile rescaled to these measurements: a valid split of the 9 layers.
        assert advice.startswith("rebalanced on these measurements: "), report
        parts = json.loads(advice[advice.index("[") : advice.index("]") + 1])
        assert len(parts) == stages + 1 and parts[0] == 0 and parts[-1] == 9 and parts == sorted(set(parts))
        assert [row[1] for row in rows] == [f"{a}-{b - 1}" for a, b in zip(plan.parts, plan.parts[1:])]
        assert [float(row[2]) for row in rows] == [round(s.time_s * 1e3, 2) for s in plan.stages]
        assert all(float(row[3]) > 0 for row in rows) and "warm-up included" not in report
        for result in results:
            assert result["reports"][schedule][1]["micro_batches"] == 6  # calls 3 and 4: 2 x GAS 3, after warm-up
            assert result["reports"][schedule][1]["forward_s"] > 0


def test_fdg_splits_of_tied_models_keep_a_layer_of_its_own_on_every_stage() -> None:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    own_parameters = pipe_partition.own_parameters
    layers = [
        TiedLayerSpec("embed", torch.nn.Linear, 2, 2),
        torch.nn.Linear(2, 2),
        lambda x: x,  # no parameters
        torch.nn.ReLU(),  # a module without parameters
        LayerSpec(torch.nn.Linear, 2, 2),
        TiedLayerSpec("embed", torch.nn.Linear, 2, 2),
    ]
    assert own_parameters(layers, Objective()) == [False, True, False, False, True, False]
    assert own_parameters(layers, Objective(schedule="1f1b")) is None  # 1F1B steps tied layers with the stage's
    assert own_parameters(layers[1:5], Objective()) is None  # no tied layers: no constraint
