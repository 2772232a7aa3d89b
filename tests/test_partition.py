"""The partitioner against brute force on small cases, its memory formulas, its errors and its determinism."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from fdg_schedule.partitioning.partition import (
    PICOSECONDS,
    Objective,
    Partition,
    _Costs,
    balanced_partition,
    evaluate_partition,
    parameter_split,
    rescaled,
)
from fdg_schedule.partitioning.profile import LayerCost, ModelProfile
from fdg_schedule.tools.stage_times import rebalanced_advice

OBJECTIVES = [
    Objective(),
    Objective(activations="recomputed"),
    Objective(weights="stashed"),
    Objective(weights="stashed", activations="recomputed", accumulate=3),
    Objective(schedule="1f1b", micro_batches=4),
    Objective(schedule="1f1b", micro_batches=1),
]


def random_profile(rng: random.Random, layers: int, zero_time_share: float = 0.2) -> ModelProfile:
    def seconds() -> float:
        return 0.0 if rng.random() < zero_time_share else rng.choice([1e-3, 2e-3, 5e-3]) * rng.randint(1, 9)

    costs = [
        LayerCost(
            name=f"L{i}",
            forward_s=seconds(),
            backward_s=seconds(),
            recompute_s=seconds(),
            step_s=seconds() / 4,
            param_bytes=rng.choice([0, 4096, 65536]),
            activation_bytes=rng.choice([1024, 8192, 262144]),
            saved_bytes=rng.choice([0, 2048, 131072, 1048576]),
            params=rng.choice([0, 10, 1000]),
            optimizer_state_bytes=rng.choice([0, 4096]),
        )
        for i in range(layers)
    ]
    return ModelProfile(layers=tuple(costs), micro_batch=8, device="cpu", dtype="float32", input_bytes=4096)


def brute_force(
    profile: ModelProfile, stages: int, objective: Objective, own: list[bool] | None = None
) -> tuple[float, float] | None:
    """Over every split that fits the memory limit (and gives every stage a layer of its own, with ``own``):
    the least bottleneck, and the largest fastest-stage time among the splits with that bottleneck (None:
    no split fits)."""
    n, best = len(profile.layers), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        parts = [0, *cuts, n]
        if own is not None and not all(any(own[a:b]) for a, b in zip(parts, parts[1:])):
            continue
        plan = evaluate_partition(profile, parts, objective)
        if objective.memory_limit is not None and any(s.peak_bytes > objective.memory_limit for s in plan.stages):
            continue
        key = (plan.bottleneck_s, -min(s.time_s for s in plan.stages))
        best = key if best is None or key < best else best
    return None if best is None else (best[0], -best[1])


def achieved(plan: Partition) -> tuple[float, float]:
    return plan.bottleneck_s, min(s.time_s for s in plan.stages)


@pytest.mark.parametrize("seed", range(25))
def test_bottleneck_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(1, 9))
    for objective in OBJECTIVES:
        for stages in range(1, min(5, len(profile.layers)) + 1):
            expected = brute_force(profile, stages, objective)
            plan = balanced_partition(profile, stages, objective)
            assert achieved(plan) == expected, (seed, objective, stages, plan.parts)
            assert plan.parts[0] == 0 and plan.parts[-1] == len(profile.layers) and len(plan.parts) == stages + 1


@pytest.mark.parametrize("seed", range(25))
def test_bottleneck_equals_brute_force_with_a_layer_of_its_own_on_every_stage(seed: int) -> None:
    """FDG with tied layers: no stage may hold only tied (or parameterless) layers."""
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(2, 9))
    n = len(profile.layers)
    own = [rng.random() < 0.6 for _ in range(n)]
    for stages in range(1, min(5, n) + 1):
        expected = brute_force(profile, stages, Objective(), own)
        if expected is None:
            with pytest.raises(ValueError, match="each holding a layer with parameters of its own"):
                balanced_partition(profile, stages, Objective(), own)
            continue
        plan = balanced_partition(profile, stages, Objective(), own)
        assert achieved(plan) == expected, (seed, stages, own, plan.parts)
        assert all(any(own[a:b]) for a, b in zip(plan.parts, plan.parts[1:])), (own, plan.parts)
        assert plan.own == tuple(own)


def test_a_tied_head_is_not_left_alone_on_the_last_stage() -> None:
    # The tied LM head is the slowest layer: alone on the last stage it would balance best, but FDG steps it
    # with a tied optimizer of its own, so that stage's optimizer would be empty.
    profile = profile_of(*[layer(1e-3, 2e-3) for _ in range(6)], layer(8e-3, 12e-3))
    assert balanced_partition(profile, 2).parts == [0, 6, 7]
    own = [True] * 6 + [False]
    plan = balanced_partition(profile, 2, Objective(), own)
    assert plan.parts == [0, 5, 7]
    assert rebalanced_advice(plan, [s.time_s for s in plan.stages]).endswith("the same parts [0, 5, 7]")


@pytest.mark.parametrize("seed", range(25))
def test_bottleneck_equals_brute_force_under_a_memory_limit(seed: int) -> None:
    rng = random.Random(1000 + seed)
    profile = random_profile(rng, rng.randint(2, 9))
    n = len(profile.layers)
    for objective in OBJECTIVES:
        for stages in range(2, min(5, n) + 1):
            # Limits between the smallest and largest peak any split has: some splits fit, some do not.
            peaks = sorted(
                max(s.peak_bytes for s in evaluate_partition(profile, [0, *cuts, n], objective).stages)
                for cuts in itertools.combinations(range(1, n), stages - 1)
            )
            for limit in {peaks[0] - 1, peaks[0], peaks[len(peaks) // 2], peaks[-1]} - {0}:
                limited = Objective(**{**objective.__dict__, "memory_limit": limit})
                expected = brute_force(profile, stages, limited)
                if expected is None:
                    with pytest.raises(ValueError, match="memory_limit"):
                        balanced_partition(profile, stages, limited)
                    continue
                plan = balanced_partition(profile, stages, limited)
                assert achieved(plan) == expected, (seed, limited, stages, plan.parts)
                assert all(s.peak_bytes <= limit for s in plan.stages)


def layer(forward: float, backward: float, recompute: float = 0.0, step: float = 0.0, **sizes: int) -> LayerCost:
    fields = {"param_bytes": 0, "activation_bytes": 0, "saved_bytes": 0, **sizes}
    return LayerCost("L", forward, backward, recompute, step, **fields)


def profile_of(*layers: LayerCost, input_bytes: int = 0) -> ModelProfile:
    return ModelProfile(layers=layers, micro_batch=1, device="cpu", dtype="float32", input_bytes=input_bytes)


def test_recomputation_moves_the_cut_towards_stage_0() -> None:
    # Eight equal layers, forward 1 + backward 2 ms: stored 4 | 4 (12 ms each). Recomputed, stage 0
    # pays the extra forward (4 ms per layer): 4 | 4 would be 16 vs 12 ms, 3 | 5 is 12 vs 15 ms.
    profile = profile_of(*[layer(1e-3, 2e-3, recompute=1e-3) for _ in range(8)])
    assert balanced_partition(profile, 2).parts == [0, 4, 8]
    recomputed = balanced_partition(profile, 2, Objective(activations="recomputed"))
    assert recomputed.parts == [0, 3, 8]
    assert [s.time_s for s in recomputed.stages] == [12e-3, 15e-3]
    assert recomputed.stages[0].recompute_s == pytest.approx(3e-3) and recomputed.stages[1].recompute_s == 0


def test_step_is_shared_by_accumulated_ticks_and_1f1b_micro_batches() -> None:
    profile = profile_of(layer(1e-3, 1e-3, step=4e-3), layer(1e-3, 1e-3))
    assert evaluate_partition(profile, [0, 1, 2]).stages[0].time_s == pytest.approx(6e-3)
    assert evaluate_partition(profile, [0, 1, 2], Objective(accumulate=4)).stages[0].time_s == pytest.approx(3e-3)
    assert evaluate_partition(profile, [0, 1, 2], Objective(schedule="1f1b", micro_batches=2)).stages[
        0
    ].time_s == pytest.approx(4e-3)


def test_held_and_peak_memory_follow_each_mode() -> None:
    # Per layer: input I (the previous output), saved A, weights W; K = 3: delays 4, 2, 0.
    a, w, i0, out = 1000, 100, 7, 10
    layers = [layer(1e-3, 1e-3, param_bytes=w, saved_bytes=a, activation_bytes=out) for _ in range(3)]
    profile = profile_of(*layers, input_bytes=i0)
    parts = [0, 1, 2, 3]
    static = 2 * w

    def memory(objective: Objective) -> list[tuple[int, int]]:
        return [(s.held_bytes, s.peak_bytes) for s in evaluate_partition(profile, parts, objective).stages]

    assert memory(Objective()) == [
        (4 * (i0 + a), 4 * (i0 + a) + static),
        (2 * (out + a), 2 * (out + a) + static),
        (0, out + a + static),
    ]
    assert memory(Objective(weights="stashed", activations="recomputed")) == [
        (4 * (i0 + w), 4 * (i0 + w) + a + static),
        (2 * (out + w), 2 * (out + w) + a + static),
        (0, out + a + static),
    ]
    assert memory(Objective(weights="stashed")) == [
        (4 * (i0 + a + w), 4 * (i0 + a + w) + static),
        (2 * (out + a + w), 2 * (out + a + w) + static),
        (0, out + a + static),
    ]
    # 1F1B: min(K - k, micro_batches) micro-batches in flight.
    assert [p for _, p in memory(Objective(schedule="1f1b", micro_batches=2))] == [
        2 * (i0 + a) + static,
        2 * (out + a) + static,
        out + a + static,
    ]


def test_a_memory_limit_moves_layers_off_stage_0() -> None:
    # Equal times; stage 0 (delay 2 at K = 2) holds 2 micro-batches' activations, so a limit that
    # fits two saved layers on stage 0 only as one layer forces 1 | 3.
    profile = profile_of(*[layer(1e-3, 2e-3, saved_bytes=1000) for _ in range(4)])
    assert balanced_partition(profile, 2).parts == [0, 2, 4]
    limited = balanced_partition(profile, 2, Objective(memory_limit=3000))
    assert limited.parts == [0, 1, 3 + 1] and limited.stages[0].peak_bytes == 2000
    with pytest.raises(ValueError, match=r"memory_limit 1999 bytes .* raise the limit"):
        balanced_partition(profile, 2, Objective(memory_limit=1999))


def test_result_is_deterministic_and_spreads_slack() -> None:
    # One heavy layer sets the bottleneck; the other stages share the rest evenly rather than
    # packing the last stages full.
    profile = profile_of(layer(10e-3, 10e-3), *[layer(1e-3, 1e-3) for _ in range(12)])
    plans = [balanced_partition(profile, 4).parts for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    times = [s.time_s for s in balanced_partition(profile, 4).stages]
    assert times[0] == pytest.approx(20e-3) and max(times[1:]) - min(times[1:]) <= 2e-3 + 1e-12


def test_bad_requests_name_the_value() -> None:
    profile = profile_of(layer(1e-3, 1e-3), layer(1e-3, 1e-3))
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
        balanced_partition(profile, 3)
    with pytest.raises(ValueError, match=r"parts \[0, 2, 2\] must rise strictly"):
        evaluate_partition(profile, [0, 2, 2])
    with pytest.raises(ValueError, match="schedule must be one of"):
        Objective(schedule="gpipe")
    with pytest.raises(ValueError, match="accumulate must be an integer >= 1, got 0"):
        Objective(accumulate=0)


def test_objective_from_ds_config() -> None:
    fdg = {"pipeline": {"schedule": "fdg", "fdg": {"activations": "recomputed", "weights": "stashed", "accumulate": 2}}}
    assert Objective.from_ds_config(fdg) == Objective(activations="recomputed", weights="stashed", accumulate=2)
    stock = {"gradient_accumulation_steps": 4}
    assert Objective.from_ds_config(stock, memory_limit=10) == Objective("1f1b", micro_batches=4, memory_limit=10)


def test_parameter_split_is_deepspeeds() -> None:
    profile = profile_of(*[layer(1e-3, 1e-3, params=p) for p in (10, 10, 10, 30)])
    assert parameter_split(profile, 2) == [0, 3, 4]


def test_rescaled_profile_predicts_what_was_measured_and_moves_the_cut() -> None:
    profile = profile_of(*[layer(0.25, 0.75, recompute=0.25, step=0.1, saved_bytes=7) for _ in range(8)])
    plan = balanced_partition(profile, 2)
    assert plan.parts == [0, 4, 8]
    measured = [plan.stages[0].time_s, 1.5 * plan.stages[1].time_s]  # stage 1 ran 50 % over its prediction
    again = rescaled(profile, plan, measured)
    assert [s.time_s for s in evaluate_partition(again, plan.parts).stages] == pytest.approx(measured, rel=1e-9)
    assert balanced_partition(again, 2).parts == [0, 5, 8]  # one layer moves to the stage that was faster
    assert [c.saved_bytes for c in again.layers] == [7] * 8
    assert again.meta["rescaled"]["factors"] == pytest.approx([1.0, 1.5])
    # every component scales, so the recomputed objective's prediction matches too
    recomputing = Objective(activations="recomputed")
    plan_r = balanced_partition(profile, 2, recomputing)
    measured_r = [2 * s.time_s for s in plan_r.stages]
    predicted_r = evaluate_partition(rescaled(profile, plan_r, measured_r), plan_r.parts, recomputing).stages
    assert [s.time_s for s in predicted_r] == pytest.approx(measured_r, rel=1e-9)
    with pytest.raises(ValueError, match="measured_s has 1 stage times for a split of 2 stages"):
        rescaled(profile, plan, [1.0])
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        rescaled(profile, plan, [1.0, 0.0])


@pytest.mark.parametrize("seed", range(10))
def test_the_planners_split_is_the_partitioners_on_the_same_costs(seed: int) -> None:
    """One solver: the planner's ``best_split`` given the partitioner's stage times and memory finds the same
    bottleneck with its own tie rule, and the same parts with the partitioner's (``spread``)."""
    from fdg_schedule.plan.split import best_split

    rng = random.Random(2000 + seed)
    profile = random_profile(rng, rng.randint(2, 9))
    n = len(profile.layers)
    for objective in OBJECTIVES:
        for stages in range(1, min(5, n) + 1):
            limit = None if rng.random() < 0.5 else rng.choice([2**20, 2**22, 2**24])
            limited = Objective(**{**objective.__dict__, "memory_limit": limit})

            costs = _Costs(profile, stages, limited)  # the partitioner's stage times and peaks, as callbacks

            def time(a: int, b: int, k: int, costs: _Costs = costs) -> float:
                return int(costs.time_prefix(k)[b] - costs.time_prefix(k)[a]) / PICOSECONDS

            def peak(a: int, b: int, k: int, costs: _Costs = costs) -> float:
                return costs.memory(k, a, b)[0]

            memory = peak if limit is not None else None
            spread = best_split(n, stages, time, memory, limit if limit is not None else float("inf"), spread=True)
            plain = best_split(n, stages, time, memory, limit if limit is not None else float("inf"))
            try:
                plan = balanced_partition(profile, stages, limited)
            except ValueError:
                assert spread is None and plain is None
                continue
            assert spread == plan.parts, (seed, limited, stages)
            assert plain is not None
            assert evaluate_partition(profile, plain, limited).bottleneck_s == plan.bottleneck_s


def test_the_delay_weight_gives_the_most_delayed_stages_fewer_layers() -> None:
    # Note [the delay-weighted split]: twelve equal layers of 3 ms at K = 3 (h = 4, 2, 0): balanced 4 | 4 | 4;
    # alpha 0.25 charges stage 0 2x and stage 1 1.5x: 3 | 4 | 5 (weighted 18, 18, 15 ms; 4 | 4 | 4 would be 24)
    profile = profile_of(*[layer(1e-3, 2e-3) for _ in range(12)])
    assert balanced_partition(profile, 3).parts == [0, 4, 8, 12]
    weighted = balanced_partition(profile, 3, Objective(delay_weight=0.25))
    assert weighted.parts == [0, 3, 7, 12]
    assert [s.time_s for s in weighted.stages] == pytest.approx([9e-3, 12e-3, 15e-3])  # their own times, unweighted
    assert "delay weight 0.25" in weighted.objective.describe()
    # accumulate 2 halves h (2, 1, 0): alpha 0.5 then weighs as 0.25 did
    assert balanced_partition(profile, 3, Objective(delay_weight=0.5, accumulate=2)).parts == [0, 3, 7, 12]


@pytest.mark.parametrize("seed", range(8))
def test_the_delay_weighted_split_equals_brute_force_over_the_weighted_times(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(4, 9))
    objective = Objective(weights="stashed", accumulate=rng.choice([1, 2]), delay_weight=rng.choice([0.1, 0.5, 2.0]))
    stages = rng.randint(2, 4)
    weight = [1 + objective.delay_weight * 2 * (stages - 1 - k) / objective.accumulate for k in range(stages)]
    n, best = len(profile.layers), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        plan = evaluate_partition(profile, [0, *cuts, n], objective)
        cost = max(s.time_s * w for s, w in zip(plan.stages, weight))
        best = cost if best is None else min(best, cost)
    plan = balanced_partition(profile, stages, objective)
    assert max(s.time_s * w for s, w in zip(plan.stages, weight)) == pytest.approx(best, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"delay_weight": -0.5}, "delay_weight must be a number >= 0, got -0.5; 0 balances time alone"),
        ({"delay_weight": float("nan")}, "delay_weight must be a number >= 0, got nan"),
        ({"delay_weight": True}, "delay_weight must be a number >= 0, got True"),
        ({"delay_weight": 0.5, "schedule": "1f1b"}, "delay_weight 0.5 needs schedule 'fdg' (1F1B has no delay)"),
    ],
)
def test_a_bad_delay_weight_is_refused_with_the_value_and_the_fix(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Objective(**fields)
