"""The distributed engine against the single-process reference: real DeepSpeed engines, gloo, deadlines.

Each test spawns real ranks (see ``dist_harness``); one spawn trains several cases in turn to keep
the suite fast on two cores. Per-stage weights after every ``train_batch()`` call, and the losses
every rank returns, must equal :func:`fdg_schedule.fdg_reference` to 1e-6.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import engine_workers
import pytest
import torch
import toy
from dist_harness import fdg_modules, run_ranks, run_ranks_calls, run_ranks_each

from fdg_schedule import FDGConfig, fdg_reference
from fdg_schedule.corrections.reference import ReferenceState
from fdg_schedule.sched import ticks

pytestmark = pytest.mark.distributed

MODES = [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]
TOL = {"rtol": 1e-6, "atol": 1e-6}
# The staleness corrections separately and together; T small enough that the ramp ends within a test.
CORRECTIONS = [
    {"delay_lr_ticks": 8},
    {"predict_decay": 0.5},
    {"delay_momentum": True},
    {"delay_lr_ticks": 8, "predict_decay": 0.5, "delay_momentum": True, "delay_momentum_peak_lr": 0.2},
]
BOTH = CORRECTIONS[-1]  # all of them; the peak lr above every toy lr (SGD 0.1, Adam 0.01, warm-ups from 0)
# the prediction aimed at stage 0's update: the last stage predicts too (Note [the last stage's prediction])
FIRST_STAGE = {"predict_decay": 0.5, "predict_horizon": "first_stage"}
# the delayed stages' momentum raised (the extension key), with delay_lr and the first-stage prediction
RAISED = {"delay_lr_ticks": 8, "predict_decay": 0.0, "predict_horizon": "first_stage", "delay_momentum_raise": 2.0}
# the last applied update over half the horizon (predict_scale), and the momentum look-ahead (predict_momentum) with
# the other keys: Note [the prediction's reach]
SCALED = {"predict_decay": 0.0, "predict_scale": 0.5}
LOOKAHEAD = {"predict_decay": 0.0, "predict_horizon": "first_stage", "predict_momentum": 0.9, "predict_scale": 2.0,
             "delay_momentum_raise": 1.0, "delay_lr_ticks": 8}  # fmt: skip


def reference(case: dict[str, Any], parts: list[int]) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Per-call stage states (concatenated over stages) and per-micro-batch losses of the reference."""
    with toy.newton_schulz_dtype(case):
        return _reference(case, parts)


def _reference(case: dict[str, Any], parts: list[int]) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    stages = toy.reference_stages(parts, batch_norm=case.get("batch_norm", False))
    dp = case.get("dp", 1)
    opts, schedulers = toy.reference_optimizers(stages, case)
    gas = case.get("gas", 3)
    n_ticks = case["calls"] * gas
    snap_at = {(c + 1) * gas - 1 for c in range(case["calls"])}
    if case.get("drain"):
        snap_at.add(n_ticks + ticks.drain_ticks(len(stages)) - 1)
    states: list[dict[str, torch.Tensor]] = []

    def after_tick(tick: int) -> None:
        if tick in snap_at:
            states.append({k: v.detach().clone() for s in stages for k, v in s.state_dict().items()})

    # corrections "auto": the reference gets the keys the rule should choose, written out (Note [the auto rule])
    keys = {k: case[k] for k in engine_workers.FDG_KEYS if k in case and k != "corrections"}
    config = FDGConfig(**keys, **case.get("auto_chooses", {}))
    if case.get("drain_each_call"):  # a segment per call; the tick count and delta go on (ReferenceState)
        carried, data = ReferenceState(), toy.micro_batches(case["n"], 4 * dp)
        for call in range(case["calls"]):
            batches = data[call * gas : (call + 1) * gas]
            fdg_reference(stages, opts, batches, toy.loss_fn, config, drain=True, schedulers=schedulers, state=carried)
            states.append({k: v.detach().clone() for s in stages for k, v in s.state_dict().items()})
        return states, []
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
        for r in per_rank:  # Note [shared-memory transport]: a link to each neighbour on this host, none otherwise;
            stage, last = r["stage_id"], case["stages"] - 1  # "auto" (the default) runs "shm" on Linux with gloo
            shm = case.get("transport", "auto") != "process_group"
            expected = ["next"] * (stage < last) + ["prev"] * (stage > 0) if shm else []
            assert r["links"] == sorted(expected), (i, stage)
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
                        **case.get("tol", TOL),
                        msg=lambda m, key=key, call=call, case=case: f"{case} call {call} {key}: {m}",
                    )
            if not case.get("drain_each_call"):
                want_losses = expected_returned_losses(case, r["stage_id"], stages, ref_losses)
                torch.testing.assert_close(
                    torch.tensor(r["losses"]),
                    torch.tensor(want_losses, dtype=torch.float32),
                    equal_nan=True,
                    **case.get("tol", TOL),
                )
            drains = case["calls"] if case.get("drain_each_call") else int(case.get("drain", False))
            ticks_run = case["calls"] * case.get("gas", 3) + drains * ticks.drain_ticks(stages)
            assert r["global_steps"] == ticks_run  # fill and drain ticks included, equal on all stages
            assert r["global_samples"] == case["calls"] * case.get("gas", 3) * 4 * case.get("dp", 1)
            if case.get("drain") or case.get("drain_each_call"):
                assert r["in_flight"] == 0
            assert r["running_timers"] == [], f"{case}: DeepSpeed timers left running"
            if case.get("check_staleness"):
                want = expected_staleness(case, r["stage_id"], stages, ref_states, set(r["states"][0]))
                torch.testing.assert_close(
                    torch.tensor(r["staleness"]), torch.tensor(want), rtol=1e-5, atol=1e-7, equal_nan=True
                )


def expected_staleness(
    case: dict[str, Any], stage_id: int, stages: int, ref_states: list[dict[str, torch.Tensor]], keys: set[str]
) -> list[float]:
    """fdg_stats["staleness"] after each one-tick call, from the reference's weights (no prediction).

    S[t] = the stage's weights at the end of tick t, which its forward at tick t used (the step comes
    first in a tick). The micro-batch entering stage k at tick f (``f % every == 0``) is measured at
    its backward, tick f + d, against the weights before that tick's step: ||S[f] - S[f+d-1]|| / ||S[f+d-1]||.
    """
    assert case["gas"] == 1 and "predict_decay" not in case
    every, d = case["staleness_every"], ticks.delay(stages, stage_id)
    flat = [torch.cat([s[key].flatten() for key in sorted(keys)]) for s in ref_states[: case["calls"]]]
    out = []
    for call in range(case["calls"]):
        forwards = [f for f in range(stage_id, call - d + 1) if f % every == 0]
        if d == 0 or not forwards:
            out.append(0.0 if d == 0 else math.nan)
            continue
        f = forwards[-1]
        out.append(float((flat[f] - flat[f + d - 1]).norm() / flat[f + d - 1].norm()))
    return out


def _cases(stages: int, gas: int, calls: int, **extra: Any) -> list[dict[str, Any]]:
    base = {"stages": stages, "n": 64, "gas": gas, "calls": calls, "grad_shrink": 0.5}
    return [
        {**base, "weights": w, "activations": a, "optimizer": opt, **extra} for w, a in MODES for opt in ("sgd", "adam")
    ]


def _corrected(stages: int, gas: int, calls: int, **extra: Any) -> list[dict[str, Any]]:
    """Every mode with all corrections (Note [staleness corrections]), then each correction alone
    in one mode; SGD and Adam in turn."""
    base = {"stages": stages, "n": 64, "gas": gas, "calls": calls, "grad_shrink": 0.5, **extra}
    cases = [
        {**base, "weights": w, "activations": a, "optimizer": ("sgd", "adam")[i % 2], **BOTH}
        for i, (w, a) in enumerate(MODES)
    ]
    modes = (("current", "recomputed"), ("stashed", "stored"), ("current", "stored"))
    alone = zip(CORRECTIONS[:-1], modes, ("adam", "sgd", "adam"))
    cases += [{**base, "weights": w, "activations": a, "optimizer": opt, **c} for c, (w, a), opt in alone]
    cases += [
        {**base, "weights": w, "activations": a, "optimizer": ("adam", "sgd")[i % 2], **FIRST_STAGE}
        for i, (w, a) in enumerate(MODES)
    ]
    cases += [
        {**base, "weights": w, "activations": a, "optimizer": ("adam", "sgd")[i % 2], **RAISED}
        for i, (w, a) in enumerate(MODES)
    ]
    cases += [
        {**base, "weights": w, "activations": a, "optimizer": opt, **keys}
        for keys, (w, a), opt in (
            (SCALED, ("current", "stored"), "sgd"),
            (SCALED, ("stashed", "recomputed"), "adam"),
            (LOOKAHEAD, ("stashed", "stored"), "sgd"),
            (LOOKAHEAD, ("current", "recomputed"), "adam"),
        )
    ]
    return cases


def _ds_optimizers(stages: int, **extra: Any) -> list[dict[str, Any]]:
    """DeepSpeed's "Muon" (its Muon half for the matrices, its FusedAdam half for the rest) and "Lion" (its CPU
    Lion, offloaded) built from the config, plain and with the corrections acting on Muon's momentum, Adam's and
    Lion's first beta (toy.DS_OPTIMIZERS)."""
    base = {"stages": stages, "n": 64, "gas": 2, "calls": 4, "drain": True, "grad_shrink": 0.5, **extra}
    return [
        {**base, "ds_optimizer": "Muon", "weights": "current", "activations": "stored"},
        {**base, "ds_optimizer": "Muon", "weights": "stashed", "activations": "recomputed", **BOTH},
        {**base, "ds_optimizer": "Lion", "weights": "stashed", "activations": "stored", **RAISED},
        {**base, "ds_optimizer": "Lion", "weights": "current", "activations": "recomputed"},
        # the prediction from Muon's last applied (orthogonalised) update, half the horizon; the look-ahead
        {**base, "ds_optimizer": "Muon", "weights": "stashed", "activations": "stored", **SCALED},
        {**base, "ds_optimizer": "Muon", "weights": "current", "activations": "recomputed", **LOOKAHEAD},
    ]


def _two_stages_all_modes(flops_file: str) -> list[dict[str, Any]]:
    cases = _cases(2, gas=3, calls=4, drain=True) + _ds_optimizers(2)
    cases += _corrected(2, gas=3, calls=4, drain=True)
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
        # wall_clock_breakdown: DeepSpeed's output hooks start backward timers a non-last stage must stop;
        # DeepSpeed's flops profiler prints stage 0's profile of tick 4 (global rank 0, as under 1F1B)
        {
            "stages": 2,
            "n": 64,
            "gas": 3,
            "calls": 3,
            "wall_clock": True,
            "grad_shrink": 0.5,
            "drain": True,
            "flops_file": flops_file,
        },
        # the corrections with accumulate 2 (h = 1), a per-tick warm-up, clipping; the DeepSpeed-built
        # optimizer; ZeRO-1 (delta over the all-gathered weights); batch norm (buffers not predicted)
        dict(
            stages=2,
            n=64,
            gas=3,
            calls=3,
            accumulate=2,
            warmup=5,
            lr=0.1,
            clip=0.5,
            drain=True,
            grad_shrink=0.8,
            weights="stashed",
            **BOTH,
        ),  # fmt: skip
        {"stages": 2, "n": 64, "gas": 2, "calls": 3, "ds_optimizer": True, "weights": "current", **BOTH},
        {"stages": 2, "n": 64, "gas": 3, "calls": 3, "accumulate": 2, "weights": "stashed", **BOTH, **FIRST_STAGE},
        {"stages": 2, "n": 64, "gas": 3, "calls": 3, "zero": 1, "grad_shrink": 0.5, "weights": "stashed", **BOTH},
        {
            "stages": 2,
            "n": 64,
            "gas": 3,
            "calls": 3,
            "batch_norm": True,
            "weights": "stashed",
            "activations": "recomputed",
            **BOTH,
        },  # fmt: skip
        # the per-tick messages through the process group, not the default shared memory: the same math
        *(
            {
                "stages": 2,
                "n": 64,
                "gas": 3,
                "calls": 4,
                "drain": True,
                "grad_shrink": 0.5,
                "weights": w,
                "activations": a,
                "optimizer": opt,
                "transport": "process_group",
            }
            for w, a, opt in (("current", "stored", "sgd"), ("stashed", "recomputed", "adam"))
        ),  # fmt: skip
        # t counts every tick since the start, across drains (not the segment's tick)
        {
            "stages": 2,
            "n": 64,
            "gas": 3,
            "calls": 3,
            "drain_each_call": True,
            "delay_lr_ticks": 20,
            "predict_decay": 0.5,
        },  # fmt: skip
    ]
    return cases


def _dropout_cases() -> list[dict[str, Any]]:
    base = {"stages": 2, "n": 64, "gas": 3, "calls": 3, "grad_shrink": 0.5, "weights": "stashed", "drain": True}
    cases = [{**base, "dropout": 0.3, "activations": a} for a in ("stored", "recomputed")]
    cases.append({**base, "dropout": 0.0, "activations": "stored"})  # masks of nothing: they change the result
    return cases


def _bf16_cases() -> list[dict[str, Any]]:
    base = {"stages": 2, "n": 64, "gas": 3, "calls": 3, "grad_shrink": 0.5, "bf16": True}
    cases = [
        {**base, "weights": w, "activations": a, **extra}
        for (w, a), extra in ((("current", "stored"), {}), (("stashed", "recomputed"), {"zero": 1}))
    ]
    cases += [{**case, **BOTH} for case in cases]  # delta in fp32 beside bf16 weights
    cases.append({**cases[-1], **FIRST_STAGE})  # the last stage's delta too
    return cases


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[list[Any], list[Any]]]]:
    """The K = 2 training cases of three tests in one launch (Note [one launch, several calls] in
    dist_harness.py; each case seeds and builds its own engine): the launch's directory and, per test,
    (its cases, per rank the results of its cases)."""
    tmp = tmp_path_factory.mktemp("two_stages")
    groups = {"all_modes": _two_stages_all_modes(str(tmp / "flops.txt")), "dropout": _dropout_cases(),
              "bf16": _bf16_cases()}  # fmt: skip
    cases = [case for group in groups.values() for case in group]
    results = run_ranks(engine_workers.train, 2, tmp, cases, deadline_s=420)
    out, start = {}, 0
    for name, group in groups.items():
        out[name] = (group, [r[start : start + len(group)] for r in results])
        start += len(group)
    return tmp, out


def test_two_stages_all_modes_sgd_and_adam(two_stages) -> None:
    tmp, groups = two_stages
    cases, results = groups["all_modes"]
    check_against_reference(results, cases)
    assert "Profile Summary at step 4" in (tmp / "flops.txt").read_text()
    for rank in results:  # get_global_grad_norm(): the stage's own norm at its last step, as DeepSpeed reports
        for case, r in zip(cases, rank):
            assert r["grad_norm"] is not None and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, case


def test_recomputed_forward_draws_the_stored_forwards_dropout_masks(two_stages) -> None:
    """Dropout on stage 0: with the forward's weights (stashed), recomputing the activations at backward
    time must give the stored run's weights exactly -- the recomputed forward replays the RNG state
    (host and accelerator, through DeepSpeed's accelerator API) the first forward drew its masks from."""
    _, results = two_stages[1]["dropout"]
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
    # One tick per call: compared after every tick; the staleness metric against the reference's weights.
    cases = _cases(3, gas=1, calls=9, drain=True, staleness_every=2, check_staleness=True)
    cases += _corrected(3, gas=1, calls=9, drain=True)
    cases += [
        {"stages": 3, "n": 64, "gas": 2, "calls": 4, "wall_clock": True, "grad_shrink": 0.5, "drain": True},
        # accumulate 3: h = 4/3 and 2/3 steps, a partial accumulation stepped by the drain
        {"stages": 3, "n": 64, "gas": 2, "calls": 5, "accumulate": 3, "grad_shrink": 0.5, "drain": True, **BOTH},
        # a middle stage with a shared-memory link on each side
        *(
            {
                "stages": 3,
                "n": 64,
                "gas": 1,
                "calls": 9,
                "drain": True,
                "grad_shrink": 0.5,
                "weights": w,
                "activations": a,
                "transport": "process_group",
            }
            for w, a in (("current", "stored"), ("stashed", "recomputed"))
        ),  # fmt: skip
    ]
    cases += AUTO_THREE_STAGES + _ds_optimizers(3)
    results = run_ranks(engine_workers.train, 3, tmp_path, cases, deadline_s=300)
    check_against_reference(results, cases)


# corrections "auto" at K = 3 (Note [the auto rule]), against the reference given the keys the rule chooses: SGD
# with momentum lowers the delayed stages' momentum up to the peak lr (WarmupLR's max, 0.1, reached at tick 5);
# AdamW predicts to stage 0's update and raises beta1, with T = 2**62 ticks (no run length in WarmupLR or without);
# Muon (rule v2) predicts to stage 0's update.
AUTO_THREE_STAGES = [
    {"stages": 3, "n": 64, "gas": 1, "calls": 9, "drain": True, "corrections": "auto", "weights": "stashed",
     "warmup": 5, "lr": 0.1, "auto_chooses": {"delay_momentum": True, "delay_momentum_peak_lr": 0.1}},
    {"stages": 3, "n": 64, "gas": 1, "calls": 9, "drain": True, "corrections": "auto", "weights": "stashed",
     "optimizer": "adamw", "activations": "recomputed",
     "auto_chooses": {"predict_decay": 0.0, "predict_horizon": "first_stage", "delay_momentum_raise": 1.0,
                      "delay_lr_ticks": 2**62}},
    # rule v2: DeepSpeed's Muon predicts its forwards from its last applied update to stage 0's tick
    {"stages": 3, "n": 64, "gas": 2, "calls": 4, "drain": True, "corrections": "auto", "weights": "stashed",
     "ds_optimizer": "Muon", "activations": "stored",
     "auto_chooses": {"predict_decay": 0.0, "predict_horizon": "first_stage"}},
]  # fmt: skip


def _data_parallel_cases() -> list[dict[str, Any]]:
    base = {"stages": 2, "dp": 2, "n": 32, "gas": 3, "calls": 3, "drain": True, "grad_shrink": 0.5}
    cases = [
        {**base, "weights": w, "activations": a, "optimizer": opt}
        for w, a, opt in (("current", "stored", "sgd"), ("stashed", "recomputed", "adam"))
    ]
    cases += [{**base, "weights": "stashed", "activations": "stored", "accumulate": 2, **BOTH}]
    cases += [{**base, "weights": "stashed", "activations": "recomputed", "optimizer": "adam", **FIRST_STAGE}]
    cases += [{**base, "weights": "stashed", "activations": "stored", "optimizer": "adam", **RAISED}]
    cases += [{**base, "weights": "current", "activations": "stored", "transport": "process_group"}]
    # Muon's Newton-Schulz iteration multiplies a gradient's small singular values by up to 3.4445 ** 5 (about
    # 480): the toy's gradients are rank-deficient (micro-batches of 4 per replica, layers 8 wide), so the
    # rounding of the averaged gradient (DP all-reduce against the reference's one batch) in their null space
    # grows to about 1e-6 after a few steps in fp32: compared to 1e-5 there (tests/test_muon_lion.py: full rank,
    # 1e-6). In fp16, DeepSpeed's choice where the CPU has fp16 matmuls, it grows to a Muon step: both sides
    # pin fp32 (toy.newton_schulz_dtype).
    cases += [
        {**case, "tol": {"rtol": 1e-5, "atol": 1e-5}, "ns_dtype": "float32"} for case in _ds_optimizers(2, dp=2, n=32)
    ]
    return cases


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    """Data parallel 2 x pipeline 2 in one launch (Note [one launch, several calls] in dist_harness.py): the
    training cases' results per rank, then the steady-state collectives of TRACED's data-parallel case."""
    (trace_case,) = [_traced_case(extra) for extra in TRACED.values() if "dp" in extra]
    calls = [(engine_workers.train, (_data_parallel_cases(),)), (engine_workers.trace_collectives, (trace_case,))]
    trained, traces = run_ranks_calls(4, tmp_path_factory.mktemp("four_ranks"), calls, deadline_s=400)
    return trained, traces


def test_data_parallel_2_x_pipeline_2(four_ranks) -> None:
    cases, results = _data_parallel_cases(), four_ranks[0]
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
    # The staleness corrections change nothing at K = 1 (h = 0, tau = 1).
    case = {"stages": 1, "n": 16, "gas": 4, "calls": 3, "grad_shrink": 0.3, "weights": "stashed", **BOTH}
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
    # One launch: the stock runs first, loading nothing of fdg_schedule (beyond what the installed start-up
    # hook loads with DeepSpeed); then the same cases with `import fdg_schedule` and its deepspeed.initialize.
    cases = [{"stages": 2, "n": 32, "gas": 4, "calls": 3, "schedule": schedule} for schedule in (None, "1f1b")]
    calls = [(fdg_modules, ()), (engine_workers.train, (cases, False)), (fdg_modules, ()),
             (engine_workers.train, (cases, True))]  # fmt: skip
    before, stock, after_stock, imported = run_ranks_calls(2, tmp_path, calls, deadline_s=300)
    assert before == after_stock, "the stock runs loaded fdg_schedule modules"
    assert "fdg_schedule.runtime.engine" not in after_stock[0]
    for rank in range(2):
        for i in range(len(cases)):
            assert stock[rank][i]["engine"] == imported[rank][i]["engine"] == "PipelineEngine"
            assert stock[rank][i]["losses"] == imported[rank][i]["losses"]
            for a, b in zip(stock[rank][i]["states"], imported[rank][i]["states"]):
                for key in a:
                    assert torch.equal(a[key], b[key]), key


TRACED = {"fp32": {}, "bf16": {"bf16": True, "clip": 1.0}, "zero1": {"zero": 1, "clip": 1.0},
          "fp32-clip-dp2": {"clip": 1.0, "dp": 2}}  # fmt: skip


def _traced_case(extra: dict[str, Any]) -> dict[str, Any]:
    return {"stages": 2, "n": 64, "gas": 3, "calls": 4, "grad_shrink": 0.5, **extra}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The collectives of each TRACED case in steady state, and of stock 1F1B ("1f1b"): the K = 2 cases
    without data parallelism in one launch (Note [one launch, several calls] in dist_harness.py); the
    data-parallel one comes from the ``four_ranks`` launch."""
    names = [name for name, extra in TRACED.items() if "dp" not in extra]
    calls = [(_traced_case(TRACED[name]),) for name in names] + [({**_traced_case({}), "schedule": "1f1b"},)]
    results = run_ranks_each(engine_workers.trace_collectives, 2, tmp_path_factory.mktemp("traced"), calls,
                             deadline_s=300)  # fmt: skip
    return dict(zip([*names, "1f1b"], results))


@pytest.mark.parametrize("name", list(TRACED))
def test_no_collective_across_stages_in_steady_state(request, name: str) -> None:
    if "dp" in TRACED[name]:
        traces = request.getfixturevalue("four_ranks")[1]
    else:
        traces = request.getfixturevalue("traced")[name]
    for trace in traces:
        for op, ranks in trace["seen"]:
            assert set(ranks) <= set(trace["dp_group"]), f"stage {trace['stage_id']}: {op} over ranks {ranks}"
    if not TRACED[name]:
        # Note [gradient reduce with one data-parallel rank]: no collective at all, not even a one-rank reduce.
        assert all(trace["seen"] == [] for trace in traces), [trace["seen"] for trace in traces]
        # The tracer does see DeepSpeed's own cross-stage collectives under 1F1B.
        assert any(set(ranks) == {0, 1} for _, ranks in request.getfixturevalue("traced")["1f1b"][0]["seen"])


BAD = [
    ({"pipeline": {"schedule": "fdg", "fdg": {"grad_shrink": 2.0}}}, "grad_shrink must be in (0, 1], got 2.0"),
    ({"pipeline": {"schedule": "fdg", "fdg": {"stash": True}}}, "unknown key(s) ['stash']"),
    ({"pipeline": {"schedule": "fdg"}, "amp": {"enabled": True}}, "amp.enabled=true is not supported"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """engine_workers.bad_config for each BAD config, then for tied layers across stages (which builds), in
    one launch: every rank refuses a bad config before any rank waits on another. Results per call, by rank."""
    calls: list[tuple] = [
        ({"stages": 2, "config": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, **config}},)
        for config, _ in BAD
    ]
    calls.append(({"stages": 2, "config": {"train_micro_batch_size_per_gpu": 2, "pipeline": {"schedule": "fdg"}}},
                  True))  # fmt: skip
    return run_ranks_each(engine_workers.bad_config, 2, tmp_path_factory.mktemp("built"), calls, deadline_s=200)


@pytest.mark.parametrize("config,message", BAD)
def test_bad_config_fails_fast_on_every_rank(built, config: dict, message: str) -> None:
    results = built[[c for c, _ in BAD].index(config)]
    for r in results:
        assert r["error"] is not None and message in r["error"]


def test_tied_layers_across_stages_build_the_fdg_engine_on_every_rank(built) -> None:
    # Once refused; now trained (Note [tied layers across stages], tests/test_tied.py).
    for r in built[len(BAD)]:
        assert r["error"] is None


def test_bf16_and_zero1_follow_the_fp32_reference_closely(two_stages) -> None:
    """bf16 (DeepSpeed's BF16_Optimizer, fp32 master weights) and bf16 + ZeRO-1: the same FDG math,
    rounded: weights stay within bf16 precision of the fp32 reference."""
    cases, results = two_stages[1]["bf16"]
    for i, case in enumerate(cases):
        ref_states, _ = reference(case, results[0][i]["parts"])
        for r in results:
            assert r[i]["engine"] == "FDGPipelineEngine"
            assert r[i]["grad_norm"] is not None and r[i]["grad_norm"] > 0  # the wrapper's stage-local norm
            for key, value in r[i]["states"][-1].items():
                torch.testing.assert_close(value, ref_states[-1][key], rtol=0.05, atol=0.02, msg=f"{case} {key}")
        if "predict_decay" in case:  # the corrections did act: the pipeline is far nearer their reference
            plain_case = {k: v for k, v in case.items() if k not in BOTH and k not in FIRST_STAGE}
            plain, _ = reference(plain_case, results[0][i]["parts"])
            got = {k: v for r in results for k, v in r[i]["states"][-1].items()}
            near = max((got[k] - ref_states[-1][k]).abs().max().item() for k in got)
            far = max((got[k] - plain[-1][k]).abs().max().item() for k in got)
            assert near < far / 3, f"{case}: {near} from the corrected reference, {far} from the plain one"
