"""benchmarks/convergence/convergence.py's report from stored runs: paired differences, failed runs, kept analysis.

`--reuse --report-only` runs nothing, so this checks the table arithmetic without training.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONVERGENCE = [sys.executable, "-m", "benchmarks.convergence.convergence"]  # run from ROOT
SETTINGS = {"model": "resnet20", "dataset": "fashion-mnist", "epochs": 4, "train_subset": 2048, "test_subset": 1000}


def report(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [*CONVERGENCE, "--epochs", "4", "--seeds", "0", "1"]
    command += ["--variant", "BP", "--variant", "fdg:2:0.2:current", f"--out={out}", "--reuse", "--report-only"]
    return subprocess.run([*command, *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_report_from_stored_runs(tmp_path: Path) -> None:
    runs = {
        "BP": [{"seed": 0, "test_error": [0.4, 0.3, 0.25, 0.20]}, {"seed": 1, "test_error": [0.4, 0.35, 0.28, 0.24]}],
        "FDG K=2 β=0.2 current": [
            {"seed": 0, "test_error": [0.4, 0.3, 0.22, 0.21]},
            {"seed": 1, "failed": "FDGRuntimeError: x"},
        ],
    }
    results = [
        {"name": name, "stages": 1 if name == "BP" else 2, "runs": [{"samples_per_s": 100.0, **r} for r in rs]}
        for name, rs in runs.items()
    ]
    out = tmp_path / "conv"
    out.with_suffix(".json").write_text(
        json.dumps({"args": {**SETTINGS, "micro_batch": 32}, "wall_s": 60, "results": results})
    )
    out.with_suffix(".md").write_text(
        "old table\n<!-- analysis: written by hand, kept when the table is regenerated -->\nMINE\n"
    )

    done = report(out)
    assert done.returncode == 0, done.stderr[-2000:]
    md = out.with_suffix(".md").read_text()
    assert "| BP | 1 | 22.00% | ± 2.00% | +0.00% ± 0.00% | 26.50% | 100 |" in md  # 26.50%: at epoch 3 of 4
    assert (
        "| FDG K=2 β=0.2 current (seeds [0]) (failed: seeds [1]) | 2 | 21.00% | ± 0.00% | +1.00% ± 0.00% | 22.00% |"
        in md
    )
    assert "- FDG K=2 β=0.2 current, seed 1: `FDGRuntimeError: x`" in md
    assert "old table" not in md and md.endswith("MINE\n")  # the hand-written analysis survives

    other = report(out, "--train-subset", "4096")
    assert other.returncode != 0 and "made with other train_subset" in other.stderr + other.stdout


def test_report_keeps_unplanned_variants_and_reads_the_full_test_error(tmp_path: Path) -> None:
    """A --reuse call that plans only some variants keeps the others; the final column is the full
    test set's error where the run measured it, and reference runs are marked."""
    runs = {
        "BP": [{"seed": 0, "test_error": [0.4, 0.3], "full_test_error": 0.25, "backend": "reference"}],
        "FDG K=4 β=1 stashed, warm-up 2 ep, predict γ=0.9": [
            {"seed": 0, "test_error": [0.5, 0.3], "full_test_error": 0.27, "backend": "reference"}
        ],
    }
    results = [
        {"name": name, "stages": 1 if name == "BP" else 4, "runs": [{"samples_per_s": 50.0, **r} for r in rs]}
        for name, rs in runs.items()
    ]
    out = tmp_path / "conv"
    settings = {**SETTINGS, "epochs": 2, "micro_batch": 32, "final_full_test": True}
    out.with_suffix(".json").write_text(json.dumps({"args": settings, "wall_s": 60, "results": results}))
    command = [*CONVERGENCE, "--epochs", "2", "--seeds", "0"]
    command += ["--backend", "reference", "--final-full-test", "--variant", "BP", f"--out={out}"]
    done = subprocess.run([*command, "--reuse", "--report-only"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    md = out.with_suffix(".md").read_text()
    assert "| BP | 1† | 25.00% | ± 0.00% | +0.00% ± 0.00% | 30.00% | 50 |" in md
    assert "| FDG K=4 β=1 stashed, warm-up 2 ep, predict γ=0.9 | 4† | 27.00% | ± 0.00% | +2.00% ± 0.00% |" in md
    assert "whole test set" in md and "† run with `fdg_reference`" in md
    stored = json.loads(out.with_suffix(".json").read_text())
    assert [r["name"] for r in stored["results"]] == list(runs)  # the unplanned variant is still there


def test_unknown_correction_options_are_refused(tmp_path: Path) -> None:
    command = [*CONVERGENCE, f"--out={tmp_path / 'x'}"]
    done = subprocess.run([*command, "--variant", "fdg:2:1:stashed:speed=9"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and "unknown option 'speed=9'" in done.stderr
    done = subprocess.run(
        [*command, "--variant", "fdg:4:1:stashed:split=2/4/7"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode != 0 and "split=2/4/7: use paper, parameters, uniform or the stage boundaries" in done.stderr


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        # a split given as boundaries, and a peak lr
        (
            "fdg:4:1:stashed:momentum=1,peak_lr=0.1,split=0/2/4/7/12",
            "FDG K=4 β=1 stashed, delay_momentum, peak lr 0.1, 0/2/4/7/12 split",
        ),
        # the momentum raise
        (
            "fdg:4:1:stashed:raise=1,split=0/2/4/7/12,delay_lr=1024",
            "FDG K=4 β=1 stashed, momentum raise c=1, 0/2/4/7/12 split, delay_lr T=1024",
        ),
    ],
)
def test_correction_options_name_the_variant(tmp_path: Path, spec: str, name: str) -> None:
    out = tmp_path / "conv"
    command = [*CONVERGENCE, "--seeds", "0", f"--out={out}"]
    command += ["--variant", spec, "--reuse", "--report-only"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert name in out.with_suffix(".md").read_text()


def test_a_prediction_horizon_names_the_variant_and_needs_a_prediction(tmp_path: Path) -> None:
    out = tmp_path / "conv"
    command = [*CONVERGENCE, "--seeds", "0", f"--out={out}"]
    spec = "fdg:4:1:stashed:predict=0.0,horizon=first_stage"
    done = subprocess.run([*command, "--variant", spec, "--reuse", "--report-only"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "FDG K=4 β=1 stashed, predict γ=0.0, first_stage horizon" in out.with_suffix(".md").read_text()
    bad = subprocess.run([*command, "--variant", "fdg:2:1:stashed:horizon=first_stage", "--reuse", "--report-only"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "horizon=first_stage: use own or first_stage, with predict=GAMMA" in bad.stderr


def test_reuse_runs_again_what_a_signal_killed(tmp_path: Path) -> None:
    """A diverged run is a result and is kept; one the OOM killer stopped (exit code -9) is planned again."""
    results = [
        {
            "name": "FDG K=2 β=0.2 current",
            "stages": 2,
            "runs": [
                {"seed": 0, "failed": "FloatingPointError: non-finite loss"},
                {"seed": 1, "failed": "exit code -9"},
            ],
        }
    ]
    out = tmp_path / "conv"
    out.with_suffix(".json").write_text(
        json.dumps({"args": {**SETTINGS, "micro_batch": 32}, "wall_s": 1, "results": results})
    )
    command = [*CONVERGENCE, "--epochs", "4", "--seeds", "0", "1"]
    command += ["--variant", "fdg:2:0.2:current", f"--out={out}", "--reuse", "--max-ranks", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)  # K=2 > 1 rank: nothing runs
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.with_suffix(".json").read_text())["results"][0]["runs"]
    assert runs == [{"seed": 0, "failed": "FloatingPointError: non-finite loss"}]


def test_staleness_lines_are_read_back_and_tabled_per_stage(tmp_path: Path) -> None:
    """The recipe's per-epoch staleness line round-trips through fdg_schedule.tools.staleness_log, and the report
    tables each stage's median over seeds and epochs in three windows of the run."""
    from fdg_schedule.tools import staleness_log

    line = staleness_log.format_line({1: (2.5e-3, 7), 0: (1.25e-2, 8)})
    assert line == "staleness: stage 0 1.250e-02 (8), stage 1 2.500e-03 (7)"
    log = f"epoch 1/3: train_loss 1\n[rank0]:{line}\nepoch 2/3: train_loss 1\n"
    log += "epoch 3/3: x\nstaleness: stage 0 3e-02 (1)\n"
    assert staleness_log.per_epoch(log) == [{0: 1.25e-2, 1: 2.5e-3}, None, {0: 3e-2}]
    assert staleness_log.per_epoch("epoch 1/1: train_loss 1\n") == []

    def run(seed: int, stage0: list[float]) -> dict:
        epochs = [{"0": value, "1": value / 10} for value in stage0]
        return {"seed": seed, "test_error": [0.5, 0.4, 0.3, 0.2], "samples_per_s": 1.0, "staleness": epochs}

    results = [
        {
            "name": "BP",
            "stages": 1,
            "runs": [{"seed": s, "test_error": [0.5, 0.4, 0.3, 0.2], "samples_per_s": 1.0} for s in (0, 1)],
        },
        {
            "name": "FDG K=2 β=0.2 current",
            "stages": 2,
            "runs": [run(0, [1.0, 2.0, 3.0, 5.0]), run(1, [3.0, 4.0, 4.0, 8.0])],
        },
    ]
    out = tmp_path / "conv"
    out.with_suffix(".json").write_text(
        json.dumps({"args": {**SETTINGS, "micro_batch": 32}, "wall_s": 60, "results": results})
    )
    done = report(out)
    assert done.returncode == 0, done.stderr[-2000:]
    md = out.with_suffix(".md").read_text()
    assert "| method | stage | epochs 1–1 | epochs 2–2 | epochs 3–4 |" in md
    # stage 0: epoch 1 of both seeds (1, 3) -> 2; epoch 2 (2, 4) -> 3; epochs 3-4 (3, 5, 4, 8) -> 4.5
    assert "| FDG K=2 β=0.2 current | 0 | 2.00e+00 | 3.00e+00 | 4.50e+00 |" in md
    assert "|  | 1 | 2.00e-01 | 3.00e-01 | 4.50e-01 |" in md
    assert "| BP |" in md and "| BP | 0 |" not in md  # runs without the metric have no rows
