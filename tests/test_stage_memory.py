"""The one memory model of a stage: the partitioner's and the planner's numbers are both its numbers."""

from __future__ import annotations

import random

import pytest

from fdg_schedule.partitioning import stage_memory
from fdg_schedule.partitioning.partition import Objective, evaluate_partition
from fdg_schedule.partitioning.profile_format import LayerCost, ModelProfile
from fdg_schedule.plan import Cluster, CostModel, Variant, predict
from fdg_schedule.plan.predict import stage_memory as planner_stage_memory

MODES = [("current", "stored"), ("current", "recomputed"), ("stashed", "stored"), ("stashed", "recomputed")]


def random_profile(rng: random.Random, layers: int) -> ModelProfile:
    costs = [
        LayerCost(f"L{i}", 1e-3, 2e-3, 1e-3, 1e-4, param_bytes=rng.choice([0, 4096, 65536]),
                  activation_bytes=rng.choice([1024, 8192]), saved_bytes=rng.choice([0, 2048, 131072]),
                  optimizer_state_bytes=rng.choice([0, 4096]))
        for i in range(layers)
    ]  # fmt: skip
    return ModelProfile(layers=tuple(costs), micro_batch=8, device="cpu", dtype="float32", input_bytes=4096)


def sizes(profile: ModelProfile, start: int, stop: int) -> tuple[float, float, float]:
    layers = profile.layers[start:stop]
    saved, weights = sum(c.saved_bytes for c in layers), sum(c.param_bytes for c in layers)
    return saved, profile.input_bytes_of(start), weights


def test_footprints_of_the_table() -> None:
    F = stage_memory.Footprint
    assert stage_memory.stage_footprint("fdg", 3, 0) == (F(4, 4, 0), F(4, 4, 0))
    assert stage_memory.stage_footprint("fdg", 3, 1, "recomputed", "stashed") == (F(1, 2, 2), F(0, 2, 2))
    assert stage_memory.stage_footprint("fdg", 3, 2, "recomputed", "stashed") == (F(1, 1, 0), F())
    assert stage_memory.stage_footprint("1f1b", 4, 1, micro_batches=2) == (F(2, 2, 0), F(2, 2, 0))
    assert stage_memory.stage_footprint("gpipe", 4, 1, micro_batches=5) == (F(5, 5, 0), F(5, 5, 0))
    with pytest.raises(ValueError, match="unknown schedule 'zbh2'"):
        stage_memory.in_flight("zbh2", 2, 0)


@pytest.mark.parametrize("seed", range(5))
def test_the_partitioner_gives_the_models_numbers(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_profile(rng, 6)
    parts = [0, 1, 3, 4, 6]
    objectives = [Objective(weights=w, activations=a) for w, a in MODES]
    objectives += [Objective(schedule="1f1b", micro_batches=m) for m in (1, 3, 8)]
    for objective in objectives:
        for stage in evaluate_partition(profile, parts, objective).stages:
            k, (start, stop) = stage.stage_id, (stage.start, stage.stop)
            peak, held = stage_memory.stage_footprint(
                objective.schedule, 4, k, objective.activations, objective.weights, objective.micro_batches
            )
            layers = profile.layers[start:stop]
            static = stage_memory.static_bytes(
                sum(c.param_bytes for c in layers), sum(c.optimizer_state_bytes for c in layers)
            )
            assert stage.held_bytes == held.bytes(*sizes(profile, start, stop)), (objective, k)
            assert stage.peak_bytes == static + peak.bytes(*sizes(profile, start, stop)), (objective, k)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_planner_gives_the_models_numbers(stages: int) -> None:
    # Uneven layers so that every stage's sizes differ; the simulated peak and the split's memory callback
    # both equal static + the model's peak.
    layers = tuple(LayerCost(f"l{i}", 1.0, 2.0, 1.0, 0.0, 40.0 * (i + 1), 10.0 + i, 100.0 + 30 * i) for i in range(8))
    profile = ModelProfile(layers=layers, micro_batch=4, device="test", dtype="float32", input_bytes=7.0)
    model, micro_batches = CostModel(bytes_per_param=16.0), 3 * stages
    bounds = {2: [0, 3, 8], 3: [0, 2, 5, 8], 4: [0, 1, 3, 6, 8]}[stages]
    variants = [Variant("fdg", w, a) for w, a in MODES] + [Variant("1f1b"), Variant("gpipe")]
    for variant in variants:
        p = predict(profile, variant, stages, Cluster(), micro_batches=micro_batches, model=model, bounds=bounds)
        memory = planner_stage_memory(profile, variant, stages, micro_batches, model)
        for k, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            peak, _ = stage_memory.stage_footprint(
                variant.schedule, stages, k, variant.activations, variant.weights, micro_batches
            )
            static = sum(c.param_bytes for c in layers[start:stop]) / 4 * model.bytes_per_param
            expected = static + peak.bytes(*sizes(profile, start, stop))
            assert p.memory_bytes[k] == pytest.approx(expected), (variant.name, k)
            assert memory(start, stop, k) == pytest.approx(expected), (variant.name, k)
