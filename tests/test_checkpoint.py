"""Checkpoints: exact resume of in-flight FDG work, schedule swaps, re-partitioning (real DeepSpeed, gloo).

The K = 2 resume cases of three tests and the schedule swaps share two launches (the straight runs and the
saves, then the resumed runs and the loads); the K = 3 resumes and the load into three stages two more
(Note [one launch, several calls] in dist_harness.py).
"""

from __future__ import annotations

from typing import Any

import engine_workers
import pytest
import torch
from dist_harness import run_ranks, run_ranks_calls

pytestmark = pytest.mark.distributed

MODES = [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]
# The staleness corrections mid-ramp at the save (tick 6 of 20): delta and the tick count are saved.
CORRECTIONS = {"delay_lr_ticks": 20, "predict_decay": 0.5, "delay_momentum": True, "delay_momentum_peak_lr": 0.2}
# the prediction's reach (Note [the prediction's reach]): half the horizon, discounted by a momentum
PREDICTION_KEYS = {"predict_decay": 0.0, "predict_scale": 0.5, "predict_momentum": 0.9,
                   "predict_horizon": "first_stage"}  # fmt: skip


def _straight_and_resumed(tmp_path, world: int, cases: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """Run ``cases`` straight through, then resumed in new processes: per rank, each case's result."""
    root = str(tmp_path / "ckpt")
    straight = run_ranks(engine_workers.resume, world, tmp_path, cases, root, "straight", deadline_s=300)
    resumed = run_ranks(engine_workers.resume, world, tmp_path, cases, root, "resumed", deadline_s=300)
    return straight, resumed


def _check_bit_identical(straight: list[Any], resumed: list[Any], cases: list[dict[str, Any]]) -> None:
    """The straight and the resumed run agree bit for bit: steps, the end of the data, losses, weights."""
    for rank in range(len(straight)):
        for i, case in enumerate(cases):
            a, b = straight[rank][i], resumed[rank][i]
            assert a["global_steps"] == b["global_steps"]
            assert a["exhausted"] == b["exhausted"], case
            assert a["losses"] == pytest.approx(b["losses"], rel=0, abs=0, nan_ok=True), case
            for key in a["state"]:
                assert torch.equal(a["state"][key], b["state"][key]), f"{case} rank {rank} {key}"


def _resume_checked(tmp_path, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    straight, resumed = _straight_and_resumed(tmp_path, world, cases)
    _check_bit_identical(straight, resumed, cases)
    return resumed


def _k2_every_mode() -> list[dict[str, Any]]:
    base = {"stages": 2, "n": 48, "gas": 3, "calls_before": 2, "calls_after": 2}
    cases = [
        {**base, "grad_shrink": 0.5, "weights": w, "activations": a, "optimizer": opt, **CORRECTIONS}
        for (w, a), opt in zip(MODES, ("sgd", "adam", "adam", "sgd"))
    ]
    cases += [
        # data through deepspeed.initialize(training_data=...): the engine's own loader continues
        {**base, "training_data": True},
        # a drained checkpoint resumes too (the pipeline refills; t and delta go on)
        {**base, "drain_save": True, "zero": 1, **CORRECTIONS},
        # the last stage's delta too (predict_horizon "first_stage"), mid-flight
        {**base, "weights": "stashed", "optimizer": "adam", **CORRECTIONS, "predict_horizon": "first_stage"},
        # the process group, not the default shared-memory transport (whose new processes set up new links at
        # their first exchange: the cases above)
        {**base, "grad_shrink": 0.5, "weights": "stashed", "activations": "recomputed", "transport": "process_group"},
        {**base, "drain_save": True, "transport": "process_group"},
        # DeepSpeed's FusedAdam (an "Adam" config), resumed at a step whose beta**t it rounded otherwise before
        # Note [FusedAdam's step on the CPU]
        {**base, "grad_shrink": 0.5, "ds_optimizer": "Adam", "gas": 4, "calls_before": 1},
        # the last applied update over half the horizon with the momentum look-ahead (Note [the prediction's reach])
        {**base, "weights": "stashed", "optimizer": "adam", **PREDICTION_KEYS},
        # corrections "auto" (AdamW, K = 2: the look-ahead's delta and the raised beta1), its choice in the file
        {**base, "corrections": "auto", "optimizer": "adamw", "weights": "stashed"},
    ]
    return cases


def _k2_mid_accumulation() -> list[dict[str, Any]]:
    # Undrained saves part-way through an accumulation (Note [a partial accumulation in a checkpoint]).
    # After T ticks stage 0 has back-propagated T-2 micro-batches, stage 1 T-1; each case's comment
    # says how many passes each stage holds towards its next step at the save.
    base = {"stages": 2, "n": 48, "calls_after": 2, "grad_shrink": 0.5}
    t3, t4, t5 = {"gas": 3, "calls_before": 1}, {"gas": 2, "calls_before": 2}, {"gas": 5, "calls_before": 1}
    return [
        {**base, **t3, "accumulate": 2, "weights": "stashed", "optimizer": "adam"},  # 1, 0
        {**base, **t4, "accumulate": 2, "bf16": True},  # 0, 1
        {**base, **t4, "accumulate": 3, "activations": "recomputed"},  # 2, 0
        {**base, **t5, "accumulate": 3, "zero": 1, "optimizer": "adam"},  # 0, 1
        {**base, **t3, "accumulate": 2, "bf16": True, "zero": 1},  # 1, 0
        {**base, **t4, "bf16": True},
        # a model that draws random numbers in its forward, in both activation modes
        {**base, **t3, "dropout": 0.3},
        {**base, **t3, "dropout": 0.3, "activations": "recomputed", "weights": "stashed"},
    ]


def _k2_data_ended() -> list[dict[str, Any]]:
    # 5 micro-batches, 2 ticks per call: stage 0 learns the end at tick 5 (in the 3rd call), stage 1 at
    # tick 6 (Note [end of data]). Saved in between, the resumed run ends with DataExhausted as the
    # uninterrupted one does; a drained save after the end is written too.
    ended = {"stages": 2, "n": 48, "gas": 2, "calls_before": 3, "calls_after": 2, "limit": 5}
    return [{**ended, "module_only_first": True}, {**ended, "drain_save": True}]


K2_RESUMES = {"every_mode": _k2_every_mode(), "mid_accumulation": _k2_mid_accumulation(),
              "data_ended": _k2_data_ended()}  # fmt: skip


SWAP_CASE = {"stages": 2, "n": 32, "gas": 2, **CORRECTIONS}  # the corrections are ignored by 1F1B
# (saved with, loaded as): Note [what a layout change keeps]: the same stages in other modes drop the in-flight
# work but continue t and delta.
SWAPS = [("fdg", {**SWAP_CASE, "schedule": "1f1b"}), ("1f1b", {**SWAP_CASE, "schedule": "fdg"}),
         ("fdg", {**SWAP_CASE, "weights": "stashed", "activations": "recomputed"})]  # fmt: skip


@pytest.fixture(scope="module")
def k2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every K = 2 resume case straight through, and SWAP_CASE trained 2 calls and saved under FDG and under
    1F1B, in one launch; then the resumed runs and the loads of SWAPS in another (per rank, results).

    Returns "resumes" (per group of K2_RESUMES, (straight, resumed)), "saved" (per schedule, (its directory,
    the saves' results)) and "loaded" (per swap, the results).
    """
    tmp = tmp_path_factory.mktemp("k2")
    cases, root = [case for group in K2_RESUMES.values() for case in group], str(tmp / "ckpt")
    dirs = {schedule: str(tmp / schedule) for schedule in ("fdg", "1f1b")}
    first = [(engine_workers.resume, (cases, root, "straight"))]
    first += [(engine_workers.swap, ({**SWAP_CASE, "schedule": s}, dirs[s], "save")) for s in dirs]
    straight, *saves = run_ranks_calls(2, tmp, first, deadline_s=400)
    second = [(engine_workers.resume, (cases, root, "resumed"))]
    second += [(engine_workers.swap, (case, dirs[saved_with], "load")) for saved_with, case in SWAPS]
    resumed, *loaded = run_ranks_calls(2, tmp, second, deadline_s=400)
    out: dict[str, Any] = {"resumes": {}, "saved": dict(zip(dirs, zip(dirs.values(), saves))), "loaded": loaded}
    start = 0
    for name, group in K2_RESUMES.items():
        part = slice(start, start + len(group))
        out["resumes"][name] = ([r[part] for r in straight], [r[part] for r in resumed])
        start += len(group)
    return out


def test_resume_is_bit_identical_two_stages_every_mode(k2) -> None:
    _check_bit_identical(*k2["resumes"]["every_mode"], K2_RESUMES["every_mode"])


def _k3_resumes() -> list[dict[str, Any]]:
    base = {"stages": 3, "n": 48, "gas": 2, "calls_before": 3, "calls_after": 2, "grad_shrink": 0.5}
    cases = [{**base, "weights": w, "activations": a, **(CORRECTIONS if w == "stashed" else {})} for w, a in MODES]
    # part-way through an accumulation: after T ticks stage k has back-propagated T-4+k micro-batches
    cases += [
        {**base, "gas": 5, "calls_before": 1, "accumulate": 2},  # T=5: 1, 0, 1 passes towards a step
        {**base, "gas": 7, "calls_before": 1, "calls_after": 1, "accumulate": 3, "weights": "stashed"},  # 0, 1, 2
        {**base, "weights": "current", "activations": "stored", "transport": "process_group"},
        {**base, "weights": "current", "activations": "recomputed", "optimizer": "adam", **PREDICTION_KEYS},
    ]
    return cases


@pytest.fixture(scope="module")
def k3(tmp_path_factory: pytest.TempPathFactory, k2: dict[str, Any]) -> dict[str, Any]:
    """The K = 3 resume cases straight through in one launch; then resumed, and K = 2's FDG save loaded into
    three stages, in another. Returns "straight", "resumed" (per rank, per case) and "loaded" (per rank)."""
    tmp = tmp_path_factory.mktemp("k3")
    cases, root = _k3_resumes(), str(tmp / "ckpt")
    straight = run_ranks(engine_workers.resume, 3, tmp, cases, root, "straight", deadline_s=300)
    calls = [(engine_workers.resume, (cases, root, "resumed")),
             (engine_workers.swap, ({**SWAP_CASE, "stages": 3}, k2["saved"]["fdg"][0], "load"))]  # fmt: skip
    resumed, loaded = run_ranks_calls(3, tmp, calls, deadline_s=400)
    return {"straight": straight, "resumed": resumed, "loaded": loaded}


def test_resume_is_bit_identical_three_stages_every_mode(k3) -> None:
    _check_bit_identical(k3["straight"], k3["resumed"], _k3_resumes())


def test_resume_is_bit_identical_mid_accumulation_in_bf16_zero1_and_with_dropout(k2) -> None:
    _check_bit_identical(*k2["resumes"]["mid_accumulation"], K2_RESUMES["mid_accumulation"])


def test_resume_after_the_data_ended_on_one_stage_and_weights_only_loads(k2) -> None:
    straight, resumed = k2["resumes"]["data_ended"]
    _check_bit_identical(straight, resumed, K2_RESUMES["data_ended"])
    for rank in resumed:
        assert rank[0]["exhausted"] and rank[1]["exhausted"]
        weights_only = rank[0]["module_only"]  # load_module_only=True: the weights and nothing else
        assert weights_only["in_flight"] == 0 and weights_only["read"] == 0 and weights_only["rng_kept"]
        for key, value in weights_only["state"].items():
            assert torch.equal(value, weights_only["full_state"][key]), key


def test_resume_is_bit_identical_with_data_parallelism(tmp_path) -> None:
    cases = [{"stages": 2, "n": 32, "gas": 2, "calls_before": 2, "calls_after": 2, "weights": "stashed",
              "activations": "stored", "optimizer": "adam", **CORRECTIONS}]  # fmt: skip
    _resume_checked(tmp_path, 4, cases)


def test_fdg_and_1f1b_checkpoints_load_into_each_other(k2) -> None:
    saved, loaded = k2["saved"], k2["loaded"]
    for (saved_with, case), ranks in zip(SWAPS[:2], loaded):
        loaded_with = case["schedule"]
        for s, lo in zip(saved[saved_with][1], ranks):
            assert lo["error"] is None
            assert lo["engine"] == ("FDGPipelineEngine" if loaded_with == "fdg" else "PipelineEngine")
            for key in s["state"]:
                assert torch.equal(s["state"][key], lo["state"][key])
            if loaded_with == "fdg":  # a 1F1B checkpoint has no FDG state: t and delta start at 0
                assert lo["tick"] == 0
                assert lo["delta"] is None or all(not d.any() for d in lo["delta"])
    for s, lo in zip(saved["fdg"][1], loaded[2]):  # other modes: t and delta go on
        assert lo["error"] is None and lo["tick"] == s["tick"] == 4
        assert (s["delta"] is None) == (lo["stage_id"] == 1)  # the last stage predicts nothing
        if s["delta"] is not None:
            assert any(d.any() for d in s["delta"])
            assert all(torch.equal(a, b) for a, b in zip(s["delta"], lo["delta"]))


def test_fdg_checkpoint_loads_into_another_number_of_stages(k2, k3) -> None:
    full = {k: v for s in k2["saved"]["fdg"][1] for k, v in s["state"].items()}
    for lo in k3["loaded"]:
        assert "has 2 pipeline stages, this job 3" in lo["error"]
        assert "load_optimizer_states=False" in lo["error"]
        for key, value in lo["state"].items():  # weights re-partitioned by layer
            assert torch.equal(value, full[key]), key
        assert lo["tick"] == 4  # t goes on; delta belongs to another partition and starts at 0
        assert lo["delta"] is None or all(not d.any() for d in lo["delta"])


def test_an_interrupted_save_leaves_latest_on_the_last_complete_checkpoint(tmp_path) -> None:
    save_dir = tmp_path / "ckpt"
    stage0, _ = run_ranks(engine_workers.interrupted_save, 2, tmp_path, str(save_dir), deadline_s=200,
                          expect_exit={1: 5})  # fmt: skip
    assert stage0["error"] is not None  # rank 0 learns its peer died instead of finishing the save
    assert (save_dir / "latest").read_text() == "first"
    assert (save_dir / "second").exists()  # the partial checkpoint is there, but nothing points at it
