"""Issue 64's pre-registered test runner (benchmarks/convergence/auto_v2_test.py): plan, choices, analysis, smoke.

The plan and the analysis run on synthetic run files whose r and gap are known by construction; the smoke runs train
each task a few ticks on stand-in data (as tests/test_auto_v2_tasks.py: no package fetch).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.common import auto_v2_tasks as tasks
from benchmarks.common import heldout_text as ht
from benchmarks.common.curve_runs import read, write_result
from benchmarks.convergence import auto_v2_test as v2
from fdg_schedule.plan import token_overhead as to

TASK, OPT = "lm_llama", "adamw"
N = v2.BUDGET[TASK] * tasks.LM_MICRO * tasks.BLOCK  # a baseline's tokens
POINTS = len(v2.GRIDS[OPT]) * len(v2.WARMUPS)


def bp_curve(final: float, start: float = 6.0) -> list[list[float]]:
    """A straight baseline curve: EVALS evaluations from N / EVALS to N tokens, ending at ``final``."""
    return [[N * (i + 1) / v2.EVALS, start + (final - start) * (i + 1) / v2.EVALS] for i in range(v2.EVALS)]


def fdg_curve(target: float, r: float, start: float = 6.0) -> list[list[float]]:
    """A straight FDG curve over CAP x N tokens (evaluated every N / EVALS) that crosses ``target`` at r x N."""
    points = v2.CAP * v2.EVALS
    slope = (target - start) / (r * N)
    return [[N * (i + 1) / v2.EVALS, start + slope * N * (i + 1) / v2.EVALS] for i in range(points)]


def put(out: Path, run: v2.Run, curve: list[list[float]], failed: bool = False) -> None:
    result: dict[str, Any] = {**dataclasses.asdict(run), "name": run.name, "val": curve, "final": curve[-1][1]}
    if failed:
        result["failed"] = "non-finite loss"
    write_result(run.path(out), result)


EQ_BEST = (5e-4, 0.0)  # fdg_k4_eq's lowest final validation loss in fill_grids


def fill_grids(out: Path, best_bp: tuple[float, float], fdg_r: dict[tuple[float, float], float]) -> None:
    """The lm_llama/adamw tuning grids, with the points amendment 1 adds: bp best at ``best_bp`` (final 2.0); FDG's
    r per point (default: beyond); fdg_k4_eq (the baseline's budget) best at EQ_BEST."""
    while missing := [r for arm in v2.arms() for r in v2.grid(TASK, OPT, arm, out) if not r.path(out).exists()]:
        for run in missing:
            if run.arm == "bp":
                put(out, run, bp_curve(2.0 if (run.lr, run.warmup) == best_bp else 2.2 + run.lr))
            elif run.arm == "fdg_k4_eq":
                put(out, run, bp_curve(2.01 if (run.lr, run.warmup) == EQ_BEST else 2.3))
            else:
                put(out, run, fdg_curve(2.0, fdg_r.get((run.lr, run.warmup), 3.0)))


# -- the plan ------------------------------------------------------------------------------------------------


def test_run_names_round_trip_and_say_what_runs() -> None:
    for run in (v2.Run("lm_llama", "adamw", "bp", 5e-4, 0.1, 400), v2.Run("lm_gpt2", "muon", "fdg_k8", 0.04, 0, 408),
                v2.Run("vgg", "sgd", "bp_a4", 0.2, 0.0, 401)):  # fmt: skip
        assert v2.Run.parse(run.name) == run
    fdg = v2.Run("lm_gpt2", "muon", "fdg_k8", 0.02, 0.0, 401)
    assert (fdg.stages, fdg.accumulate, fdg.micro_batches, fdg.split) == (8, 1, 2 * v2.BUDGET["lm_gpt2"], "test")
    eq = v2.Run("lm_gpt2", "muon", "fdg_k4_eq", 0.02, 0.0, 401)
    assert v2.Run.parse(eq.name) == eq and (eq.stages, eq.capped, eq.micro_batches) == (4, False, v2.BUDGET["lm_gpt2"])
    assert v2.equal_arms() == ("fdg_k4_eq",)  # K = 8 has no gap margin
    with pytest.raises(ValueError, match="fdg_k8_eq"):
        v2.Run.parse("vgg_sgd/fdg_k8_eq_lr0.1_w0_s401")
    bp = v2.Run("vgg", "sgd", "bp", 0.1, 0.1, v2.TUNING_SEED)
    assert (bp.stages, bp.accumulate, bp.micro_batches, bp.split) == (1, 1, v2.BUDGET["vgg"], "validation")
    assert v2.Run("vgg", "sgd", "bp_a4", 0.1, 0.1, 401).accumulate == 4
    with pytest.raises(ValueError, match="lm_llama_sgd"):
        v2.Run.parse("lm_llama_sgd/bp_lr0.1_w0_s401")
    with pytest.raises(ValueError, match="fdg_k2"):
        v2.Run.parse("vgg_sgd/fdg_k2_lr0.1_w0_s401")
    for bad in ("bad_name", "vgg_sgd/bp_lr0.1_s401", "vgg_sgd/bp_lrx_w0_s401"):
        with pytest.raises(ValueError, match="is not <task>_<optimizer>/<arm>_lr"):
            v2.Run.parse(bad)


def test_the_preregistered_constants() -> None:
    assert v2.TUNING_SEED == 400 and tuple(range(401, 409)) == v2.SEEDS and v2.TUNING_SEED not in v2.SEEDS
    assert v2.CAP == 2 and v2.STAGES == (4, 8) and v2.WARMUPS == (0.0, 0.1)
    assert all(b % v2.EVALS == 0 and (b // v2.EVALS) % v2.BP_A4_GAS == 0 for b in v2.BUDGET.values())
    assert set(v2.BUDGET) == set(tasks.TASKS)
    assert v2.GRIDS == {"adamw": (5e-4, 1e-3, 2e-3), "muon": (0.01, 0.02, 0.04), "sgd": (0.05, 0.1, 0.2)}
    assert v2.MARGINS == {4: {"r": 1.15, "gap": 1.0}, 8: {"r": 1.30, "gap": None}}
    from benchmarks.common import optimizers  # AdamW as issue 63's runs build it (tests/test_bench_common.py)

    assert {k: v for k, v in optimizers.ADAMW.items() if k != "lr"} == v2.ADAMW and v2.CLIP == optimizers.CLIP


@pytest.mark.parametrize("bp_a4", [False, True])
def test_the_queue_tunes_everything_first_then_the_report_seeds_config_by_config(tmp_path: Path, bp_a4: bool) -> None:
    order = v2.queue_order(tmp_path, bp_a4)
    arms = (2 if bp_a4 else 1) + len(v2.STAGES) + 1  # the baselines, FDG K = 4 and 8, fdg_k4_eq
    tuning, seeds = len(v2.CONFIGS) * arms * POINTS, len(v2.CONFIGS) * arms * len(v2.SEEDS)
    assert len(order) == tuning + seeds == (350 if bp_a4 else 280)
    first = order[:tuning]
    assert all(isinstance(r, v2.Run) and r.seed == v2.TUNING_SEED for r in first)
    names = [r.name for r in first if isinstance(r, v2.Run)]
    assert len(set(names)) == len(names)
    # per configuration, the LMs first: the baselines' grids, then FDG K = 4's, then K = 8's
    expected_arms = ["bp"] + (["bp_a4"] if bp_a4 else []) + ["fdg_k4", "fdg_k8", "fdg_k4_eq"]
    configs = [(r.task, r.optimizer) for r in first if isinstance(r, v2.Run)][:: POINTS * arms]
    assert configs == list(v2.CONFIGS) and configs[-1] == ("vgg", "sgd")
    assert [r.arm for r in first[: arms * POINTS] if isinstance(r, v2.Run)][::POINTS] == expected_arms
    assert [(r.lr, r.warmup) for r in first[:POINTS] if isinstance(r, v2.Run)] == [
        (lr, w) for lr in v2.GRIDS[OPT] for w in v2.WARMUPS
    ]
    # the report seeds wait for their choice, configuration by configuration, seed by seed
    rest = order[tuning:]
    assert rest[: len(expected_arms)] == [(TASK, OPT, arm, v2.SEEDS[0]) for arm in expected_arms]
    assert [item[:2] for item in rest[:: arms * len(v2.SEEDS)]] == list(v2.CONFIGS)  # type: ignore[index]
    assert v2.next_run(tmp_path, bp_a4) == first[0]


def test_the_queue_restarts_where_it_stopped_and_a_failed_run_counts_as_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def fake(run: v2.Run, **_: Any) -> dict[str, Any]:
        calls.append(run.name)
        if run.arm == "fdg_k8" and run.lr == 5e-4:
            raise RuntimeError("diverged")
        best = run.lr == 1e-3  # inside the grid: amendment 1 adds nothing
        curve = fdg_curve(2.0, 1.2 if best else 1.4) if run.capped else bp_curve(2.0 if best else 2.1)
        return {**dataclasses.asdict(run), "name": run.name, "val": curve, "final": curve[-1][1]}

    monkeypatch.setattr(v2, "one_run", fake)
    first = [r for r in v2.queue_order(tmp_path) if isinstance(r, v2.Run)][: 4 * POINTS]
    v2.run_one(tmp_path, first[0])
    assert v2.next_run(tmp_path) == first[1]
    for run in first[1:]:
        v2.run_one(tmp_path, run)
    assert calls == [r.name for r in first]
    failed = read(v2.grid(TASK, OPT, "fdg_k8")[0].path(tmp_path))
    assert failed is not None and "diverged" in failed["failed"]
    nxt = v2.next_run(tmp_path)
    assert nxt is not None and (nxt.task, nxt.optimizer, nxt.seed) == ("lm_gpt2", "adamw", v2.TUNING_SEED)
    # lm_llama's choices are made: its report runs are known now
    report = [i for i in v2.queue_order(tmp_path) if isinstance(i, v2.Run) and i.seed == v2.SEEDS[0]]
    assert [r.arm for r in report] == ["bp", "fdg_k4", "fdg_k8", "fdg_k4_eq"] and report[0].task == TASK
    waiting = len(v2.CONFIGS[1:]) * 4 * len(v2.SEEDS)  # the other configurations' report runs
    assert f"24 of 280 runs done ({waiting} wait" in v2.status(tmp_path) and "2 failed" in v2.status(tmp_path)


def test_the_child_command_parses_to_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = v2.Run("lm_gpt2", "muon", "fdg_k8", 0.02, 0.1, 403)
    for pause in (None, tmp_path / "QUIET"):
        monkeypatch.setattr(v2, "PAUSE_WHILE", pause)
        command = v2.child_command(tmp_path, run)
        assert command[1:3] == ["-m", "benchmarks.convergence.auto_v2_test"]
        args = v2.parser().parse_args(command[3:])
        assert (args.what, v2.Run.parse(args.name), args.out, args.pause_while) == ("one", run, tmp_path, pause)


# -- the choice rules ----------------------------------------------------------------------------------------


def test_bp_takes_the_lowest_final_loss_fdg_the_fewest_tokens_to_bps(tmp_path: Path) -> None:
    assert v2.choose(tmp_path, TASK, OPT, "bp") is None
    fill_grids(tmp_path, (1e-3, 0.1), {(5e-4, 0.0): 1.5, (2e-3, 0.1): 1.2})
    assert v2.choose(tmp_path, TASK, OPT, "bp") == v2.Run(TASK, OPT, "bp", 1e-3, 0.1, v2.TUNING_SEED)
    for k in v2.STAGES:  # 1.2 x N beats 1.5 x N, though the 1.5 point ends lower
        assert v2.choose(tmp_path, TASK, OPT, f"fdg_k{k}") == v2.Run(TASK, OPT, f"fdg_k{k}", 2e-3, 0.1, 400)


def test_fdg_none_reaching_takes_the_lowest_final_loss_and_ties_go_to_grid_order(tmp_path: Path) -> None:
    fill_grids(tmp_path, (1e-3, 0.0), {})  # no FDG point reaches 2.0 within the cap
    fdg = v2.grid(TASK, OPT, "fdg_k4")
    put(tmp_path, fdg[3], fdg_curve(2.0, 2.1))  # ends lower than the others (2.1 > the cap, still the lowest)
    assert v2.choose(tmp_path, TASK, OPT, "fdg_k4") == fdg[3]
    for run in v2.grid(TASK, OPT, "fdg_k4", tmp_path):  # all equal, the points amendment 1 added too: ties go to
        put(tmp_path, run, fdg_curve(2.0, 1.3))  # grid order, whose base points come first
    assert v2.choose(tmp_path, TASK, OPT, "fdg_k4") == fdg[0] and not v2.at_edge(tmp_path, TASK, OPT, "fdg_k4")
    assert [r.lr for r in v2.grid(TASK, OPT, "fdg_k4", tmp_path)[len(fdg) :]] == [2.5e-4, 2.5e-4]
    for run in v2.grid(TASK, OPT, "bp"):  # all bp points equal: the first (lowest lr: half of it added, equal)
        put(tmp_path, run, bp_curve(2.0))
    for run in v2.grid(TASK, OPT, "bp", tmp_path):
        put(tmp_path, run, bp_curve(2.0))
    assert v2.choose(tmp_path, TASK, OPT, "bp") == v2.grid(TASK, OPT, "bp")[0]


def test_amendment_1_extends_an_arms_grid_where_its_edge_wins_at_most_twice_each_way(tmp_path: Path) -> None:
    base = v2.grid(TASK, OPT, "bp")
    assert v2.grid(TASK, OPT, "bp", tmp_path) == base  # nothing run yet: the pre-registered grid
    for run in base:  # the top lr wins
        put(tmp_path, run, bp_curve(5.0 - 1000 * run.lr))
    assert v2.choose(tmp_path, TASK, OPT, "bp") is None
    grown = v2.grid(TASK, OPT, "bp", tmp_path)
    assert grown[: len(base)] == base and [(r.lr, r.warmup) for r in grown[len(base) :]] == [(4e-3, 0.0), (4e-3, 0.1)]
    assert grown[-1].name == "lm_llama_adamw/bp_lr0.004_w0.1_s400"
    for _ in range(3):  # the top keeps winning: 4e-3, then 8e-3, then no further (EXTEND)
        for run in v2.grid(TASK, OPT, "bp", tmp_path):
            if not run.path(tmp_path).exists():
                put(tmp_path, run, bp_curve(5.0 - 1000 * run.lr))
    lrs = sorted({r.lr for r in v2.grid(TASK, OPT, "bp", tmp_path)})
    assert lrs == [5e-4, 1e-3, 2e-3, 4e-3, 8e-3] and v2.EXTEND == 2
    assert v2.choose(tmp_path, TASK, OPT, "bp") == v2.Run(TASK, OPT, "bp", 8e-3, 0.0, v2.TUNING_SEED)
    assert v2.at_edge(tmp_path, TASK, OPT, "bp")
    # the queue runs an arm's added points right after its grid, before the next arm's
    order = [i for i in v2.queue_order(tmp_path) if isinstance(i, v2.Run)]
    assert [r.arm for r in order[: len(lrs) * len(v2.WARMUPS) + 1]] == ["bp"] * len(lrs) * len(v2.WARMUPS) + ["fdg_k4"]
    assert "lm_llama adamw `bp`" in v2.markdown(v2.analyze(tmp_path))


def test_an_interior_choice_adds_nothing_and_fdg_extends_only_once_bps_choice_is_final(tmp_path: Path) -> None:
    fdg = v2.grid(TASK, OPT, "fdg_k4")
    for run in fdg:  # the top lr reaches a target 2.0 first
        put(tmp_path, run, fdg_curve(2.0, 1.1 if run.lr == 2e-3 else 1.5))
    assert v2.grid(TASK, OPT, "fdg_k4", tmp_path) == fdg  # bp's choice not known: nothing added yet
    for run in v2.grid(TASK, OPT, "bp"):
        put(tmp_path, run, bp_curve(2.0 if (run.lr, run.warmup) == (1e-3, 0.1) else 2.2))
    assert v2.grid(TASK, OPT, "bp", tmp_path) == v2.grid(TASK, OPT, "bp") and not v2.at_edge(tmp_path, TASK, OPT, "bp")
    added = v2.grid(TASK, OPT, "fdg_k4", tmp_path)[len(fdg) :]
    assert [(r.lr, r.warmup) for r in added] == [(4e-3, w) for w in v2.WARMUPS]
    for run in added:  # twice the lr does worse: the choice stays, now inside the grid
        put(tmp_path, run, fdg_curve(2.0, 1.8))
    assert v2.choose(tmp_path, TASK, OPT, "fdg_k4") == fdg[4] and not v2.at_edge(tmp_path, TASK, OPT, "fdg_k4")


def test_fdg_waits_for_bps_grid(tmp_path: Path) -> None:
    for run in v2.grid(TASK, OPT, "fdg_k4"):
        put(tmp_path, run, fdg_curve(2.0, 1.2))
    assert v2.choose(tmp_path, TASK, OPT, "fdg_k4") is None
    for run in v2.grid(TASK, OPT, "bp")[:-1]:
        put(tmp_path, run, bp_curve(2.0))
    assert v2.choose(tmp_path, TASK, OPT, "fdg_k4") is None  # one bp point missing


# -- the analysis --------------------------------------------------------------------------------------------


def fill_seeds(out: Path, rs: list[float], gaps: list[float], k: int = 4) -> None:
    """Report runs: FDG's CAP x run crossing each seed's bp final at r x N, and at N tokens 1 point more than the
    gap above it (r above 1 + 1 / EVALS: the crossing lies past the segment the hand-set point at N touches); the
    fdg_k4_eq run ending the gap (%) above bp's final."""
    for seed, r, g in zip(v2.SEEDS, rs, gaps):
        final = 2.0 - 0.01 * (seed % 3)  # the targets differ by seed: r and the gap are per pair
        put(out, v2.Run(TASK, OPT, "bp", 1e-3, 0.1, seed), bp_curve(final))
        curve = fdg_curve(final, r)
        at_n = next(i for i, (t, _) in enumerate(curve) if t == N)
        curve[at_n][1] = final * (1 + (g + 1) / 100)  # the equal-token point (an evaluation), set by hand
        put(out, v2.Run(TASK, OPT, f"fdg_k{k}", 2e-3, 0.1, seed), curve)
        if k == 4:
            put(out, v2.Run(TASK, OPT, "fdg_k4_eq", *EQ_BEST, seed), bp_curve(final * (1 + g / 100)))


def hand_bounds(xs: list[float]) -> tuple[float, float, tuple[float, float]]:
    n, mean, sd = len(xs), statistics.fmean(xs), statistics.stdev(xs)
    one, two = (to.t_quantile(q, n - 1) * sd / math.sqrt(n) for q in (0.95, 0.975))
    return mean, mean + one, (mean - two, mean + two)


def test_r_and_the_gap_with_their_bounds_and_verdicts(tmp_path: Path) -> None:
    fill_grids(tmp_path, (1e-3, 0.1), {(2e-3, 0.1): 1.1})
    rs = [1.07, 1.09, 1.08, 1.10, 1.07, 1.11, 1.08, 1.09]  # crossings after the equal-token point's segment
    gaps = [0.3, 0.5, 0.2, 0.6, 0.4, 0.1, 0.5, 0.3]
    assert len(rs) == len(v2.SEEDS)
    fill_seeds(tmp_path, rs, gaps)
    report = v2.analyze(tmp_path)
    row = report["configs"][0]["K"]["4"]["bp"]
    mean, upper, interval = hand_bounds([math.log(r) for r in rs])
    assert row["r"] == pytest.approx(math.exp(mean), rel=1e-9)
    assert row["upper_95"] == pytest.approx(math.exp(upper), rel=1e-9)
    assert row["interval_95"] == pytest.approx([math.exp(interval[0]), math.exp(interval[1])], rel=1e-9)
    assert [s["r"] for s in row["seeds"]] == pytest.approx(rs, rel=1e-9)
    g_mean, g_upper, g_interval = hand_bounds(gaps)
    assert row["gap"]["per_seed"] == pytest.approx(gaps, rel=1e-9)
    assert row["gap"]["mean"] == pytest.approx(g_mean) and row["gap"]["upper_95"] == pytest.approx(g_upper)
    assert row["gap"]["interval_95"] == pytest.approx(list(g_interval)) and row["gap"]["arm"] == "fdg_k4_eq"
    assert row["gap_at_tokens"]["per_seed"] == pytest.approx([g + 1 for g in gaps], rel=1e-9)  # reported only
    assert math.exp(upper) < 1.15 and g_upper < 1.0 and (row["r_verdict"], row["gap_verdict"]) == ("pass", "pass")
    assert (
        f"| {TASK} | {OPT} | 4 | bp | 8 (8) of 8 | {math.exp(mean):.3f} | {math.exp(upper):.3f} |"
        in (report["markdown"])
    )
    assert "| ≤ 1.15 | pass |" in report["markdown"] and "| ≤ +1 | pass |" in report["markdown"]
    # K = 8 has no runs yet: pending, not dropped
    assert report["configs"][0]["K"]["8"]["bp"]["r_verdict"] == "pending"
    assert f"| {TASK} | {OPT} | 8 | bp | 0 (0) of 8 |" in report["markdown"]


def test_a_bound_over_the_margin_fails_and_a_seed_beyond_the_cap_is_kept(tmp_path: Path) -> None:
    fill_grids(tmp_path, (1e-3, 0.1), {(2e-3, 0.1): 1.1})
    fill_seeds(tmp_path, [1.10, 1.20, 1.15, 1.18, 1.12, 1.22, 1.16, 1.14], [0.9, 1.3, 0.8, 1.1, 1.2, 0.7, 1.0, 1.4])
    row = v2.analyze(tmp_path)["configs"][0]["K"]["4"]["bp"]
    assert row["upper_95"] > 1.15 and row["gap"]["upper_95"] > 1.0
    assert (row["r_verdict"], row["gap_verdict"]) == ("fail", "fail")
    fill_seeds(tmp_path, [3.0] + [1.08] * 7, [0.5] * 8)  # the first seed never reaches bp's loss within 2 x N
    report = v2.analyze(tmp_path)
    row = report["configs"][0]["K"]["4"]["bp"]
    assert row["r"] is None and row["reached"] == 7 and row["n"] == 8
    assert row["r_at_least"] == pytest.approx(math.exp((math.log(v2.CAP) + 7 * math.log(1.08)) / 8))
    assert row["seeds"][0]["r"] is None and row["seeds"][0]["cap"] == pytest.approx(v2.CAP)
    assert row["r_verdict"] == "fail" and f"> {row['r_at_least']:.3f}" in report["markdown"]


def test_failed_runs_are_listed_a_failed_fdg_fails_a_missing_seed_pends(tmp_path: Path) -> None:
    fill_grids(tmp_path, (1e-3, 0.1), {(2e-3, 0.1): 1.1})
    fill_seeds(tmp_path, [1.08] * 8, [0.2] * 8)
    v2.Run(TASK, OPT, "fdg_k4", 2e-3, 0.1, v2.SEEDS[-1]).path(tmp_path).unlink()
    row = v2.analyze(tmp_path)["configs"][0]["K"]["4"]["bp"]
    assert row["missing_seeds"] == [v2.SEEDS[-1]] and row["n"] == 7 and row["r_verdict"] == "pending"
    bad = v2.Run(TASK, OPT, "fdg_k4", 2e-3, 0.1, v2.SEEDS[-1])
    put(tmp_path, bad, fdg_curve(2.0, 1.08), failed=True)
    report = v2.analyze(tmp_path)
    row = report["configs"][0]["K"]["4"]["bp"]
    assert (row["r_verdict"], row["gap_verdict"]) == ("fail", "pass") and row["failed"][0]["run"] == bad.name
    assert [f["run"] for f in report["failed_runs"]] == [bad.name] and f"`{bad.name}`" in report["markdown"]
    # a pair is two runs on one processor: an FDG run from another one leaves its seed missing
    other = v2.Run(TASK, OPT, "fdg_k4", 2e-3, 0.1, v2.SEEDS[1])
    result = read(other.path(tmp_path))
    assert result is not None
    write_result(other.path(tmp_path), {**result, "machine": {"cpu": "another"}})
    row = v2.analyze(tmp_path)["configs"][0]["K"]["4"]["bp"]
    assert row["missing_seeds"] == [v2.SEEDS[1]] and row["n"] == 6 and row["r_verdict"] == "fail"  # the failed one
    # the gap's own runs: a missing one pends, a failed one fails the gap
    eq = v2.Run(TASK, OPT, "fdg_k4_eq", *EQ_BEST, v2.SEEDS[0])
    eq.path(tmp_path).unlink()
    row = v2.analyze(tmp_path)["configs"][0]["K"]["4"]["bp"]
    assert row["gap"]["missing_seeds"] == [v2.SEEDS[0]] and row["gap_verdict"] == "pending"
    put(tmp_path, eq, bp_curve(2.0), failed=True)
    row = v2.analyze(tmp_path)["configs"][0]["K"]["4"]["bp"]
    assert row["gap_verdict"] == "fail" and row["gap"]["failed"][0]["run"] == eq.name and row["gap"]["n"] == 7


def test_power_and_the_screens_paired_spread(tmp_path: Path) -> None:
    assert v2.pooled_sd({"a": [1.0], "b": [2.0]}) is None
    assert v2.pooled_sd({"a": [1.0, 3.0], "b": [0.0, 1.0, 2.0], "c": [5.0]}) == pytest.approx(math.sqrt((2 + 2) / 3))
    folder = tmp_path / "llama"
    folder.mkdir()
    box = {"cpu": "x"}
    for seed, (bp, k4) in zip((200, 201), ((4.0, 4.1), (5.0, 5.0))):
        write_result(
            folder / f"adamw_bp_s{seed}.json", {"optimizer": "adamw", "seed": seed, "test": bp, "machine": box}
        )
        write_result(folder / f"adamw_k4_v1_s{seed}.json", {"optimizer": "adamw", "seed": seed, "test": k4,
                                                            "machine": box})  # fmt: skip
    write_result(folder / "muon_k4_none_s200.json", {"optimizer": "muon", "seed": 200, "test": 1.0, "machine": box})
    assert v2.screen_gaps(tmp_path) == {"llama/adamw_k4_v1": pytest.approx([2.5, 0.0])}  # muon: no bp, skipped
    table = v2.power_table(0.05, 0.3, ns=(8, 12), draws=500)
    assert table.count("  n  8: ") == 2 and table.count("  n 12: ") == 2 and "sd of the gap 0.3 points" in table
    assert "no spread given" in v2.power_table(0.05, None, ns=(8,), draws=100)
    # the power rises with n and with the headroom; with no spread it is certain
    assert v2.curve_runs.power(16, 0.05, 0.05, 2000) > v2.curve_runs.power(8, 0.05, 0.05, 2000)
    assert v2.curve_runs.power(8, 1e-9, 0.01, 200) == 1.0


# -- a real smoke run of each task ---------------------------------------------------------------------------


def _sources() -> dict[str, dict[str, list[str]]]:
    def source(name: str, lines: int) -> list[str]:
        return ["\n".join(f"{name} line {i} says the kernel frees {i % 7} pages" for i in range(lines))]

    return {"linux-doc": {"mm": source("mm", 600), ".": source("top", 100)},
            "joined": {p: source(p, 300) for p in ht.JOINED}}  # fmt: skip


def _mnist(cache: Path) -> dict[str, Any]:
    def images(n: int) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.float32) / n).view(n, 1, 1, 1).expand(n, 1, 28, 28)

    return {"images": {"train": images(60000), "t10k": images(10000)},
            "labels": {"train": torch.arange(60000) % 10, "t10k": torch.arange(10000) % 10}}  # fmt: skip


def test_a_few_ticks_of_each_task_on_stand_in_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ht, "auto_v2_sources", lambda cache=None: _sources())
    monkeypatch.setattr(tasks.mnist_data, "mnist", _mnist)
    monkeypatch.setattr(tasks, "LM_EVAL_BLOCKS", 16)
    monkeypatch.setattr(tasks, "VISION_EVAL", 64)
    evals = 2
    for run, budget in ((v2.Run("lm_llama", "adamw", "fdg_k4", 1e-3, 0.1, v2.TUNING_SEED), 4),
                        (v2.Run("lm_gpt2", "muon", "fdg_k8", 0.02, 0.0, 401), 4),
                        (v2.Run("vgg", "sgd", "fdg_k4", 0.1, 0.0, 401), 4),
                        (v2.Run("vgg", "sgd", "fdg_k4_eq", 0.1, 0.0, 401), 4),
                        (v2.Run("vgg", "sgd", "bp_a4", 0.1, 0.0, 401), 8)):  # fmt: skip
        result = v2.one_run(run, budget=budget, evals=evals, cache=tmp_path)
        n = budget * (v2.CAP if run.capped else 1)
        per = tasks.TASKS[run.task].per_micro
        assert "failed" not in result and result["micro_batches"] == n and result["split"] == run.split
        assert [t for t, _ in result["val"]] == [per * budget // evals * (i + 1) for i in range(n * evals // budget)]
        assert all(math.isfinite(v) for _, v in result["val"]) and result["final"] == result["val"][-1][1]
        if run.stages > 1:  # "auto" as the code defines it: its rule, its line and the keys per stage
            assert result["auto_rule"] == "v2" and 'corrections "auto"' in result["auto_choice"]
            assert len(result["auto_keys"]) == run.stages and result["fdg"]["corrections"] == "auto-v2"
        else:
            assert result["auto_choice"] is None and result["accumulate"] == 4
    with pytest.raises(ValueError, match="must split into 3 evaluation intervals"):
        v2.one_run(v2.Run("vgg", "sgd", "bp", 0.1, 0.0, 401), budget=4, evals=3, cache=tmp_path)
    with pytest.raises(ValueError, match="each a multiple of 4"):
        v2.one_run(v2.Run("vgg", "sgd", "bp_a4", 0.1, 0.0, 401), budget=4, evals=2, cache=tmp_path)
