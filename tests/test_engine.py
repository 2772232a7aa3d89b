"""The distributed engine against the single-process reference: real DeepSpeed engines, gloo, deadlines.

Each test spawns real ranks (see ``dist_harness``); one spawn trains several cases in turn to keep
the suite fast on two cores. Per-stage weights after every ``train_batch()`` call, and the losses
every rank returns, must equal :func:`fdg_schedule.fdg_reference` to 1e-6.
"""

from __future__ import annotations

import math
from typing import Any

import engine_workers
import pytest
import torch
import toy
from dist_harness import run_ranks

from fdg_schedule import FDGConfig, fdg_reference, ticks

pytestmark = pytest.mark.distributed

MODES = [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]
TOL = {"rtol": 1e-6, "atol": 1e-6}


def reference(case: dict[str, Any], parts: list[int]) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Per-call stage states (concatenated over stages) and per-micro-batch losses of the reference."""
    stages = toy.reference_stages(parts, batch_norm=case.get("batch_norm", False))
    dp = case.get("dp", 1)
    lr = case.get("lr", 0.1)
    if case.get("optimizer", "sgd") == "adam":
        opts = [torch.optim.Adam(s.parameters(), lr=lr * 0.1) for s in stages]
    else:
        opts = [torch.optim.SGD(s.parameters(), lr=lr, momentum=0.9) for s in stages]
    schedulers = []
    if case.get("warmup"):
        from deepspeed.runtime.lr_schedules import WarmupLR

        schedulers = [WarmupLR(o, warmup_min_lr=0.0, warmup_max_lr=lr, warmup_num_steps=case["warmup"]) for o in opts]
    gas = case.get("gas", 3)
    n_ticks = case["calls"] * gas
    snap_at = {(c + 1) * gas - 1 for c in range(case["calls"])}
    if case.get("drain"):
        snap_at.add(n_ticks + ticks.drain_ticks(len(stages)) - 1)
    states: list[dict[str, torch.Tensor]] = []

    def after_tick(tick: int) -> None:
        if tick in snap_at:
            states.append({k: v.detach().clone() for s in stages for k, v in s.state_dict().items()})

    config = FDGConfig(**{k: case[k] for k in ("grad_shrink", "weights", "activations", "accumulate") if k in case})
    losses = fdg_reference(
        stages,
        opts,
        toy.micro_batches(case["n"], 4 * dp)[:n_ticks],
        toy.loss_fn,
        config,
        drain=case.get("drain", False),
        schedulers=schedulers,
        clip_grad_norm=case.get("clip", 0.0),
        after_tick=after_tick,
    )
    return states, losses


def expected_returned_losses(case: dict[str, Any], stage_id: int, stages: int, losses: list[float]) -> list[float]:
    """Stage k learns micro-batch b's loss at its backward of b, tick b + 2(K-1) - k."""
    gas = case.get("gas", 3)
    calls = [(c * gas, (c + 1) * gas) for c in range(case["calls"])]
    if case.get("drain"):
        end = calls[-1][1]
        calls.append((end, end + ticks.drain_ticks(stages)))
    out = []
    for start, stop in calls:
        learned = [loss for b, loss in enumerate(losses) if start <= b + 2 * (stages - 1) - stage_id < stop]
        out.append(sum(learned) / len(learned) if learned else math.nan)
    return out


def check_against_reference(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert {r["engine"] for r in per_rank} == {"FDGPipelineEngine"}
        parts = per_rank[0]["parts"]
        ref_states, ref_losses = reference(case, parts)
        stages = len(parts) - 1
        for r in per_rank:
            assert len(r["states"]) == len(ref_states)
            for call, (got, want) in enumerate(zip(r["states"], ref_states)):
                for key, value in got.items():
                    torch.testing.assert_close(
                        value,
                        want[key],
                        **TOL,
                        msg=lambda m, key=key, call=call, case=case: f"{case} call {call} {key}: {m}",
                    )
            want_losses = expected_returned_losses(case, r["stage_id"], stages, ref_losses)
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(want_losses, dtype=torch.float32), equal_nan=True, **TOL
            )
            ticks_run = case["calls"] * case.get("gas", 3) + (ticks.drain_ticks(stages) if case.get("drain") else 0)
            assert r["global_steps"] == ticks_run  # fill and drain ticks included, equal on all stages
            assert r["global_samples"] == case["calls"] * case.get("gas", 3) * 4 * case.get("dp", 1)
            if case.get("drain"):
                assert r["in_flight"] == 0
            assert r["running_timers"] == [], f"{case}: DeepSpeed timers left running"


def _cases(stages: int, gas: int, calls: int, **extra: Any) -> list[dict[str, Any]]:
    base = {"stages": stages, "n": 64, "gas": gas, "calls": calls, "grad_shrink": 0.5}
    return [
        {**base, "weights": w, "activations": a, "optimizer": opt, **extra} for w, a in MODES for opt in ("sgd", "adam")
    ]


def test_two_stages_all_modes_sgd_and_adam(tmp_path) -> None:
    cases = _cases(2, gas=3, calls=4, drain=True)
    cases += [
        # accumulated decoupled learning, a warm-up LR schedule per tick, stage-local clipping
        dict(stages=2, n=64, gas=3, calls=3, accumulate=2, warmup=5, lr=0.1, clip=0.5, drain=True, grad_shrink=0.8),
        # the DeepSpeed-built optimizer and data through deepspeed.initialize(training_data=...)
        {"stages": 2, "n": 64, "gas": 2, "calls": 3, "ds_optimizer": True, "training_data": True, "weights": "stashed"},
        # ZeRO stage 1 wrapping the optimizer
        {"stages": 2, "n": 64, "gas": 3, "calls": 3, "zero": 1, "grad_shrink": 0.5},
        # eval_batch() between calls leaves the in-flight work untouched
        {"stages": 2, "n": 64, "gas": 3, "calls": 4, "eval_between": True, "activations": "recomputed"},
        # batch norm: running statistics updated once per micro-batch, also when the forward is rerun
        *(
            {"stages": 2, "n": 64, "gas": 3, "calls": 3, "batch_norm": True, "weights": w, "activations": "recomputed"}
            for w in ("current", "stashed")
        ),  # fmt: skip
        # DeepSpeed's activation checkpointing recomputes with the weights in the parameters: stashed ones here
        {"stages": 2, "n": 64, "gas": 3, "calls": 3, "checkpoint_interval": 1, "weights": "stashed"},
        # wall_clock_breakdown: DeepSpeed's output hooks start backward timers a non-last stage must stop
        {"stages": 2, "n": 64, "gas": 3, "calls": 3, "wall_clock": True, "grad_shrink": 0.5, "drain": True},
    ]
    results = run_ranks(engine_workers.train, 2, tmp_path, cases, deadline_s=300)
    check_against_reference(results, cases)


def test_recomputed_forward_draws_the_stored_forwards_dropout_masks(tmp_path) -> None:
    """Dropout on stage 0: with the forward's weights (stashed), recomputing the activations at backward
    time must give the stored run's weights exactly -- the recomputed forward replays the RNG state
    (host and accelerator, through DeepSpeed's accelerator API) the first forward drew its masks from."""
    base = {"stages": 2, "n": 64, "gas": 3, "calls": 3, "grad_shrink": 0.5, "weights": "stashed", "drain": True}
    cases = [{**base, "dropout": 0.3, "activations": a} for a in ("stored", "recomputed")]
    cases.append({**base, "dropout": 0.0, "activations": "stored"})  # masks of nothing: they change the result
    results = run_ranks(engine_workers.train, 2, tmp_path, cases, deadline_s=200)
    for r in results:
        stored, recomputed, plain = (c["states"] for c in r)
        for call, (a, b) in enumerate(zip(stored, recomputed)):
            for key in a:
                torch.testing.assert_close(
                    b[key], a[key], **TOL, msg=lambda m, key=key, call=call: f"{key} {call}: {m}"
                )
        if r[0]["stage_id"] == 0:
            assert any(not torch.equal(stored[-1][k], plain[-1][k]) for k in plain[-1]), "dropout had no effect"


def test_three_stages_all_modes_tick_by_tick(tmp_path) -> None:
    cases = _cases(3, gas=1, calls=9, drain=True)  # one tick per call: compared after every tick
    cases += [{"stages": 3, "n": 64, "gas": 2, "calls": 4, "wall_clock": True, "grad_shrink": 0.5, "drain": True}]
    results = run_ranks(engine_workers.train, 3, tmp_path, cases, deadline_s=300)
    check_against_reference(results, cases)


def test_data_parallel_2_x_pipeline_2(tmp_path) -> None:
    base = {"stages": 2, "dp": 2, "n": 32, "gas": 3, "calls": 3, "drain": True, "grad_shrink": 0.5}
    cases = [
        {**base, "weights": w, "activations": a, "optimizer": opt}
        for w, a, opt in (("current", "stored", "sgd"), ("stashed", "recomputed", "adam"))
    ]
    results = run_ranks(engine_workers.train, 4, tmp_path, cases, deadline_s=300)
    check_against_reference(results, cases)
    # Data-parallel peers of a stage hold identical weights.
    for i in range(len(cases)):
        by_stage: dict[int, list] = {}
        for r in results:
            by_stage.setdefault(r[i]["stage_id"], []).append(r[i]["states"][-1])
        for a, b in by_stage.values():
            for key in a:
                assert torch.equal(a[key], b[key])


def test_one_stage_equals_plain_backprop_bit_for_bit(tmp_path) -> None:
    case = {"stages": 1, "n": 16, "gas": 4, "calls": 3, "grad_shrink": 0.3, "weights": "stashed"}
    (result,) = run_ranks(engine_workers.train, 1, tmp_path, [case], deadline_s=120)
    model = toy.Chain(toy.layers(spec=False), 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in toy.micro_batches(16, 4)[:12]:
        toy.loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for key, value in model.state_dict().items():
        assert torch.equal(result[0]["states"][-1][key], value), key


def test_stock_1f1b_is_unchanged_by_the_import(tmp_path) -> None:
    cases = [{"stages": 2, "n": 32, "gas": 4, "calls": 3, "schedule": schedule} for schedule in (None, "1f1b")]
    stock = run_ranks(engine_workers.train, 2, tmp_path, cases, False, deadline_s=200)
    imported = run_ranks(engine_workers.train, 2, tmp_path, cases, True, deadline_s=200)
    for rank in range(2):
        for i in range(len(cases)):
            assert stock[rank][i]["engine"] == imported[rank][i]["engine"] == "PipelineEngine"
            assert stock[rank][i]["losses"] == imported[rank][i]["losses"]
            for a, b in zip(stock[rank][i]["states"], imported[rank][i]["states"]):
                for key in a:
                    assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "extra",
    [{}, {"bf16": True, "clip": 1.0}, {"zero": 1, "clip": 1.0}, {"clip": 1.0, "dp": 2}],
    ids=["fp32", "bf16", "zero1", "fp32-clip-dp2"],
)
def test_no_collective_across_stages_in_steady_state(tmp_path, extra: dict[str, Any]) -> None:
    world = 2 * extra.get("dp", 1)
    case = {"stages": 2, "n": 64, "gas": 3, "calls": 4, "grad_shrink": 0.5, **extra}
    traces = run_ranks(engine_workers.trace_collectives, world, tmp_path, case, deadline_s=200)
    for trace in traces:
        for name, ranks in trace["seen"]:
            assert set(ranks) <= set(trace["dp_group"]), f"stage {trace['stage_id']}: {name} over ranks {ranks}"
    if not extra:  # the tracer does see DeepSpeed's own cross-stage collectives under 1F1B
        stock = run_ranks(engine_workers.trace_collectives, world, tmp_path, {**case, "schedule": "1f1b"})
        assert any(set(ranks) == {0, 1} for _, ranks in stock[0]["seen"])


BAD = [
    ({"pipeline": {"schedule": "fdg", "fdg": {"grad_shrink": 2.0}}}, "grad_shrink must be in (0, 1], got 2.0"),
    ({"pipeline": {"schedule": "fdg", "fdg": {"stash": True}}}, "unknown key(s) ['stash']"),
    ({"pipeline": {"schedule": "fdg"}, "fp16": {"enabled": True}}, "fp16.enabled=true is not supported"),
]


@pytest.mark.parametrize("config,message", BAD)
def test_bad_config_fails_fast_on_every_rank(tmp_path, config: dict, message: str) -> None:
    case = {"stages": 2, "config": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, **config}}
    results = run_ranks(engine_workers.bad_config, 2, tmp_path, case, deadline_s=120)
    for r in results:
        assert r["error"] is not None and message in r["error"]


def test_tied_layers_across_stages_are_refused_on_every_rank(tmp_path) -> None:
    case = {"stages": 2, "config": {"train_micro_batch_size_per_gpu": 2, "pipeline": {"schedule": "fdg"}}}
    results = run_ranks(engine_workers.bad_config, 2, tmp_path, case, True, deadline_s=120)
    for r in results:
        assert r["error"] is not None and "tied layer 'emb' spans pipeline stages [0, 1]" in r["error"]


def test_bf16_and_zero1_follow_the_fp32_reference_closely(tmp_path) -> None:
    """bf16 (DeepSpeed's BF16_Optimizer, fp32 master weights) and bf16 + ZeRO-1: the same FDG math,
    rounded: weights stay within bf16 precision of the fp32 reference."""
    base = {"stages": 2, "n": 64, "gas": 3, "calls": 3, "grad_shrink": 0.5, "bf16": True}
    cases = [
        {**base, "weights": w, "activations": a, **extra}
        for (w, a), extra in ((("current", "stored"), {}), (("stashed", "recomputed"), {"zero": 1}))
    ]
    results = run_ranks(engine_workers.train, 2, tmp_path, cases, deadline_s=300)
    for i, case in enumerate(cases):
        ref_states, _ = reference(case, results[0][i]["parts"])
        for r in results:
            assert r[i]["engine"] == "FDGPipelineEngine"
            for key, value in r[i]["states"][-1].items():
                torch.testing.assert_close(value, ref_states[-1][key], rtol=0.05, atol=0.02, msg=f"{case} {key}")
