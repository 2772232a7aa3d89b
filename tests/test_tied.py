"""Tied layers across stages (Note [tied layers across stages] in fdg_schedule/exchange/tied.py): the engine against the
reference, copies bit-identical on every owner after every call, no collective across stages, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import engine_workers
import pytest
import torch
import toy
from dist_harness import run_ranks_calls
from test_engine import MODES, TOL, expected_returned_losses

from fdg_schedule import FDGConfig, fdg_reference
from fdg_schedule.sched import ticks

pytestmark = pytest.mark.distributed


def tied_reference(
    case: dict[str, Any], parts: list[int]
) -> tuple[list[list[dict[str, torch.Tensor]]], list[float], list[list[tuple[int, str]]]]:
    """Per call, each reference stage's state; the losses; the ties (per key, (stage, name) of each copy)."""
    stages, ties = toy.tied_reference(parts, three_owners=case["tied"] == "three")
    opts, schedulers = toy.reference_optimizers(stages, case)
    gas = case.get("gas", 3)
    n_ticks = case["calls"] * gas
    snap_at = {(c + 1) * gas - 1 for c in range(case["calls"])}
    if case.get("drain"):
        snap_at.add(n_ticks + ticks.drain_ticks(len(stages)) - 1)
    states: list[list[dict[str, torch.Tensor]]] = []

    def after_tick(tick: int) -> None:
        if tick in snap_at:
            states.append([{k: v.detach().clone() for k, v in s.state_dict().items()} for s in stages])

    config = FDGConfig(**{k: case[k] for k in engine_workers.FDG_KEYS if k in case})
    losses = fdg_reference(
        stages, opts, toy.micro_batches(case["n"], 4 * case.get("dp", 1))[:n_ticks], toy.loss_fn, config,
        drain=case.get("drain", False), schedulers=schedulers, clip_grad_norm=case.get("clip", 0.0),
        after_tick=after_tick, ties=ties,
    )  # fmt: skip
    return states, losses, ties


def check_tied(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    """Every rank's stage equals the reference's after every call; every owner's copies are torch.equal."""
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert {r["engine"] for r in per_rank} == {"FDGPipelineEngine"}
        parts = per_rank[0]["parts"]
        ref_states, ref_losses, ties = tied_reference(case, parts)
        stages = len(parts) - 1
        for r in per_rank:
            assert len(r["states"]) == len(ref_states), case
            for call, (got, want) in enumerate(zip(r["states"], ref_states)):
                assert set(got) == set(want[r["stage_id"]]), (case, set(got) ^ set(want[r["stage_id"]]))
                where = f"{case} stage {r['stage_id']} call {call}"
                for key, value in got.items():
                    msg = lambda m, key=key, where=where: f"{where} {key}: {m}"  # noqa: E731
                    torch.testing.assert_close(value, want[r["stage_id"]][key], **TOL, msg=msg)
            want_losses = expected_returned_losses(case, r["stage_id"], stages, ref_losses)
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(want_losses, dtype=torch.float32), equal_nan=True, **TOL
            )
        # The reference's own copies are equal bit for bit, and so are the engine's, on every owner and replica.
        for tie in ties:
            name = tie[0][1]
            for call in range(len(ref_states)):
                copies = [ref_states[call][k][name] for k, _ in tie]
                assert all(torch.equal(copies[0], c) for c in copies), f"{case} reference call {call} {name}"
                engine = [r["states"][call][name] for r in per_rank if name in r["states"][call]]
                assert len(engine) == len(tie) * case.get("dp", 1)
                assert all(torch.equal(engine[0], c) for c in engine), f"{case} call {call} {name}: copies differ"
            moved = not torch.equal(ref_states[-1][tie[0][0]][name], ref_states[0][tie[0][0]][name])
            assert moved or len(ref_states) == 1, f"{case}: the tied weight {name} never moved"


def _cases(stages: int, gas: int, calls: int, **extra: Any) -> list[dict[str, Any]]:
    base = {"stages": stages, "n": 64, "gas": gas, "calls": calls, "grad_shrink": 0.5, "tied": True, "drain": True}
    return [
        {**base, "weights": w, "activations": a, "optimizer": ("sgd", "adam")[j % 2], "accumulate": 1 + j % 2, **extra}
        for j, (w, a) in enumerate(MODES)
    ]


def test_reference_keeps_tied_copies_equal_and_steps_them_once_per_accumulation() -> None:
    """The reference alone: an embedding tied to the head, K = 2, accumulate 2. The copies stay equal at every
    tick, and they move only at ticks t with t % 2 == 0 once contributions have arrived (Note [tied layers
    across stages, the reference])."""
    stages, ties = toy.tied_reference([0, 4, 8])
    assert ties == [[(0, "tied_modules.emb.weight"), (1, "tied_modules.emb.weight")]]
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    seen: list[torch.Tensor] = []

    def after_tick(tick: int) -> None:
        a, b = (s.tied_modules["emb"].weight for s in stages)
        assert torch.equal(a, b), tick
        seen.append(a.detach().clone())

    config = FDGConfig(grad_shrink=0.5, accumulate=2)
    data = toy.micro_batches(8, 4)
    fdg_reference(stages, opts, data, toy.loss_fn, config, drain=True, after_tick=after_tick, ties=ties)
    moved = [t for t in range(1, len(seen)) if not torch.equal(seen[t], seen[t - 1])]
    # Stage 1 back-propagates from tick 0, so G(0) != 0: steps at t = 2, 4, 6, 8 (ends of ticks 1, 3, 5, 7),
    # and the drain's last tick (tick 9: t = 10) steps too.
    assert moved == [1, 3, 5, 7, 9], moved
    assert all(not any(id(p) == id(s.tied_modules["emb"].weight) for g in o.param_groups for p in g["params"])
               for s, o in zip(stages, opts))  # fmt: skip


# -- the launches --------------------------------------------------------------------------------------
# Note [one launch, several calls] in tests/dist_harness.py: every call below ends cleanly on every rank (the
# refusals are caught inside the workers), so each world size shares a launch or two, built once per module.


def _every_mode_two_stages() -> list[dict[str, Any]]:
    cases = _cases(2, gas=3, calls=4)
    # a per-tick warm-up (the tied step takes the stage optimizer's lr) and clipping (P by its own norm)
    cases += [{**cases[0], "warmup": 5, "lr": 0.1, "clip": 0.05, "accumulate": 2, "weights": "stashed"}]
    # the DeepSpeed-built optimizer (the config's "optimizer" block): built over the parameters minus the tied ones
    cases += [{**cases[0], "ds_optimizer": True, "gas": 2}]
    return cases


def _every_mode_three_stages() -> list[dict[str, Any]]:
    cases = _cases(3, gas=1, calls=9)
    return cases + [{**cases[1], "gas": 2, "calls": 5, "accumulate": 3}]


def _data_parallel() -> list[dict[str, Any]]:
    base = {"stages": 2, "dp": 2, "n": 32, "gas": 3, "calls": 3, "drain": True, "grad_shrink": 0.5, "tied": True}
    return [
        {**base, "weights": "current", "activations": "stored", "optimizer": "sgd"},
        {**base, "weights": "stashed", "activations": "recomputed", "optimizer": "adam", "accumulate": 2},
    ]


def _three_owners() -> list[dict[str, Any]]:
    """Key "emb" on stages 0 and 2 (not neighbours), key "mid" with a copy on each of the 3 stages."""
    base = {"stages": 3, "n": 64, "gas": 2, "calls": 5, "grad_shrink": 0.5, "tied": "three", "drain": True}
    return [
        {**base, "weights": "current", "activations": "stored", "optimizer": "adam"},
        {**base, "weights": "stashed", "activations": "recomputed", "accumulate": 2},
    ]


def _trace_case(dp: int) -> dict[str, Any]:
    return {"stages": 2, "dp": dp, "n": 64, "gas": 3, "calls": 4, "grad_shrink": 0.5, "tied": True, "clip": 1.0}


def _zero1() -> list[dict[str, Any]]:
    base = {"stages": 2, "n": 64, "gas": 3, "calls": 3, "grad_shrink": 0.5, "tied": True, "drain": True, "zero": 1}
    return [{**base, "weights": "stashed", "accumulate": 2}, {**base, "optimizer": "adam", "clip": 0.05}]


def _bf16() -> list[dict[str, Any]]:
    base = {"stages": 2, "n": 64, "gas": 3, "calls": 3, "grad_shrink": 0.5, "tied": True, "bf16": True}
    return [
        {**base, "weights": "current", "activations": "stored", "accumulate": 2},
        {**base, "weights": "stashed", "activations": "recomputed", "zero": 1, "optimizer": "adam"},
    ]


def _data_end_case(stages: int, limit: int, accumulate: int) -> dict[str, Any]:
    return {"stages": stages, "n": 16, "gas": 3, "limit": limit, "grad_shrink": 0.5, "weights": "stashed",
            "accumulate": accumulate, "lr": 0.1, "warmup": 4, "tied": True}  # fmt: skip


DATA_END = {2: (2, 6, 3), 3: (3, 6, 3)}  # per stage count, the (stages, limit, accumulate) of its case


def _resumes_two_stages() -> list[dict[str, Any]]:
    # Saved at tick 3 with accumulate 2: P holds G(2) and the tied optimizers have state (Adam, momentum).
    base = {"stages": 2, "n": 48, "gas": 3, "calls_before": 1, "calls_after": 2, "grad_shrink": 0.5, "tied": True}
    return [
        {**base, "weights": w, "activations": a, "optimizer": opt, "accumulate": acc}
        for (w, a), opt, acc in zip(MODES, ("sgd", "adam", "adam", "sgd"), (2, 2, 1, 2))
    ]


def _resumes_three_stages() -> list[dict[str, Any]]:
    base = {"stages": 3, "n": 48, "gas": 3, "calls_before": 1, "calls_after": 2, "grad_shrink": 0.5, "accumulate": 2}
    return [
        {**base, "tied": True, "weights": "stashed", "activations": "stored", "optimizer": "adam"},
        {**base, "tied": "three", "weights": "current", "activations": "recomputed"},
    ]


def _resumes_flat() -> list[dict[str, Any]]:
    """The flat (bf16 / ZeRO-1) optimizers, whose files FDG writes in 1F1B's layout (Note [tied copies in flat
    optimizer files])."""
    base = {"stages": 2, "n": 48, "gas": 3, "calls_before": 1, "calls_after": 2, "grad_shrink": 0.5, "tied": True}
    return [
        {**base, "bf16": True, "accumulate": 2},
        {**base, "bf16": True, "zero": 1, "optimizer": "adam"},
        {**base, "zero": 1, "optimizer": "adam", "param_groups": True},
    ]


# The swap tests' case and (saved with, loaded with) pairs.
SWAP_EXACT = {"stages": 2, "n": 32, "gas": 2, "tied": True, "optimizer": "adam", "param_groups": True}
# Drained, as a switch to 1F1B should be (docs/fdg.md): then every owner's param group has the same step.
SWAP_ZERO1 = {**SWAP_EXACT, "zero": 1, "drain_save": True}
SWAP_BF16_ZERO1 = {**SWAP_ZERO1, "param_groups": False, "bf16": True}
BOTH_WAYS = (("fdg", "1f1b"), ("1f1b", "fdg"))
SWAPS: dict[str, tuple[dict[str, Any], tuple[tuple[str, str], ...]]] = {
    "exact": (SWAP_EXACT, BOTH_WAYS),
    "zero1": (SWAP_ZERO1, BOTH_WAYS),
    "bf16_zero1": (SWAP_BF16_ZERO1, BOTH_WAYS),
    "bf16_zero1_fp32_accumulation": ({**SWAP_BF16_ZERO1, "grad_accum_dtype": "fp32"}, BOTH_WAYS),
}

ONLY_TIED: dict[str, Any] = {
    "stages": 2,
    "config": {"train_micro_batch_size_per_gpu": 2, "pipeline": {"schedule": "fdg"}},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """World 2, first launch: the training cases, the dp1 trace, data-end (2 stages), the only-tied refusal, the
    two-stage and bf16 resumes straight through and the swap tests' saves. Second launch: the resumes resumed
    and the loads. Returns each call's results (per rank) by name; "resumes" holds (straight, resumed) per
    group and "swaps" (per swap test, per pair) (saved, loaded)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    trained = {"every_mode": _every_mode_two_stages(), "zero1": _zero1(), "bf16": _bf16()}
    resumes = {"two_stages": _resumes_two_stages(), "flat": _resumes_flat()}
    swaps = [(name, pair) for name, (_, pairs) in SWAPS.items() for pair in pairs]
    swap_dir = {(name, pair): str(tmp / f"{name}-{pair[0]}-to-{pair[1]}") for name, pair in swaps}
    first: list[tuple[Any, tuple]] = [(engine_workers.train, (cases,)) for cases in trained.values()]
    first += [(engine_workers.trace_collectives, (_trace_case(1),)),
              (engine_workers.data_end, (_data_end_case(*DATA_END[2]),)),
              (engine_workers.bad_config, (ONLY_TIED, "only"))]  # fmt: skip
    first += [(engine_workers.resume, (cases, str(tmp / name), "straight")) for name, cases in resumes.items()]
    first += [(engine_workers.swap, ({**SWAPS[name][0], "schedule": pair[0]}, swap_dir[name, pair], "save"))
              for name, pair in swaps]  # fmt: skip
    out1 = run_ranks_calls(2, tmp, first, deadline_s=900)
    second: list[tuple[Any, tuple]] = [
        (engine_workers.resume, (cases, str(tmp / name), "resumed")) for name, cases in resumes.items()
    ]
    second += [(engine_workers.swap, ({**SWAPS[name][0], "schedule": pair[1]}, swap_dir[name, pair], "load"))
               for name, pair in swaps]  # fmt: skip
    out2 = run_ranks_calls(2, tmp, second, deadline_s=600)
    out: dict[str, Any] = dict(zip(trained, out1))
    out["trace"], out["data_end"], out["only_tied"] = out1[len(trained) : len(trained) + 3]
    straight = out1[len(trained) + 3 : len(trained) + 3 + len(resumes)]
    out["resumes"] = dict(zip(resumes, zip(straight, out2[: len(resumes)])))
    saved, loaded = out1[len(trained) + 3 + len(resumes) :], out2[len(resumes) :]
    out["swaps"], out["swap_dirs"] = {}, {}
    for (name, pair), s, lo in zip(swaps, saved, loaded, strict=True):
        out["swaps"].setdefault(name, {})[pair] = (s, lo)
        out["swap_dirs"].setdefault(name, {})[pair] = swap_dir[name, pair]
    return out


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """World 3: the three-stage and three-owner training, data-end (3 stages) and the three-stage resumes
    straight through in one launch; resumed in a second. Returns each call's results (per rank) by name."""
    tmp = tmp_path_factory.mktemp("three_ranks")
    root = str(tmp / "ckpt")
    first: list[tuple[Any, tuple]] = [
        (engine_workers.train, (_every_mode_three_stages(),)),
        (engine_workers.train, (_three_owners(),)),
        (engine_workers.data_end, (_data_end_case(*DATA_END[3]),)),
        (engine_workers.resume, (_resumes_three_stages(), root, "straight")),
    ]
    every_mode, three_owners, data_end, straight = run_ranks_calls(3, tmp, first, deadline_s=600)
    [resumed] = run_ranks_calls(3, tmp, [(engine_workers.resume, (_resumes_three_stages(), root, "resumed"))],
                                deadline_s=300)  # fmt: skip
    return {"every_mode": every_mode, "three_owners": three_owners, "data_end": data_end,
            "resumes": (straight, resumed)}  # fmt: skip


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """World 4 (2 stages x 2 replicas): the data-parallel training and the dp2 trace in one launch."""
    tmp = tmp_path_factory.mktemp("four_ranks")
    dirs = {pair: str(tmp / f"{pair[0]}-to-{pair[1]}") for pair in BOTH_WAYS}
    calls: list[tuple[Any, tuple]] = [
        (engine_workers.train, (_data_parallel(),)),
        (engine_workers.trace_collectives, (_trace_case(2),)),
    ]
    for pair in BOTH_WAYS:  # save, then load in the same processes (each call builds its own engine)
        calls += [(engine_workers.swap, ({**SWAP_ZERO1, "schedule": pair[0]}, dirs[pair], "save")),
                  (engine_workers.swap, ({**SWAP_ZERO1, "schedule": pair[1]}, dirs[pair], "load"))]  # fmt: skip
    trained, trace, *swapped = run_ranks_calls(4, tmp, calls, deadline_s=500)
    swaps = {pair: (swapped[2 * i], swapped[2 * i + 1]) for i, pair in enumerate(BOTH_WAYS)}
    return {"data_parallel": trained, "trace": trace, "swaps": swaps, "swap_dirs": dirs}


# -- training ------------------------------------------------------------------------------------------


def test_tied_embedding_and_head_two_stages_every_mode(two_ranks) -> None:
    check_tied(two_ranks["every_mode"], _every_mode_two_stages())


def test_tied_embedding_and_head_three_stages_every_mode_tick_by_tick(three_ranks) -> None:
    results = three_ranks["every_mode"]
    check_tied(results, _every_mode_three_stages())
    assert math.isfinite(results[0][0]["losses"][-1])


def test_tied_data_parallel_2_x_pipeline_2(four_ranks) -> None:
    check_tied(four_ranks["data_parallel"], _data_parallel())


def test_three_owners_and_two_keys(three_ranks) -> None:
    """Key "emb" on stages 0 and 2 (not neighbours), key "mid" with a copy on each of the 3 stages."""
    results = three_ranks["three_owners"]
    assert results[0][0]["parts"] == [0, 4, 7, 10]
    check_tied(results, _three_owners())


@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "dp2"])
def test_no_collective_across_stages_with_tied_layers(request: pytest.FixtureRequest, dp: int) -> None:
    traces = request.getfixturevalue("two_ranks" if dp == 1 else "four_ranks")["trace"]
    assert len(traces) == 2 * dp
    for trace in traces:
        for name, ranks in trace["seen"]:
            assert set(ranks) <= set(trace["dp_group"]), f"stage {trace['stage_id']}: {name} over ranks {ranks}"
    if dp == 1:  # not even a one-rank reduce: the tied gradients travel point to point only
        assert all(trace["seen"] == [] for trace in traces), [trace["seen"] for trace in traces]
    else:  # the tied gradients' all-reduce within the stage's replicas, every tick
        assert all(any(name == "all_reduce" for name, _ in trace["seen"]) for trace in traces)


# -- checkpoints --------------------------------------------------------------------------------------


def _resume_checked(straight: list[Any], resumed: list[Any], cases: list[dict[str, Any]]) -> None:
    """Straight and resumed runs agree bit for bit; after the load every owner's copies are equal, and equal
    to the weights at the save."""
    for i, case in enumerate(cases):
        for a, b in zip((r[i] for r in straight), (r[i] for r in resumed)):
            assert a["global_steps"] == b["global_steps"] and a["losses"] == b["losses"], case
            for key in a["state"]:
                assert torch.equal(a["state"][key], b["state"][key]), f"{case} stage {a['stage_id']} {key}"
        names = {k for r in resumed for k in r[i]["after_load"] if k.startswith("tied_modules.")}
        assert names, case
        for name in names:
            loaded = [r[i]["after_load"][name] for r in resumed if name in r[i]["after_load"]]
            saved = [r[i]["after_load"][name] for r in straight if name in r[i]["after_load"]]
            assert len(loaded) >= 2 and all(torch.equal(loaded[0], c) for c in loaded + saved), f"{case} {name}"
            final = [r[i]["state"][name] for r in resumed if name in r[i]["state"]]
            assert all(torch.equal(final[0], c) for c in final), f"{case} {name} after training on"


def test_tied_resume_is_bit_identical_undrained_two_stages(two_ranks) -> None:
    straight, resumed = two_ranks["resumes"]["two_stages"]
    _resume_checked(straight, resumed, _resumes_two_stages())


def test_tied_resume_is_bit_identical_undrained_three_stages(three_ranks) -> None:
    straight, resumed = three_ranks["resumes"]
    _resume_checked(straight, resumed, _resumes_three_stages())


def _same_optimizer_state(saved: dict[str, Any], loaded: dict[str, Any], what: str) -> None:
    assert saved.keys() == loaded.keys(), what
    for name in saved:
        a, b = saved[name], loaded[name]
        assert a["settings"] == b["settings"], f"{what} {name}"
        assert a["state"].keys() == b["state"].keys(), f"{what} {name}"
        for k in a["state"]:
            assert torch.equal(torch.as_tensor(a["state"][k]), torch.as_tensor(b["state"][k])), f"{what} {name} {k}"


def test_fdg_and_1f1b_checkpoints_swap_exactly_with_a_tie(two_ranks) -> None:
    """Note [tied optimizer state in checkpoints]: with the stage optimizer unwrapped (fp32, no ZeRO), FDG -> 1F1B
    and 1F1B -> FDG load the weights and every parameter's optimizer state -- the tied copies' Adam moments and
    their param group's settings included -- exactly; both train on and FDG's copies stay equal. Two param
    groups (the second with weight decay) put the tied copies at inner slots of their groups."""
    for (saved_with, loaded_with), (saved, loaded) in two_ranks["swaps"]["exact"].items():
        what = f"{saved_with} -> {loaded_with}"
        for s, lo in zip(saved, loaded):
            assert lo["error"] is None, f"{what}: {lo['error']}"
            assert lo["engine"] == ("FDGPipelineEngine" if loaded_with == "fdg" else "PipelineEngine")
            for key in s["state"]:
                assert torch.equal(s["state"][key], lo["state"][key]), f"{what} {key}"
            tied_names = [n for n in s["optim"] if n.startswith("tied_modules.")]
            assert tied_names and all("exp_avg" in s["optim"][n]["state"] for n in tied_names), what
            _same_optimizer_state(s["optim"], lo["optim"], what)
        names = {k for lo in loaded for k in lo["after"] if k.startswith("tied_modules.")}
        for name in names:  # trained on after the load: the copies still equal (1F1B's all-reduce, FDG's sync)
            copies = [lo["after"][name] for lo in loaded]
            assert all(torch.equal(copies[0], c) for c in copies), f"{what} {name}"
            assert not torch.equal(copies[0], loaded[0]["state"][name]), f"{what} {name} did not train on"


def _flat_swap_checked(swaps: dict[tuple[str, str], Any], what: str) -> None:
    """Note [tied copies in flat optimizer files]: each parameter's fp32 weight, Adam moments and settings load
    exactly both ways, the tied copies' included; a tied copy's step is its group's in 1F1B's file."""
    for (saved_with, loaded_with), (saved, loaded) in swaps.items():
        how = f"{what} {saved_with} -> {loaded_with}"
        for s, lo in zip(saved, loaded):
            assert lo["error"] is None, f"{how}: {lo['error']}"
            assert lo["engine"] == ("FDGPipelineEngine" if loaded_with == "fdg" else "PipelineEngine"), how
            for key in s["state"]:
                assert torch.equal(s["state"][key], lo["state"][key]), f"{how} {key}"
            tied = [n for n in s["optim"] if n.startswith("tied_modules.")]
            own = [n for n in s["optim"] if n not in tied]
            assert tied and own and all("exp_avg" in s["optim"][n]["state"] for n in s["optim"]), how
            for name in s["optim"]:
                a, b = s["optim"][name], lo["optim"][name]
                assert a["settings"] == b["settings"], f"{how} {name}"
                assert a["state"].keys() == b["state"].keys(), f"{how} {name}"
                for k in a["state"]:
                    want = a["state"][k]
                    if k == "step" and name in tied and saved_with == "fdg":  # 1F1B's file: the group's step
                        want = s["optim"][own[0]]["state"]["step"]
                    assert torch.equal(torch.as_tensor(want), torch.as_tensor(b["state"][k])), f"{how} {name} {k}"
        for name in {k for lo in loaded for k in lo["after"] if k.startswith("tied_modules.")}:
            copies = [lo["after"][name] for lo in loaded]  # trained on after the load: the copies still equal
            assert all(torch.equal(copies[0], c) for c in copies), f"{how} {name}"
            assert not torch.equal(copies[0], loaded[0]["state"][name]), f"{how} {name} did not train on"


def _flat_files(save_dir: str) -> dict[str, Any]:
    """The ZeRO / bf16 optimizer files of a checkpoint, by file name (the tag dropped)."""
    return {
        path.name: torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for path in sorted(Path(save_dir).glob("*/*zero_pp_rank_*_optim_states.pt"))
    }


def _same_layout_as_1f1b(dirs: dict[tuple[str, str], str], what: str) -> None:
    """FDG's file (saved for the swap to 1F1B) has the layout of 1F1B's own (saved for the other swap): the same
    partition sizes, paddings and parameter slices, rank by rank."""
    fdg, genuine = _flat_files(dirs["fdg", "1f1b"]), _flat_files(dirs["1f1b", "fdg"])
    assert fdg.keys() == genuine.keys() and fdg, what
    for file in fdg:
        a, b = fdg[file], genuine[file]
        assert a.keys() == b.keys(), f"{what} {file}"
        for key in ("group_paddings", "param_alignment_paddings", "param_slice_mappings", "partition_count"):
            assert a.get(key) == b.get(key), f"{what} {file} {key}: {a.get(key)} != {b.get(key)}"
        assert [t.shape for t in a["single_partition_of_fp32_groups"]] == [
            t.shape for t in b["single_partition_of_fp32_groups"]
        ], f"{what} {file}"
        sa, sb = a["base_optimizer_state"]["state"], b["base_optimizer_state"]["state"]
        assert {g: {k: v.shape for k, v in st.items()} for g, st in sa.items()} == {
            g: {k: v.shape for k, v in st.items()} for g, st in sb.items()
        }, f"{what} {file}"


FLAT_WRAPPERS = {
    "zero1": "DeepSpeedZeroOptimizer",
    "bf16_zero1": "DeepSpeedZeroOptimizer",
    "bf16_zero1_fp32_accumulation": "BF16_Optimizer",
}


@pytest.mark.parametrize("name", list(FLAT_WRAPPERS))
def test_flat_optimizer_state_swaps_exactly_with_a_tie(two_ranks, name: str) -> None:
    """ZeRO-1 (two param groups, the tied copies at inner slots), bf16 + ZeRO-1 and bf16 + ZeRO-1 accumulating in
    fp32 (DeepSpeed's two flat wrappers): FDG -> 1F1B and 1F1B -> FDG load every parameter's fp32 weight and
    optimizer state exactly, and FDG writes 1F1B's file layout."""
    wrapper = FLAT_WRAPPERS[name]
    for (saved_with, _), (saved, loaded) in two_ranks["swaps"][name].items():
        assert all(r["optimizer"] == wrapper for r in saved + loaded), name
        if saved_with == "fdg":  # drained: no warning
            assert not any("drain=True" in w for r in saved for w in r["save_warnings"]), name
    _flat_swap_checked(two_ranks["swaps"][name], name)
    _same_layout_as_1f1b(two_ranks["swap_dirs"][name], name)


def test_flat_optimizer_state_swaps_exactly_with_a_tie_data_parallel_2(four_ranks) -> None:
    """DP 2 x PP 2 under ZeRO-1: each replica's partition moves, the tied copies' values cross partitions."""
    _flat_swap_checked(four_ranks["swaps"], "dp2 zero1")
    _same_layout_as_1f1b(four_ranks["swap_dirs"], "dp2 zero1")


# -- bf16 and ZeRO-1 --------------------------------------------------------------------------------


def test_tied_zero1_equals_the_reference(two_ranks) -> None:
    """ZeRO-1 (fp32): the tied copies are outside the ZeRO optimizer; the engine equals the reference to 1e-6."""
    check_tied(two_ranks["zero1"], _zero1())


def test_tied_bf16_and_bf16_zero1_keep_copies_bit_identical_and_follow_the_reference(two_ranks) -> None:
    """bf16 (fp32 masters of the tied copies, stepped by the tied optimizer) with and without ZeRO-1: the copies
    are torch.equal on both owners after every call, the weights move, and they stay within bf16 precision of
    the fp32 reference (the tolerance the other bf16 tests use)."""
    cases, results = _bf16(), two_ranks["bf16"]
    name = "tied_modules.emb.weight"
    for i, case in enumerate(cases):
        ref_states, _, _ = tied_reference(case, results[0][i]["parts"])
        for call in range(case["calls"]):
            a, b = (r[i]["states"][call][name] for r in results)
            assert torch.equal(a, b), f"{case} call {call}: the bf16 copies differ"
        for r in results:
            assert all(math.isfinite(loss) for loss in r[i]["losses"][1:]), case
            assert not torch.equal(r[i]["states"][-1][name], r[i]["states"][0][name]), f"{case}: never moved"
            for key, value in r[i]["states"][-1].items():
                want = ref_states[-1][r[i]["stage_id"]][key]
                torch.testing.assert_close(value, want, rtol=0.05, atol=0.02, msg=f"{case} {key}")


def test_tied_resume_is_bit_identical_with_flat_optimizers(two_ranks) -> None:
    """bf16, bf16 + ZeRO-1 and ZeRO-1 (two param groups): FDG's file is in 1F1B's layout, and the tied optimizers'
    own state (their step included) comes back from FDG's per-stage file."""
    straight, resumed = two_ranks["resumes"]["flat"]
    _resume_checked(straight, resumed, _resumes_flat())
    for i, case in enumerate(_resumes_flat()):  # saved undrained: stage 0, holding work in flight, warns
        warned = [any("save_checkpoint(..., drain=True)" in w for w in r[i]["save_warnings"]) for r in straight]
        assert warned == [r[i]["stage_id"] == 0 for r in straight], case


@pytest.mark.parametrize("stages,limit,accumulate", [(2, 6, 3), (3, 6, 3)])
def test_tied_data_running_out_flushes_the_last_contributions(
    request: pytest.FixtureRequest, stages: int, limit: int, accumulate: int
) -> None:
    """The iterator ends mid-call: the segment's last tick flushes P (Note [tied layers across stages], 5), so
    the weights equal the reference's after ``limit`` micro-batches and a drain, the copies bit-identical.
    The segment's last tick is limit - 1 + 2(K-1), so t = 8 (K = 2) and 10 (K = 3) are no multiples of 3: only
    the flush applies the last contributions. (``limit`` is a multiple of ``accumulate``: the engine's last
    stage learns the end after its last backward and does not step a partial accumulation there, which
    fdg_reference does; that is outside the tied sync.)"""
    from deepspeed.runtime.lr_schedules import WarmupLR

    assert DATA_END[stages] == (stages, limit, accumulate)  # the case the fixture ran
    case = _data_end_case(stages, limit, accumulate)
    results = request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[stages])["data_end"]
    assert len(results) == stages
    ref, ties = toy.tied_reference(results[0]["parts"])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in ref]
    scheds = [WarmupLR(o, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4) for o in opts]
    config = FDGConfig(grad_shrink=0.5, weights="stashed", accumulate=accumulate)
    data = toy.micro_batches(case["n"], 4)[:limit]
    fdg_reference(ref, opts, data, toy.loss_fn, config, drain=True, schedulers=scheds, ties=ties)
    for r in results:
        for key, value in ref[r["stage_id"]].state_dict().items():
            torch.testing.assert_close(r["state"][key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    a, b = (r["state"]["tied_modules.emb.weight"] for r in (results[0], results[-1]))
    assert torch.equal(a, b)


def test_a_stage_of_only_tied_layers_is_refused_on_every_rank(two_ranks) -> None:
    results = two_ranks["only_tied"]
    assert len(results) == 2
    for r in results:
        assert r["error"] is not None and "pipeline stages [0] hold only tied layers (['emb'])" in r["error"], r
