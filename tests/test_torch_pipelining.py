"""ScheduleFDG (torch.distributed.pipelining) on real gloo ranks against fdg_reference, tick by tick, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch_pp_workers as workers
from dist_harness import run_ranks, run_ranks_each

from fdg_schedule import FDGConfig, FDGConfigError, fdg_reference
from fdg_schedule.corrections.reference import ReferenceState
from fdg_schedule.torch_pipelining import arguments

pytestmark = pytest.mark.distributed
MODES = [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]
EXACT = {"rtol": 0.0, "atol": 0.0}


def reference(case: dict[str, Any], K: int) -> dict[str, Any]:
    """What fdg_reference computes for ``case``'s calls (one reference call per segment, the state carried):
    every stage's state after every tick, and the losses."""
    stages = workers.stages(K, case.get("seed", 0))
    if case.get("scaled"):
        stages = [workers.ScaledInTurn(s, workers.scales(case)) for s in stages]
    opts = [workers.make_optimizer(case.get("optimizer", "sgd"), s.parameters()) for s in stages]
    schedulers = []
    if case.get("scheduler"):
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    states: list[list[dict[str, torch.Tensor]]] = []
    after = lambda tick: states.append([workers._state(s) for s in stages])  # noqa: E731
    calls = workers.plan(case)
    data = workers.micro_batches(sum(c == "step" for c in calls) * case["n"], case.get("data_seed", 1))
    config, carried, losses = FDGConfig(**case.get("fdg", {})), ReferenceState(), []
    segment: list[Any] = []
    for what in calls + ["end"]:
        if what == "step":
            segment += data[: case["n"]]
            data = data[case["n"] :]
            continue
        if segment:
            losses += fdg_reference(
                stages, opts, segment, F.cross_entropy, config, drain=what == "drain", schedulers=schedulers,
                clip_grad_norm=case.get("clip", 0.0), after_tick=after, state=carried,
            )  # fmt: skip
        segment = []
    return {"states": states, "losses": losses}


def check_equal(results: list[dict[str, Any]], want: dict[str, Any], tol: dict[str, float] = EXACT) -> None:
    ticks = len(want["states"])
    for r in results:
        k = r["stage"]
        assert len(r["states"]) == ticks, (k, len(r["states"]), ticks)
        for tick, (got, ref) in enumerate(zip(r["states"], want["states"])):
            for key, value in ref[k].items():
                where = f"stage {k} tick {tick} {key}"
                torch.testing.assert_close(got[key], value, **tol, msg=lambda m, where=where: f"{where}: {m}")
    last = [r for r in results if r["stage"] == max(x["stage"] for x in results)]
    for r in last:
        got = [v for call in r["losses"] for v in call]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want["losses"]), **tol)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("weights,activations", MODES)
def test_equals_the_reference_bit_for_bit(tmp_path, K: int, weights: str, activations: str, accumulate: int) -> None:
    """Three step() calls of three micro-batches (carried over from call to call), then drain(); with accumulate 2
    the drain steps a partial accumulation."""
    fdg = {"grad_shrink": 0.5, "weights": weights, "activations": activations, "accumulate": accumulate}
    case = {"n": 3, "calls": 3, "fdg": fdg}
    results = run_ranks(workers.train, K, tmp_path, case, deadline_s=240)
    check_equal(results, reference(case, K))


@pytest.mark.parametrize(
    "case",
    [
        # the explicit corrections with SGD-momentum, an lr scheduler and clipping, K = 3
        {
            "n": 4,
            "calls": 2,
            "scheduler": True,
            "clip": 0.5,
            "fdg": {"grad_shrink": 0.7, "delay_lr_ticks": 5, "predict_decay": 0.5, "delay_momentum": True},
        },
        # "auto" with Adam: prediction aimed at stage 0 (the last stage predicts too), the momentum raise, delay lr
        {"n": 4, "calls": 2, "optimizer": "adam", "fdg": {"corrections": "auto", "weights": "stashed"}},
        {"n": 4, "calls": 2, "optimizer": "adam", "fdg": {"corrections": "auto", "accumulate": 2}},
        {"n": 2, "calls": 3, "optimizer": "adam", "fdg": {"corrections": "auto", "activations": "recomputed"}},
    ],
    ids=["explicit-sgd", "auto-adam-stashed", "auto-adam-accumulate", "auto-adam-recomputed"],
)
@pytest.mark.parametrize("K", [2, 3])
def test_corrections_equal_the_reference_bit_for_bit(tmp_path, K: int, case: dict[str, Any]) -> None:
    results = run_ranks(workers.train, K, tmp_path, case, deadline_s=240)
    check_equal(results, reference(case, K))


@pytest.mark.parametrize("K", [2, 3])
def test_micro_batches_carry_over_between_calls_and_drains(tmp_path, K: int) -> None:
    """Segments: two calls, a drain, one call, a drain, two calls left in flight (no drain at the end)."""
    plan = ["step", "step", "drain", "step", "drain", "step", "step"]
    case = {"n": 2, "plan": plan, "fdg": {"grad_shrink": 0.5, "accumulate": 2}}
    results = run_ranks(workers.train, K, tmp_path, case, deadline_s=240)
    check_equal(results, reference(case, K))
    for r in results:  # stage k forwarded micro-batches 0 .. 3-k of the last segment, back-propagated those delay older
        k = r["stage"]
        assert r["in_flight"] == list(range(max(0, 4 - k - 2 * (K - 1 - k)), 4 - k)), (k, r["in_flight"])
    last = next(r for r in results if r["stage"] == K - 1)
    assert [len(x) for x in last["losses"]] == [2 - (K - 1), 2, K - 1, 2 - (K - 1), K - 1, 2 - (K - 1), 2]


@pytest.mark.parametrize("weights", ["current", "stashed"])
def test_keyword_inputs_of_later_stages_follow_their_micro_batches(tmp_path, weights: str) -> None:
    """Every stage gets a keyword input per micro-batch in each step() call (as torchtitan passes attention masks);
    a later stage applies, in each tick, the one of the micro-batch it forwards (calls carried over, then a drain)."""
    case = {"n": 2, "calls": 3, "scaled": True, "fdg": {"grad_shrink": 0.5, "weights": weights, "accumulate": 2}}
    results = run_ranks(workers.train, 3, tmp_path, case, deadline_s=240)
    check_equal(results, reference(case, 3))


def test_a_data_parallel_replica_equals_the_reference_bit_for_bit(tmp_path) -> None:
    """K = 2 x 2 replicas on the same data: the mean of two equal gradients is the gradient, bit for bit."""
    case = {"n": 3, "calls": 2, "dp": 2, "fdg": {"grad_shrink": 0.5, "accumulate": 2, "weights": "stashed"}}
    results = run_ranks(workers.train, 4, tmp_path, case, deadline_s=240)
    check_equal(results, reference(case, 2))


def test_data_parallel_replicas_average_their_gradients(tmp_path) -> None:
    """K = 2 x 2 replicas, each on its half of every micro-batch: the replicas stay equal bit for bit and train
    as the reference does on the whole micro-batch (to rounding: the mean is taken in another order)."""
    case = {"n": 3, "calls": 2, "dp": 2, "shard": True, "fdg": {"grad_shrink": 0.5}}
    results = run_ranks(workers.train, 4, tmp_path, case, deadline_s=240)
    for a, b in ((results[0], results[1]), (results[2], results[3])):
        for sa, sb in zip(a["states"], b["states"]):
            for key in sa:
                assert torch.equal(sa[key], sb[key]), key
    want = reference(case, 2)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for r in results:
        for got, ref in zip(r["states"], want["states"]):
            for key, value in ref[r["stage"]].items():
                torch.testing.assert_close(got[key], value, **tol)


TIMEOUT = 5  # ScheduleFDG(timeout=...) of the failure cases: how long a neighbour waits


def _failure(how: str, **extra: Any) -> dict[str, Any]:
    saboteur = {"trigger": 4, "how": how, "rank": 1, "hang_s": TIMEOUT + 10 + 2}
    return {"n": 3, "calls": 4, "barrier": False, "saboteur": saboteur, "fdg": {"timeout": TIMEOUT}, **extra}


def test_a_rank_killed_mid_run_makes_the_other_end_with_an_error(tmp_path) -> None:
    stage0, _ = run_ranks(workers.failure, 2, tmp_path, _failure("die"), deadline_s=120, expect_exit={1: 3})
    assert stage0["error"].startswith("FDGRuntimeError: stage 0 (global rank 0): gave up"), stage0
    assert "stage 1 (global rank 1)" in stage0["error"] and stage0["seconds"] < TIMEOUT + 10


def test_a_rank_that_stops_sending_is_reported_within_the_timeout(tmp_path) -> None:
    stage0, stage1 = run_ranks(workers.failure, 2, tmp_path, _failure("hang"), deadline_s=120)
    assert stage0["error"].startswith("FDGRuntimeError: stage 0 (global rank 0): gave up"), stage0
    assert "stage 1 (global rank 1)" in stage0["error"] and f"(timeout {TIMEOUT} s)" in stage0["error"]
    assert TIMEOUT <= stage0["seconds"] < TIMEOUT + 10
    assert "stage 1 (global rank 1): gave up" in stage1["error"]  # and the sleeper does not hang after it wakes


def test_a_rank_that_raises_brings_the_other_down(tmp_path) -> None:
    stage0, stage1 = run_ranks(workers.failure, 2, tmp_path, _failure("raise"), deadline_s=120)
    assert "boom in a layer of global rank 1" in stage1["error"]
    assert "stage 1 (global rank 1)" in stage0["error"] and stage0["seconds"] < TIMEOUT + 10


@pytest.mark.parametrize(
    "bad,failing,message",
    [
        ("short_batch", 0, "the activation of micro-batch 5 (tick 5) has shapes [((5, 8), torch.float32)], the "
         "pipeline was set up for [((6, 8), torch.float32)]"),
        ("float_labels", 1, "loss_fn failed on micro-batch 3 (tick 4) with output torch.float32 (6, 3) and target "
         "torch.float32 (6,)"),
    ],
)  # fmt: skip
def test_a_bad_input_ends_every_rank_with_an_error_naming_it(tmp_path, bad: str, failing: int, message: str) -> None:
    case = {"n": 3, "calls": 3, "barrier": False, "bad": bad, "fdg": {"timeout": TIMEOUT}}
    results = run_ranks(workers.failure, 2, tmp_path, case, deadline_s=120)
    assert message in results[failing]["error"], results[failing]
    other = results[1 - failing]
    assert f"stage {failing} (global rank {failing})" in other["error"] and other["seconds"] < TIMEOUT + 10, other


BAD_ARGUMENTS = [
    ({"fdg": {"grad_shrink": 1.5}}, "ScheduleFDG: grad_shrink must be in (0, 1], got 1.5 (ScheduleFDG(grad_shrink=..."),
    ({"fdg": {"weights": "old"}}, "weights must be one of ['current', 'stashed'], got 'old'"),
    ({"fdg": {"nonfinite": "skip"}}, "ScheduleFDG does not take ['nonfinite']"),
    ({"fdg": {"beta": 0.5}}, "unknown key(s) ['beta'] in ScheduleFDG's arguments"),
    ({"n": 0}, "n_microbatches must be an integer >= 1, got 0"),
    ({"clip": -1.0}, "clip_grad_norm must be >= 0.0, got -1.0"),
    ({"call_eval": True}, "ScheduleFDG.eval() is not supported (it trains only); call drain() on every rank"),
]  # fmt: skip


def test_bad_arguments_are_refused_on_every_rank_before_any_waits(tmp_path) -> None:
    """Each case in turn in one launch (Note [one launch, several calls] in tests/dist_harness.py): a rank that
    waited on another would not reach the next case."""
    calls = [({"n": 3, "calls": 1, **change},) for change, _ in BAD_ARGUMENTS]
    per_case = run_ranks_each(workers.bad_arguments, 2, tmp_path, calls, deadline_s=120)
    for (_, message), results in zip(BAD_ARGUMENTS, per_case):
        assert all(message in r for r in results), results


def test_fdg_keys_are_checked_as_arguments() -> None:
    with pytest.raises(
        FDGConfigError, match=r"accumulate must be an integer >= 1, got 0 \(ScheduleFDG\(accumulate=...\)\)"
    ):
        arguments.fdg_config({"accumulate": 0})
    with pytest.raises(FDGConfigError, match=r"corrections is 'auto' and the arguments set \['delay_momentum'\] too: "):
        arguments.fdg_config({"corrections": "auto", "delay_momentum": True})
    assert arguments.fdg_config({"grad_shrink": 0.5, "weights": "stashed"}).grad_shrink == 0.5


RESUME_CASES = [
    {"n": 2, "plan": ["step"] * 4 + ["drain"], "save_after": 2, "optimizer": "adam", "scheduler": True,
     "fdg": {"corrections": "auto", "accumulate": 2, "grad_shrink": 0.5}},
    {"n": 3, "plan": ["step"] * 3 + ["drain"], "save_after": 1, "clip": 0.5,
     "fdg": {"weights": "stashed", "activations": "recomputed", "delay_lr_ticks": 6, "predict_decay": 0.5}},
    {"n": 3, "plan": ["step"] * 3 + ["drain"], "save_after": 2, "fdg": {"weights": "stashed", "accumulate": 2}},
    # a drain as the first call after the load
    {"n": 3, "plan": ["step", "step", "drain"], "save_after": 2, "fdg": {"activations": "recomputed", "accumulate": 2}},
]  # fmt: skip


@pytest.mark.parametrize("world,cases", [(3, RESUME_CASES), (4, [{**RESUME_CASES[0], "dp": 2}])], ids=["K3", "K2xDP2"])
def test_a_resume_from_an_undrained_checkpoint_is_bit_identical(tmp_path, world: int, cases: list) -> None:
    """Save between step() calls with micro-batches in flight (and an accumulation half done), then continue in the
    same processes and, from the checkpoint, in new ones: every tick after the save is equal bit for bit."""
    calls = [(case, str(tmp_path / f"ckpt{i}"), "save") for i, case in enumerate(cases)]
    saved = run_ranks_each(workers.resume, world, tmp_path, calls, deadline_s=240)
    calls = [(case, str(tmp_path / f"ckpt{i}"), "load") for i, case in enumerate(cases)]
    loaded = run_ranks_each(workers.resume, world, tmp_path, calls, deadline_s=240)
    for per_rank_saved, per_rank_loaded in zip(saved, loaded):
        for a, b in zip(per_rank_saved, per_rank_loaded):
            assert a["losses"] == b["losses"]
            assert len(a["states"]) == len(b["states"]) > 0
            for sa, sb in zip(a["states"], b["states"]):
                for key in sa:
                    assert torch.equal(sa[key], sb[key]), (a["stage"], key)


@pytest.mark.parametrize("K", [2, 3])
def test_equals_the_deepspeed_engine_on_the_same_model(tmp_path, K: int) -> None:
    """tests/toy.py's model (a tuple activation, a raw module, plain functions) trained by the DeepSpeed engine and by
    ScheduleFDG, stage by stage: one statement of the math, two runtimes (the engine equals fdg_reference to 1e-6)."""
    cases = [
        {"stages": K, "n": 9, "gas": 3, "calls": 3, "drain": True, "grad_shrink": 0.5},
        {"stages": K, "n": 9, "gas": 3, "calls": 3, "drain": True, "grad_shrink": 0.7, "weights": "stashed",
         "activations": "recomputed", "accumulate": 2, "optimizer": "adam", "predict_decay": 0.5, "clip": 1.0},
    ]  # fmt: skip
    for per_rank in run_ranks_each(workers.against_engine, K, tmp_path, [(c,) for c in cases], deadline_s=300):
        for r in per_rank:
            assert len(r["engine"]) == len(r["torch"]) == 4
            for call, (engine, ours) in enumerate(zip(r["engine"], r["torch"])):
                assert engine.keys() == ours.keys()
                for key in engine:
                    where = f"stage {r['stage']} call {call} {key}"
                    torch.testing.assert_close(ours[key], engine[key], rtol=1e-6, atol=1e-6, msg=lambda m, w=where: w)
