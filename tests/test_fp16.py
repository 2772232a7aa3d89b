"""fp16 under FDG: DeepSpeed's fp16 optimizers with a loss scale per stage, against the reference (real ranks, gloo).

Note [loss scale per stage] in fdg_schedule/precision/loss_scale.py is the rule, Note [fp16 in the reference] in
fdg_schedule/corrections/reference.py its statement in one process; docs/fdg-reference.md, "fp16 and the loss scale",
draws it.
DeepSpeed refuses fp16 on a CPU without fp16 kernels; the ranks allow it (Note [fp16 on this CPU] in
fp16_workers.py). Each launch trains several cases in turn (Note [one launch, several calls] in dist_harness.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import fp16_workers
import pytest
import torch
import toy
from dist_harness import run_ranks, run_ranks_calls

from fdg_schedule import FDGConfig, fdg_reference
from fdg_schedule.corrections.reference import FP16, ReferenceState
from fdg_schedule.observability import tracking
from fdg_schedule.sched import ticks

pytestmark = pytest.mark.distributed

EXACT = {"rtol": 0.0, "atol": 0.0}  # the same operations in the same order: bit for bit
# data parallelism sums the replicas' fp16 gradients where the reference takes one batch: fp16 roundings apart
FP16_TOL = {"rtol": 2e-3, "atol": 2e-3}
FUSED_TOL = {"rtol": 1e-6, "atol": 1e-6}  # DeepSpeed's FusedAdam (its CPU kernel) or clipping against torch's
# the dynamic scale moving within the test: first 2**8, raised every 3 clean steps; one overflow lowers it
DYNAMIC = {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 1}


def reference(case: dict[str, Any], parts: list[int]) -> dict[str, Any]:
    """The reference's fp16 weights and masters after each call, its losses, and its scales after each call."""
    ties: list[list[tuple[int, str]]] = []
    if case.get("tied"):  # the embedding on stage 0 tied to the head on the last (Note [tied layers under fp16])
        built = fp16_workers.tied_layers(case.get("inject"), spec=False)
        stages: list[torch.nn.Module] = [toy.TiedChain(built[a:b], a).half() for a, b in zip(parts[:-1], parts[1:])]
        ties = [[(0, "tied_modules.emb.weight"), (len(stages) - 1, "tied_modules.emb.weight")]]
    else:
        built = fp16_workers.layers(case.get("inject"), spec=False)
        stages = [toy.Chain(built[a:b], a).half() for a, b in zip(parts[:-1], parts[1:])]
    masters = [[p.detach().float().clone().requires_grad_() for p in s.parameters()] for s in stages]
    optimizer = fp16_workers.make_optimizer(case)
    if case.get("ds_optimizer"):
        optimizer = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731  (FusedAdam's math)
    opts = [optimizer(m) for m in masters]
    if not case.get("zero"):  # DeepSpeed's non-ZeRO fp16 optimizers step once on zero gradients when built
        for m, opt in zip(masters, opts):
            for t in m:
                t.grad = torch.zeros_like(t)
            opt.step()
            for t in m:
                t.grad = None
    gas, dp = case.get("gas", 1), case.get("dp", 1)
    fp16 = FP16(masters, **{k: case[k] for k in fp16_workers.FP16_KEYS if k in case})
    state = ReferenceState()
    snap_at = {(c + 1) * gas - 1 for c in range(case["calls"])}
    if case.get("drain"):
        snap_at.add(case["calls"] * gas + ticks.drain_ticks(len(stages)) - 1)
    out: dict[str, Any] = {"states": [], "masters": [], "scales": []}

    def after_tick(tick: int) -> None:
        if tick in snap_at:
            out["states"].append({k: v.float().clone() for s in stages for k, v in s.state_dict().items()})
            named = {n: m for s, ms in zip(stages, masters) for (n, _), m in zip(s.named_parameters(), ms)}
            out["masters"].append({n: m.detach().clone() for n, m in named.items()})
            tied_skips = sum(tie.skipped for tie in state.tied)  # every owner skips a tied step alike
            out["scales"].append([_ref_scale(r, tied_skips if k in (0, len(stages) - 1) else 0)
                                  for k, r in enumerate(state.fp16)])  # fmt: skip

    keys = {k: case[k] for k in fp16_workers.FDG_KEYS if k in case and k not in ("nonfinite", "timeout", "transport")}
    data = [(x, y) for x, y in fp16_workers.micro_batches(case["n"], 4 * dp)][: case["calls"] * gas]
    out["losses"] = fdg_reference(stages, opts, data, toy.loss_fn, FDGConfig(**keys), drain=case.get("drain", False),
                                  clip_grad_norm=case.get("clip", 0.0), after_tick=after_tick, state=state,
                                  fp16=fp16, ties=ties)  # fmt: skip
    out["state"] = state
    return out


def _ref_scale(r: Any, tied_skips: int = 0) -> dict[str, Any]:
    """A reference stage's scale view; ``skipped`` counts its steps and the tied steps skipped (as fdg_stats does)."""
    return {"step_scale": r.history[-1][0] if r.history else r.scale, "skipped": r.skipped + tied_skips,
            "cur_scale": r.scale, "stage_skipped": r.skipped}  # fmt: skip


def returned_losses(case: dict[str, Any], stage_id: int, stages: int, losses: list[float]) -> list[float]:
    """Stage k learns micro-batch b's loss at its backward of b, tick b + 2(K-1) - k (as tests/test_engine.py)."""
    gas = case.get("gas", 1)
    calls = [(c * gas, (c + 1) * gas) for c in range(case["calls"])]
    if case.get("drain"):
        calls.append((calls[-1][1], calls[-1][1] + ticks.drain_ticks(stages)))
    out = []
    for start, stop in calls:
        learned = [loss for b, loss in enumerate(losses) if start <= b + 2 * (stages - 1) - stage_id < stop]
        out.append(sum(learned) / len(learned) if learned else math.nan)
    return out


def check(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's fp16 weights, fp32 masters and returned losses after every call against the reference (``tol``),
    and its loss scales and skipped steps exactly; returns the references."""
    refs = []
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        ref = reference(case, per_rank[0]["parts"])
        refs.append(ref)
        tol = case.get("tol", EXACT)
        for r in per_rank:
            assert r["error"] is None, (case, r["error"])
            assert len(r["states"]) == len(ref["states"]) == len(r["masters"])
            for call in range(len(r["states"])):
                for got, want in ((r["states"][call], ref["states"][call]), (r["masters"][call], ref["masters"][call])):
                    for key, value in got.items():
                        message = f"{case} call {call} {key}"
                        torch.testing.assert_close(value, want[key], **tol, msg=lambda m, at=message: f"{at}: {m}")
            stages = len(r["parts"]) - 1
            want_losses = returned_losses(case, r["stage_id"], stages, ref["losses"])
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want_losses), equal_nan=True, **tol)
            for call, (got, want) in enumerate(zip(r["scales"], ref["scales"])):  # the scales exactly
                mine = want[r["stage_id"]]
                assert (got["step_scale"], got["skipped"], got["cur_scale"]) == (
                    mine["step_scale"],
                    mine["skipped"],
                    mine["cur_scale"],
                ), (case, call, r["stage_id"], got, mine)
                assert got["skipped_steps"] == mine["stage_skipped"]  # DeepSpeed's counter: the stage's own steps
    return refs


# -- K = 2 -------------------------------------------------------------------------------------------


def _k2_cases() -> list[dict[str, Any]]:
    base = {"stages": 2, "n": 40, "gas": 3, "calls": 5, "drain": True, "grad_shrink": 0.5, **DYNAMIC}
    return [
        # FP16_UnfusedOptimizer (a torch optimizer): SGD and Adam, each in two weights/activations modes
        {**base, "weights": "current", "activations": "stored"},
        {**base, "weights": "stashed", "activations": "recomputed", "optimizer": "adam"},
        # FP16_Optimizer (DeepSpeed's FusedAdam, flat fp32 masters)
        {**base, "ds_optimizer": "Adam", "weights": "stashed", "tol": FUSED_TOL},
        # ZeRO-1's fp16 optimizer
        {**base, "zero": 1, "weights": "current", "activations": "recomputed"},
        {**base, "zero": 1, "optimizer": "adam", "inject": {"a": {"at": [5]}}},
        # accumulate 2 with clipping: the scale fixed per group of 2; an overflow skips the group's step (DeepSpeed
        # clips by multiplying the scale, the reference after unscaling: a last bit apart)
        {**base, "accumulate": 2, "clip": 0.5, "optimizer": "adam", "inject": {"b": {"at": [6]}}, "tol": FUSED_TOL},
        # two consecutive overflows on stage 0 with hysteresis 2 (consecutive): the second lowers the scale
        {**base, "inject": {"a": {"at": [4, 5]}}, "hysteresis": 2, "consecutive_hysteresis": True},
        # a static scale: nothing moves; an overflow is skipped and counted
        {**base, "loss_scale": 128.0, "inject": {"b": {"at": [6]}}},
        # nonfinite "skip": an overflow at min_loss_scale is skipped and counted; a non-finite loss (stage 0's forward
        # of micro-batch 7 made NaN) skips its steps and lowers the scale
        {**base, "nonfinite": "skip", "min_loss_scale": 256, "inject": {"a": {"at": [3]}}},
        {**base, "nonfinite": "skip", "inject": {"a": {"forward_at": [7]}}},
        # the staleness corrections (delta in fp32, following the fp16 weights) and the process group (the other
        # cases run the default "auto": shared memory here)
        {**base, "weights": "stashed", "delay_lr_ticks": 8, "predict_decay": 0.5, "delay_momentum": True},
        {**base, "transport": "process_group", "inject": {"a": {"at": [4]}}},
    ]


K2_OPTIMIZERS = ["FP16_UnfusedOptimizer", "FP16_UnfusedOptimizer", "FP16_Optimizer", "DeepSpeedZeroOptimizer",
                 "DeepSpeedZeroOptimizer", *["FP16_UnfusedOptimizer"] * 7]  # fmt: skip
# Resumed at the tick after stage 0 overflowed (K = 2: its backward of micro-batch 4, tick 6): the lowered ceiling
# rides in the activation received for the next tick and a gradient made with the old scale is on its way back.
RESUME_K2 = [
    {"stages": 2, "n": 40, "calls_before": 7, "calls_after": 6, **DYNAMIC, "inject": {"a": {"at": [4]}}},
    {"stages": 2, "n": 40, "calls_before": 7, "calls_after": 6, **DYNAMIC, "inject": {"a": {"at": [4]}}, "zero": 1,
     "weights": "stashed", "activations": "recomputed"},
    # hysteresis 2: one overflow before the save uses one up, the next after it (tick 10) lowers the scale
    {"stages": 2, "n": 40, "calls_before": 7, "calls_after": 6, **DYNAMIC, "hysteresis": 2,
     "inject": {"a": {"at": [4, 8]}}},
    # part-way through an accumulation of 2 (the group's scale saved), FusedAdam's flat masters
    {"stages": 2, "n": 40, "gas": 3, "calls_before": 1, "calls_after": 3, "accumulate": 2, **DYNAMIC,
     "ds_optimizer": "Adam", "hysteresis": 2},
    # tied layers, accumulate 2: stage 0's tied copy overflowed at its backward of micro-batch 0 (tick 2), saved
    # before the step (tick 3) that must skip for it (the pending flag in FDG's file)
    {"stages": 2, "n": 40, "gas": 3, "calls_before": 1, "calls_after": 3, "accumulate": 2, **DYNAMIC, "tied": True,
     "optimizer": "adam", "inject": {"a": {"at": [0]}}},
]  # fmt: skip
# FDG (saved drained) -> 1F1B and 1F1B -> FDG, with DeepSpeed's unfused fp16 optimizer and with ZeRO-1's
SWAPS = [{"stages": 2, "n": 24, "gas": 2, "calls": 3, **DYNAMIC, **extra} for extra in ({}, {"zero": 1})]
# Note [tied layers under fp16]: an embedding on stage 0 tied to the head on stage 1 (fp16_workers.tied_layers);
# injector "a" overflows the embedding's gradient alone (the tied copy), "b" all of stage 0's
TIED_BASE = {"stages": 2, "n": 40, "gas": 3, "calls": 5, "drain": True, "grad_shrink": 0.5, "tied": True, **DYNAMIC}
TIED_K2 = [
    {**TIED_BASE, "inject": {"a": {"at": [4]}}},  # FP16_UnfusedOptimizer (SGD)
    {**TIED_BASE, "optimizer": "adam", "weights": "stashed", "activations": "recomputed", "inject": {"b": {"at": [6]}}},
    {**TIED_BASE, "ds_optimizer": "Adam", "tol": FUSED_TOL, "inject": {"a": {"at": [3]}}},  # FP16_Optimizer
    {**TIED_BASE, "zero": 1, "optimizer": "adam", "inject": {"a": {"at": [5]}}},  # ZeRO-1
    {**TIED_BASE, "accumulate": 2, "clip": 0.5, "tol": FUSED_TOL, "inject": {"a": {"at": [6]}}},
]
TIED_SWAP = {"stages": 2, "n": 24, "gas": 2, "calls": 3, "tied": True, **DYNAMIC}


@pytest.fixture(scope="module")
def k2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two launches of 2 ranks: the K = 2 training cases, the straight resume runs and the swaps' saves; then the
    resumed runs, the swaps' loads and the tied-layers refusal."""
    tmp = tmp_path_factory.mktemp("fp16_k2")
    root, dirs = (
        str(tmp / "ckpt"),
        {(i, s): str(tmp / f"swap{i}_{s}") for i in range(len(SWAPS)) for s in ("fdg", "1f1b")},
    )
    tied_dir = str(tmp / "tied_1f1b")
    first = [(fp16_workers.train, (_k2_cases(),)), (fp16_workers.resume, (RESUME_K2, root, "straight")),
             (fp16_workers.train, (TIED_K2,)),
             (fp16_workers.swap, ({**TIED_SWAP, "schedule": "1f1b"}, tied_dir, "save"))]  # fmt: skip
    first += [(fp16_workers.swap, ({**SWAPS[i], "schedule": s}, d, "save")) for (i, s), d in dirs.items()]
    trained, straight, tied, _, *saved = run_ranks_calls(2, tmp, first, deadline_s=500)
    loaded_as = {"fdg": "1f1b", "1f1b": "fdg"}
    second = [(fp16_workers.resume, (RESUME_K2, root, "resumed"))]
    second += [(fp16_workers.swap, ({**SWAPS[i], "schedule": loaded_as[s]}, d, "load")) for (i, s), d in dirs.items()]
    second += [(fp16_workers.load_refused, (TIED_SWAP, tied_dir))]
    resumed, *rest = run_ranks_calls(2, tmp, second, deadline_s=500)
    return {"trained": trained, "straight": straight, "resumed": resumed, "swaps": list(zip(dirs, saved, rest[:-1])),
            "tied": tied, "tied_refused": rest[-1]}  # fmt: skip


def test_two_stages_equal_the_reference(k2) -> None:
    cases = _k2_cases()
    check(k2["trained"], cases)
    for rank in k2["trained"]:  # the fp16 optimizers DeepSpeed built, and a scale that moved during the test
        assert [r["optimizer"] for r in rank] == K2_OPTIMIZERS
        assert max(s["cur_scale"] for s in rank[0]["scales"]) > 2**8
        # get_global_grad_norm(): the unscaled norm under the unfused optimizer (which reports it scaled) as under
        # ZeRO-1, on the same gradients (cases 0 and 3 train alike; ZeRO sums the squares less precisely: 1 %)
        unfused, zero = rank[0]["scales"], rank[3]["scales"]
        assert [s["grad_norm"] for s in unfused] == pytest.approx([s["grad_norm"] for s in zero], rel=0.02)
        assert all(0 < s["grad_norm"] < 10 for s in unfused)  # not times the scale (2**8 and more)
    skipped = {i: [r[i]["scales"][-1]["skipped"] for r in k2["trained"]] for i in range(len(cases))}
    assert skipped[6] == [2, 0]  # stage 0's two overflows; stage 1 had stepped on those micro-batches
    assert skipped[7] == [1, 0]  # the static scale skips, and stays
    assert {s["cur_scale"] for r in k2["trained"] for s in r[7]["scales"]} == {128.0}
    assert skipped[8] == [1, 0] and k2["trained"][0][8]["scales"][-1]["cur_scale"] >= 256  # at the minimum: skipped
    assert skipped[9][1] >= 1 and skipped[9][0] >= 1  # a NaN loss: every stage skips that micro-batch


def _k3_cases(wandb_dir: str) -> list[dict[str, Any]]:
    base = {"stages": 3, "n": 40, "gas": 1, "calls": 16, "drain": True, "grad_shrink": 0.5, **DYNAMIC}
    return [
        {**base, "weights": "stashed", "activations": "recomputed", "optimizer": "adam"},
        {**base, "zero": 1, "weights": "current", "activations": "stored"},
        # INJECTED: stage 1's backward of micro-batch 3 (tick 6) overflows, and through its input gradient stage 0's
        # of the same micro-batch (tick 7); stage 0's of micro-batch 9 (tick 13) alone; W&B logs every call
        {
            **base,
            "calls": 26,
            "loss_scale_window": 5,
            "inject": {"b": {"at": [3]}, "a": {"at": [9]}},
            "wandb": wandb_dir,
        },
        {**base, "gas": 2, "calls": 8, "accumulate": 2, "inject": {"a": {"at": [4]}}},
        *TIED_K3,
    ]


# K = 3 (uniform [0, 4, 7, 10]): "a" overflows stage 0's tied copy alone, "b" stage 1 and, through its input
# gradient, stage 0
TIED_K3 = [
    {"stages": 3, "n": 40, "gas": 1, "calls": 16, "drain": True, "grad_shrink": 0.5, **DYNAMIC, "tied": True,
     "optimizer": "adam", "inject": {"a": {"at": [5]}, "b": {"at": [9]}}},
    {"stages": 3, "n": 40, "gas": 2, "calls": 8, "drain": True, "grad_shrink": 0.5, **DYNAMIC, "tied": True,
     "accumulate": 2, "weights": "stashed", "inject": {"a": {"at": [4]}}},
]  # fmt: skip


INJECTED = 2
RESUME_K3 = [
    {"stages": 3, "n": 40, "calls_before": 7, "calls_after": 6, **DYNAMIC, "inject": {"b": {"at": [3]}}},
    {"stages": 3, "n": 40, "gas": 5, "calls_before": 1, "calls_after": 2, "accumulate": 2, **DYNAMIC, "zero": 1},
    # tied layers: the tied copy of stage 0 overflowed at its backward of micro-batch 3 (tick 7), saved at tick 7
    {"stages": 3, "n": 40, "calls_before": 8, "calls_after": 6, **DYNAMIC, "tied": True, "optimizer": "adam",
     "inject": {"a": {"at": [3]}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def k3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fp16_k3")
    root, cases = str(tmp / "ckpt"), _k3_cases(str(tmp))
    calls = [(fp16_workers.train, (cases,)), (fp16_workers.resume, (RESUME_K3, root, "straight"))]
    trained, straight = run_ranks_calls(3, tmp, calls, deadline_s=500)
    resumed = run_ranks(fp16_workers.resume, 3, tmp, RESUME_K3, root, "resumed", deadline_s=300)
    return {"tmp": tmp, "cases": cases, "trained": trained, "straight": straight, "resumed": resumed}


def test_three_stages_equal_the_reference(k3) -> None:
    check(k3["trained"], k3["cases"])


def test_an_injected_overflow_skips_lowers_reaches_the_loss_and_recovers(k3) -> None:
    """Docs/fdg.md's tick table, for real (one tick per call): stage 1 overflows at tick 6 and stage 0, which receives
    its inf input gradient, at tick 7; stage 0 alone at tick 13. Each lowered scale reaches the last stage's loss
    K - 1 - k ticks later; stage 0's scale grows back after its window and the loss gets it two hops later. W&B's
    fdg/loss_scale and fdg/skipped show it per stage, call by call."""
    by_stage = {r[INJECTED]["stage_id"]: r[INJECTED]["scales"] for r in k3["trained"]}
    skipped = {k: [s["skipped"] for s in scales] for k, scales in by_stage.items()}
    assert skipped[1][5:8] == [0, 1, 1] and skipped[0][6:8] == [0, 1]  # the skips, at ticks 6 and 7
    assert skipped[0][12:14] == [1, 2] and skipped[1][-1] == 1 and skipped[2][-1] == 0
    sigma = by_stage[1][6]["step_scale"]  # what stage 1's overflowing gradient was made with
    assert by_stage[1][6]["cur_scale"] == sigma / 2
    loss_scale = [s["step_scale"] for s in by_stage[2]]  # the scale of the last stage's loss, tick by tick
    assert loss_scale[6:8] == [sigma, sigma / 2]  # from stage 1: one hop
    assert loss_scale[14:16] == [sigma / 2, sigma / 4]  # from stage 0 at tick 13: two hops
    # stage 0: lowered at tick 13; the gradients made before reach it at ticks 14-16 (late, not counted); counted from
    # tick 17, its window of 5 ends at its 6th counted step, tick 22: 2 * sigma/4; the loss gets it at tick 24
    scale_0 = [s["cur_scale"] for s in by_stage[0]]
    assert scale_0[13:22] == [sigma / 4] * 9 and scale_0[22] == sigma / 2
    assert loss_scale[23:25] == [sigma / 4, sigma / 2]
    wandb = sorted((k3["tmp"] / "wandb").glob("offline-run-*"))
    runs = {run["name"]: run for run in map(tracking.read_offline_run, wandb)}
    for stage, scales in by_stage.items():
        rows = [row for row in runs[f"stage{stage}-dp0"]["history"] if "fdg/loss_scale" in row]
        assert [row["fdg/loss_scale"] for row in rows] == [s["step_scale"] for s in scales]
        assert [row["fdg/skipped"] for row in rows] == [s["skipped"] for s in scales]


def _check_resumed(straight: list[Any], resumed: list[Any], cases: list[dict[str, Any]]) -> None:
    """Bit for bit: losses, fp16 weights, fp32 masters, the scale state (scale, counters, skipped_steps) each call."""
    for rank in range(len(straight)):
        for i, case in enumerate(cases):
            a, b = straight[rank][i], resumed[rank][i]
            assert a["at_save"]["cur_scale"] == b["at_save"]["cur_scale"], case
            assert a["losses"] == pytest.approx(b["losses"], rel=0, abs=0, nan_ok=True), case
            # fdg_stats["skipped"] counts this process's skips; DeepSpeed's skipped_steps is in its checkpoint
            drop = lambda scales: [{k: v for k, v in s.items() if k != "skipped"} for s in scales]  # noqa: E731
            assert drop(a["scales"]) == drop(b["scales"]), (case, rank)
            for key in a["state"]:
                assert torch.equal(a["state"][key], b["state"][key]), (case, rank, key)
                assert torch.equal(a["masters"][key], b["masters"][key]), (case, rank, key)


def test_resume_is_bit_identical_with_scales_in_flight(k2, k3) -> None:
    _check_resumed(k2["straight"], k2["resumed"], RESUME_K2)
    _check_resumed(k3["straight"], k3["resumed"], RESUME_K3)
    at_save = {r[0]["stage_id"]: r[0]["at_save"] for r in k2["straight"]}
    assert at_save[0]["cur_scale"] < at_save[1]["cur_scale"] and at_save[0]["skipped_steps"] == 1  # right after it
    stage_0 = next(r[2] for r in k2["resumed"] if r[2]["stage_id"] == 0)  # hysteresis 2: one used at the save
    assert stage_0["at_save"]["cur_hysteresis"] == 1 and stage_0["scales"][-1]["skipped_steps"] == 2


def test_fdg_and_1f1b_swap_keeping_the_fp16_optimizer_state(k2) -> None:
    """A drained FDG checkpoint into 1F1B and a 1F1B checkpoint into FDG: fp16 weights, fp32 masters and the wrapped
    optimizer's state exactly; 1F1B gets the scale of the last step (window afresh), FDG gets 1F1B's scale and
    counters (Note [the scale in DeepSpeed's files])."""
    for (_, saved_with), saves, loads in k2["swaps"]:
        for s, lo in zip(saves, loads):
            for key in s["state"]:
                assert torch.equal(s["state"][key], lo["state"][key]) and torch.equal(
                    s["masters"][key], lo["masters"][key]
                )
            assert len(s["optim"]) == len(lo["optim"])
            for a, b in zip(s["optim"], lo["optim"]):
                assert a.keys() == b.keys() and all(
                    torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a
                )
            if saved_with == "fdg":
                assert lo["engine"] == "PipelineEngine" and lo["fdg_scale"] is None
                ds = lo["deepspeed_scale"]
                assert ds["cur_scale"] == s["fdg_scale"]["step_scale"] and ds["cur_iter"] == 0
                assert ds["last_overflow_iter"] == -1
            else:
                assert lo["engine"] == "FDGPipelineEngine"
                ds, mine = s["deepspeed_scale"], lo["fdg_scale"]
                assert (mine["cur_scale"], mine["cur_iter"], mine["last_overflow_iter"]) == (
                    ds["cur_scale"], ds["cur_iter"], ds["last_overflow_iter"])  # fmt: skip
        if saved_with == "fdg":  # drained: every stage's last step was of the same micro-batches, at one scale
            assert len({s["fdg_scale"]["step_scale"] for s in saves}) == 1


def _copies_equal(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    """The tied copies (stage 0's embedding, the last stage's head) are torch.equal after every call, weights and
    fp32 masters."""
    name = "tied_modules.emb.weight"
    for i, case in enumerate(cases):
        owners = [r[i] for r in results if name in r[i]["states"][0]]
        assert len(owners) == 2 * case.get("dp", 1), case
        for call in range(len(owners[0]["states"])):
            for what in ("states", "masters"):
                copies = [r[what][call][name] for r in owners]
                assert all(torch.equal(copies[0], c) for c in copies), (case, call, what)


def test_fp16_with_layers_tied_across_stages_equals_the_reference(k2, k3) -> None:
    """Note [tied layers under fp16]: each owner's contribution unscaled by its own scale; an overflow of the tied
    copy's gradient alone (injector "a") skips its stage's step and lowers its scale, and skips the tied step on every
    owner (counted in fdg_stats["skipped"], not in DeepSpeed's skipped_steps)."""
    check(k2["tied"], TIED_K2)
    _copies_equal(k2["tied"], TIED_K2)
    tied_k3 = k3["cases"][-len(TIED_K3) :]
    check([r[-len(TIED_K3) :] for r in k3["trained"]], tied_k3)
    _copies_equal([r[-len(TIED_K3) :] for r in k3["trained"]], tied_k3)
    for rank in k2["tied"]:
        assert [r["optimizer"] for r in rank] == ["FP16_UnfusedOptimizer", "FP16_UnfusedOptimizer", "FP16_Optimizer",
                                                  "DeepSpeedZeroOptimizer", "FP16_UnfusedOptimizer"]  # fmt: skip
    stage_0 = next(r[0] for r in k2["tied"] if r[0]["stage_id"] == 0)
    last = next(r[0] for r in k2["tied"] if r[0]["stage_id"] == 1)
    # case 0: only the embedding's gradient overflowed (backward 4 of stage 0, tick 6): stage 0's step skipped and its
    # scale halved; the tied step skipped on both owners; stage 1's own steps untouched
    assert stage_0["scales"][-1]["skipped_steps"] == 1 and stage_0["scales"][-1]["skipped"] == 2
    assert last["scales"][-1]["skipped_steps"] == 0 and last["scales"][-1]["skipped"] == 1
    assert min(s["cur_scale"] for s in stage_0["scales"]) < 2**8
    # 1F1B's fp16 optimizer file holds the tied copies, which FDG's fp16 optimizers do not: refused, naming the fix
    for error in k2["tied_refused"]:
        assert error is not None and "has no FDG state (a 1F1B checkpoint?)" in error, error
        assert "load_optimizer_states=False" in error


def _dp_cases() -> list[dict[str, Any]]:
    base = {"stages": 2, "dp": 2, "n": 24, "gas": 3, "calls": 4, "drain": True, "grad_shrink": 0.5, **DYNAMIC,
            "tol": FP16_TOL}  # fmt: skip
    return [
        {**base, "weights": "stashed", "activations": "recomputed"},
        {**base, "zero": 1, "optimizer": "adam"},
        # an overflow on one replica of stage 0 only (global rank 1): the all-reduced gradient overflows on both
        {**base, "inject": {"b": {"at": [4], "ranks": [1]}}},
        # tied layers: the tied copy's gradient overflows on one replica of stage 0 only (global rank 0): its
        # all-reduced contribution overflows on both, both replicas skip (Note [tied layers under fp16])
        {**base, "tied": True, "optimizer": "adam", "inject": {"a": {"at": [4], "ranks": [0]}}},
    ]


def test_data_parallel_2_x_pipeline_2_equals_the_reference(tmp_path: Path) -> None:
    cases = _dp_cases()
    results = run_ranks(fp16_workers.train, 4, tmp_path, cases, deadline_s=400)
    check(results, cases)
    for i in range(len(cases)):  # a stage's replicas hold the same weights and took the same steps
        by_stage: dict[int, list[Any]] = {}
        for r in results:
            by_stage.setdefault(r[i]["stage_id"], []).append(r[i])
        for a, b in by_stage.values():
            assert a["scales"] == b["scales"]
            assert all(torch.equal(a["states"][-1][k], b["states"][-1][k]) for k in a["states"][-1])
    assert [r[2]["scales"][-1]["skipped"] for r in results] == [1, 1, 0, 0]
    _copies_equal([r[3:] for r in results], cases[3:])
    assert [r[3]["scales"][-1]["skipped_steps"] for r in results] == [1, 1, 0, 0]  # the tied copy's overflow


ERRORS = [
    # nonfinite "error": an overflow at min_loss_scale (here the first scale) cannot be cured by the scale
    ({**DYNAMIC, "min_loss_scale": 256, "inject": {"a": {"at": [2]}}},
     "stage 0 (global rank 0): non-finite gradient at the minimum loss scale 256 (fp16.min_loss_scale) at tick 2; "
     'lower the learning rate or set pipeline.fdg.nonfinite="skip"'),
    ({**DYNAMIC, "min_loss_scale": 256, "inject": {"a": {"at": [2]}}, "nonfinite": "skip"}, None),
    # an overflow above the minimum is the scale's business under "error" too
    ({**DYNAMIC, "inject": {"a": {"at": [2]}}}, None),
    # a non-finite loss still stops the run under "error", at the end of the call
    ({**DYNAMIC, "inject": {"a": {"forward_at": [2]}}}, "non-finite loss of micro-batch 2"),
    # fp32 inputs into an fp16 job
    ({"fp32_inputs": True},
     "micro-batch 0 has floating inputs of dtype torch.float32 but fp16.enabled is true; convert the inputs to "
     "torch.float16 in the data pipeline"),
]  # fmt: skip


def test_nonfinite_with_fp16_and_bad_inputs(tmp_path: Path) -> None:
    (errors,) = run_ranks(fp16_workers.errors, 1, tmp_path, [case for case, _ in ERRORS], deadline_s=300)
    for (case, message), error in zip(ERRORS, errors):
        if message is None:
            assert error is None, (case, error)
        else:
            assert error is not None and message in error, (case, error)
