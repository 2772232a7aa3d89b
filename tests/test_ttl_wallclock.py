"""The end-to-end time-to-loss benchmark (benchmarks/convergence/ttl_wallclock.py): its jobs and its arithmetic.

The jobs themselves are DeepSpeed runs of recipes/train_lm.py (tests/test_zoo_lm.py runs the recipe, --target_loss
included); here the analysis reads metrics.jsonl files written by hand with a known time to the loss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.convergence import ttl_wallclock as wc
from fdg_schedule.base import config as fdg_config


def write_run(out: Path, arm: str, seed: int, evals: list[tuple[float, float, float]]) -> None:
    """metrics.jsonl with evaluations (tokens, loss, train_s) and a training row before each, and done.json."""
    run = wc.folder(out, arm, seed)
    run.mkdir(parents=True)
    rows = []
    for i, (tokens, loss, train_s) in enumerate(evals):
        rows.append({"step": i, "tokens": tokens, "train_loss": loss + 0.1, "time": train_s + i, "train_s": train_s})
        rows.append({"step": i, "tokens": tokens, "val_loss": loss, "time": train_s + i + 0.5, "train_s": train_s})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "done.json").write_text("{}")


def test_the_two_jobs_differ_only_in_the_schedule_and_the_schedulers_length() -> None:
    base, fdg = wc.ds_config("1f1b"), wc.ds_config("fdg")
    assert base["scheduler"]["params"]["total_num_steps"] == wc.BUDGET // wc.GAS == 256
    assert fdg["scheduler"]["params"]["total_num_steps"] == wc.CAP * wc.BUDGET == 2048  # a step per micro-batch
    assert (
        fdg["scheduler"]["params"]["warmup_num_steps"] == 204 and base["scheduler"]["params"]["warmup_num_steps"] == 25
    )
    for config in (base, fdg):
        config.pop("scheduler")
    assert fdg.pop("pipeline") == {"stages": 2, "schedule": "fdg", "fdg": wc.FDG}
    assert base.pop("pipeline") == {"stages": 2} and base == fdg
    parsed = fdg_config.parse(wc.ds_config("fdg"))
    assert parsed is not None and (parsed.corrections, parsed.weights, parsed.accumulate) == ("auto", "stashed", 1)


def test_the_fdg_job_stops_at_its_seeds_1f1b_loss(tmp_path: Path) -> None:
    write_run(tmp_path, "1f1b", 7, [(100.0, 6.0, 10.0), (200.0, 5.5, 20.0)])
    (tmp_path / "perl_docs.txt").write_text("text")  # prepare() finds both files and builds nothing
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text("{}")
    argv = wc.command(tmp_path, "fdg", 7, 29500, wc.curve(wc.folder(tmp_path, "1f1b", 7))[-1]["loss"])
    assert "--target_loss=5.5" in argv and f"--max_steps={wc.CAP * wc.BUDGET // wc.GAS}" in argv
    assert not any(a.startswith("--target_loss") for a in wc.command(tmp_path, "1f1b", 7, 29500, None))


def test_net_speed_up_is_the_inverse_time_ratio_read_off_the_training_seconds(tmp_path: Path) -> None:
    # seed 1: 1F1B ends at loss 5.0 after 100 s; FDG crosses 5.0 halfway between (40 s, 5.2) and (60 s, 4.8):
    # at 50 s and 3,000 tokens, so time ratio 0.5 and net 2; r = 3,000 / 8,000
    write_run(tmp_path, "1f1b", 1, [(4000.0, 5.5, 50.0), (8000.0, 5.0, 100.0)])
    write_run(tmp_path, "fdg", 1, [(2000.0, 5.2, 40.0), (4000.0, 4.8, 60.0)])
    # seed 2: FDG crosses at 80 s of 1F1B's 100: net 1.25
    write_run(tmp_path, "1f1b", 2, [(4000.0, 5.5, 50.0), (8000.0, 5.0, 100.0)])
    write_run(tmp_path, "fdg", 2, [(4000.0, 5.1, 70.0), (6000.0, 4.9, 90.0)])
    report = wc.analyze(tmp_path, [1, 2, 3])  # seed 3 has no runs: left out
    one, two = report["seeds"]
    assert report["n"] == 2 and one["net"] == pytest.approx(2.0) and one["r"] == pytest.approx(3000 / 8000)
    assert one["samples_per_s_ratio"] == pytest.approx((4000 / 60) / (8000 / 100))
    assert two["net"] == pytest.approx(1.25) and report["net"]["value"] == pytest.approx(math.sqrt(2.0 * 1.25))
    low, high = report["net"]["interval_95"]
    assert low < report["net"]["lower_95"] < report["net"]["value"] < high
    assert "| 1 | 5.0000 | 100.0 | 50.0 | 2.00 | 0.375 |" in wc.table(report)


def test_a_seed_that_never_reaches_bounds_the_net_speed_up_above(tmp_path: Path) -> None:
    write_run(tmp_path, "1f1b", 1, [(8000.0, 5.0, 100.0)])
    write_run(tmp_path, "fdg", 1, [(8000.0, 5.3, 90.0), (16000.0, 5.1, 180.0)])  # never 5.0: cap 180 / 100
    report = wc.analyze(tmp_path, [1])
    assert report["seeds"][0]["net"] is None and report["net"]["value"] is None
    assert report["net"]["at_most"] == pytest.approx(100 / 180)
    assert "net speed-up < 0.56x" in wc.table(report)


def test_backprop_is_one_rank_a_step_per_micro_batch_and_its_fdg_job_stops_at_its_loss(tmp_path: Path) -> None:
    bp = wc.ds_config("bp")
    assert bp["pipeline"] == {"stages": 1} and bp["gradient_accumulation_steps"] == 1
    assert bp["scheduler"]["params"]["total_num_steps"] == wc.BUDGET == 1024
    assert wc.ds_config("fdg_bp") == wc.ds_config("fdg")  # the same FDG job, timed to another loss
    write_run(tmp_path, "bp", 7, [(100.0, 6.0, 10.0), (200.0, 4.75, 20.0)])
    (tmp_path / "perl_docs.txt").write_text("text")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text("{}")
    argv = wc.command(tmp_path, "bp", 7, 29500, None)
    assert "--num_gpus=1" in argv and "--max_steps=1024" in argv and "--eval_interval=64" in argv
    fdg = wc.command(tmp_path, "fdg_bp", 7, 29500, wc.curve(wc.folder(tmp_path, "bp", 7))[-1]["loss"])
    assert "--num_gpus=2" in fdg and "--target_loss=4.75" in fdg and "--max_steps=512" in fdg


def test_analyze_pairs_each_baseline_with_its_own_fdg_job(tmp_path: Path) -> None:
    write_run(tmp_path, "1f1b", 1, [(8000.0, 5.0, 100.0)])
    write_run(tmp_path, "fdg", 1, [(4000.0, 4.9, 50.0)])  # net 2 against 1F1B
    write_run(tmp_path, "bp", 1, [(8000.0, 4.5, 200.0)])
    write_run(tmp_path, "fdg_bp", 1, [(4000.0, 4.7, 50.0), (8000.0, 4.5, 100.0)])  # net 2 against BP, r 1
    against_bp = wc.analyze(tmp_path, [1], "bp")
    assert against_bp["baseline"] == "bp" and against_bp["seeds"][0]["net"] == pytest.approx(2.0)
    assert against_bp["seeds"][0]["r"] == pytest.approx(1.0) and wc.analyze(tmp_path, [1])["seeds"][0]["r"] == 0.5
    assert wc.table(against_bp).startswith("| seed | BP final loss | BP training s |")
    wc.main(["analyze", "--out", str(tmp_path), "--seeds", "1", "--against", "1f1b,bp", "--json", str(tmp_path / "r")])
    assert set(json.loads((tmp_path / "r").read_text())) == {"1f1b", "bp"}
    with pytest.raises(SystemExit):
        wc.main(["analyze", "--out", str(tmp_path), "--against", "gpipe"])


def test_each_job_takes_its_own_lr_and_warm_up_and_muon_is_deepspeeds_with_the_tests_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lr, warmup = wc.per_job("1f1b=0.04,fdg=0.02", "--lr"), wc.per_job("fdg=0", "--warmup")
    assert (wc.own(lr, "1f1b", 9.0), wc.own(lr, "fdg", 9.0), wc.own(lr, "fdg_bp", 9.0), wc.own(lr, "bp", 9.0)) == (
        0.04, 0.02, 0.02, 9.0)  # fmt: skip
    assert wc.own(warmup, "fdg", 0.1) == 0.0 and wc.own(warmup, "1f1b", 0.1) == 0.1
    config = wc.ds_config("fdg", 0.02, 0.0, "muon")
    assert config["optimizer"] == {
        "type": "Muon",
        "params": {
            "muon_lr": 0.02,
            "momentum": 0.95,
            "adam_lr": 1e-3,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
        },
    }
    assert config["scheduler"]["params"]["warmup_num_steps"] == 1  # no warm-up: one step, as the test's runs
    assert wc.ds_config("1f1b")["optimizer"]["params"]["lr"] == wc.LR == wc.DEFAULT_LR["adamw"] == 2e-3
    monkeypatch.setattr(wc, "OPTIMIZER", "muon")
    monkeypatch.setattr(wc, "JOB_LR", lr)
    monkeypatch.setattr(wc, "JOB_WARMUP", warmup)
    lrs = {arm: wc.job_config(arm)["optimizer"]["params"]["muon_lr"] for arm in wc.JOBS}
    assert lrs == {"1f1b": 0.04, "fdg": 0.02, "bp": 0.02, "fdg_bp": 0.02}  # bp unnamed: Muon's default, not AdamW's
    assert wc.job_config("fdg_bp")["scheduler"]["params"]["warmup_num_steps"] == 1  # fdg's warm-up, 0
    for bad in ("gpipe=0.1", "fdg=fast"):
        with pytest.raises(ValueError, match="--lr"):
            wc.per_job(bad, "--lr")
    with pytest.raises(SystemExit):
        wc.main(["run", "--out", str(tmp_path), "--lr", "fdg=fast"])


def test_the_resnet_task_runs_the_resnet_recipe_with_the_tests_model_split_and_sgd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wc, "TASK", "resnet")
    monkeypatch.setattr(wc, "OPTIMIZER", "sgd")
    monkeypatch.setattr(wc, "mnist_folder", lambda: tmp_path / "mnist")
    config = wc.ds_config("fdg", 0.1, 0.0, "sgd")
    assert config["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_clipping"]) == (32, 0.0)
    assert config["pipeline"] == {"stages": 2, "schedule": "fdg", "fdg": wc.FDG}
    fdg = wc.command(tmp_path, "fdg", 301, 29500, 0.25)
    assert fdg[3] == "recipes/train_resnet.py" and "--target-loss=0.25" in fdg
    metrics = wc.folder(tmp_path, "fdg", 301) / "metrics.jsonl"
    for flag in ("--dataset=mnist", "--model=resnet20", "--train-subset=16384", "--val-images=2048",
                 "--partition=parts:0,6,12", "--max-steps=512", "--eval-interval=16", "--epochs=4", "--seed=301",
                 f"--data-dir={tmp_path / 'mnist'}", f"--metrics={metrics}"):  # fmt: skip
        assert flag in fdg, flag
    bp = wc.command(tmp_path, "bp", 301, 29500, None)  # one rank, a step per micro-batch: 1,024 calls, 2 epochs
    assert {"--num_gpus=1", "--max-steps=1024", "--eval-interval=64", "--epochs=2"} <= set(bp)
    assert not any(a.startswith(("--target-loss", "--partition")) for a in bp)
    with pytest.raises(SystemExit):
        wc.main(["run", "--task", "resnet", "--optimizer", "muon", "--out", str(tmp_path)])


def test_tune_chooses_by_the_tests_rules_and_goes_past_an_edge_while_it_improves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each grid point's run is written by hand: the baselines pick their lowest final loss (1f1b past the top edge,
    0.2 then 0.4, and it stops when 0.8 is worse); FDG the point that reaches 1f1b's loss in the fewest images."""
    monkeypatch.setattr(wc, "TASK", "resnet")
    monkeypatch.setattr(wc, "OPTIMIZER", "sgd")
    final = {("1f1b", 0.2, 0.1): 0.30, ("1f1b", 0.4, 0.1): 0.25, ("1f1b", 0.8, 0.1): 0.26,
             ("bp", 0.1, 0.0): 0.20, ("bp", 0.05, 0.0): 0.21}  # fmt: skip
    fdg_reach = {(0.1, 0.1): 1000.0, (0.05, 0.0): 800.0}  # images at which FDG's curve crosses 0.25
    ran = []

    def fake_run(out: Path, arm: str, seed: int, setting: tuple[float, float], target: float | None) -> None:
        ran.append((arm, *setting))
        assert seed == 300 and (target == 0.25) == (arm == "fdg")
        if arm == "fdg":
            at = fdg_reach.get(setting)
            evals = [(500.0, 0.5, 5.0), (at, 0.25, 9.0)] if at else [(500.0, 0.5, 5.0), (2048.0, 0.3, 20.0)]
        else:
            evals = [(500.0, 0.9, 5.0), (1024.0, final.get((arm, *setting), 0.35), 10.0)]
        run = wc.point_folder(out, arm, *setting)
        run.mkdir(parents=True)
        rows = [{"samples": s, "val_loss": v, "train_s": t} for s, v, t in evals]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "done.json").write_text("{}")

    monkeypatch.setattr(wc, "run_one", fake_run)
    choices = wc.tune(tmp_path)
    assert choices["lr"] == {"1f1b": 0.4, "fdg": 0.05, "bp": 0.1} and choices["fdg_target"] == 0.25
    assert choices["warmup"] == {"1f1b": 0.1, "fdg": 0.0, "bp": 0.0}
    assert [r for r in ran if r[0] == "1f1b"][6:] == [("1f1b", 0.4, 0.1), ("1f1b", 0.8, 0.1)]  # two steps past 0.2
    assert [r for r in ran if r[0] == "fdg"][6:] == [("fdg", 0.025, 0.0)]  # 0.05 at the lower edge: one step, later
    assert len([r for r in ran if r[0] == "bp"]) == 6  # 0.1 is inside the grid
    assert json.loads((tmp_path / "choices.json").read_text())["lr"] == choices["lr"]
    ran.clear()
    assert wc.tune(tmp_path) == {**choices, "commit": choices["commit"]} and ran == []  # restartable: nothing reruns
    monkeypatch.setattr(wc, "JOB_LR", {})
    monkeypatch.setattr(wc, "JOB_WARMUP", {})
    monkeypatch.setattr(wc, "run_all", lambda out, seeds, against: None)
    wc.main(["run", "--task", "resnet", "--out", str(tmp_path), "--choices", str(tmp_path / "choices.json")])
    assert choices["lr"] == wc.JOB_LR and choices["warmup"] == wc.JOB_WARMUP
    with pytest.raises(SystemExit):  # tuned for another task
        wc.main(["run", "--out", str(tmp_path), "--choices", str(tmp_path / "choices.json")])
