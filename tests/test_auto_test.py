"""benchmarks/convergence/auto_test.py, the pre-registered test of corrections "auto": its statistics, its queue's
bookkeeping (pairs on one machine only, a unit begun elsewhere run again whole) and one LM run end to end at a tiny
budget."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common.stats import t_quantile
from benchmarks.convergence import auto_test

ROOT = Path(__file__).resolve().parents[1]

HERE = {"cpu": "x", "vector": "avx2", "torch": "t", "deepspeed": "d", "python": "p"}


def _write(out: Path, task: str, arm: str, seed: int, test: float, machine: dict[str, str] = HERE, **extra) -> None:
    path = auto_test.run_path(out, task, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"task": task, "arm": arm, "seed": seed, "test": test, "validation": test,
                                "machine": machine, **extra}))  # fmt: skip


def test_the_report_pairs_seeds_on_one_machine_and_passes_a_task_only_when_complete_and_below_the_margin(
    tmp_path: Path,
) -> None:
    task = auto_test.TASKS["llama"]
    diffs = [0.5, -0.2, 0.3, 0.1, 0.0, 0.4, -0.1, 0.2]  # auto - BP, in %
    for seed, d in zip(task.seeds, diffs):
        _write(tmp_path, "llama", "bp", seed, 5.0)
        _write(tmp_path, "llama", "auto", seed, 5.0 * (1 + d / 100))
        _write(tmp_path, "llama", "none", seed, 5.0 * 1.04)
    stats = auto_test.paired(tmp_path, task, "auto")
    mean = sum(diffs) / 8
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 7)
    assert stats["n"] == 8 and stats["mean"] == pytest.approx(mean)
    assert stats["upper_95"] == pytest.approx(mean + 1.894579 * sd / math.sqrt(8), abs=1e-6)
    report = auto_test.report(tmp_path)["tasks"]["llama"]
    assert report["auto"]["passes"] and not report["none"]["passes"]  # none: +4 %, above the 2 % margin
    assert report["auto_minus_none"]["mean"] < 0
    # a pair whose arms ran on two machines is no pair: the task is incomplete, so it does not pass
    _write(tmp_path, "llama", "none", task.seeds[0], 5.2, {**HERE, "cpu": "other"})
    report = auto_test.report(tmp_path)["tasks"]["llama"]
    assert report["auto"]["n"] == 7 and not report["auto"]["passes"]
    # a failed run keeps its seed in the table and fails the task
    _write(tmp_path, "llama", "none", task.seeds[0], 5.2)
    _write(tmp_path, "llama", "auto", task.seeds[1], math.nan, failed="non-finite training loss")
    report = auto_test.report(tmp_path)["tasks"]["llama"]
    assert report["auto"]["failed"] == 1 and not report["auto"]["passes"]


def test_bp_chooses_its_warm_up_on_the_selection_seed_by_the_validation_metric(tmp_path: Path) -> None:
    assert auto_test.selection(tmp_path, "gpt2") is None
    _write(tmp_path, "gpt2", "bp_warmup", auto_test.SELECTION_SEED, 4.9)
    assert auto_test.selection(tmp_path, "gpt2") is None  # both runs are needed
    _write(tmp_path, "gpt2", "bp_nowarmup", auto_test.SELECTION_SEED, 5.0)
    assert auto_test.selection(tmp_path, "gpt2") is True
    _write(tmp_path, "gpt2", "bp_warmup", auto_test.SELECTION_SEED, 5.0, failed="diverged")
    assert auto_test.selection(tmp_path, "gpt2") is False


def test_a_unit_begun_on_another_machine_is_set_aside_and_a_finished_one_is_kept(tmp_path: Path) -> None:
    _write(tmp_path, "resnet32", "bp", 100, 9.0, {**HERE, "cpu": "other"})
    assert auto_test.unit_state(tmp_path, "resnet32", 100, auto_test.ARMS, HERE) == "partial elsewhere"
    auto_test.discard(tmp_path, "resnet32", 100, auto_test.ARMS)
    assert auto_test.unit_state(tmp_path, "resnet32", 100, auto_test.ARMS, HERE) == "todo"
    assert len(list((tmp_path / "resnet32" / "discarded").glob("bp_s100.*.json"))) == 1
    for arm in auto_test.ARMS:  # complete on another machine: a pair there, kept
        _write(tmp_path, "resnet32", arm, 101, 9.0, {**HERE, "cpu": "other"})
    assert auto_test.unit_state(tmp_path, "resnet32", 101, auto_test.ARMS, HERE) == "done"
    order = auto_test.units(tmp_path)
    assert [u[:2] for u in order[:3]] == [(t, auto_test.SELECTION_SEED) for t in auto_test.TASKS]
    assert len(order) == 3 + 24 + 8 + 8


@pytest.mark.timeout(120)
def test_one_llama_run_with_auto_at_a_tiny_budget(tmp_path: Path) -> None:
    """The LLaMA task's path end to end (the corpus needs Debian's bible-kjv; CI installs it): the K = 4 run on
    fdg_reference with the rule's choice from the cosine schedule's length, and finite test and validation losses."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.convergence.auto_test", "one", "--task", "llama", "--arm", "auto",
         "--seed", "1", "--smoke"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["bounds"] == [0, 3, 5, 6, 8] and math.isfinite(result["test"]) and math.isfinite(result["validation"])
    ticks = result["train_ticks"]
    assert f"delay_lr_ticks={2 * ticks}, delay_momentum_raise=1.0, predict_decay=0.0" in result["auto_choice"]


def test_the_resnet32_pass_is_marginal_as_the_docs_state() -> None:
    """Issue 64: from report.json's pairs, ResNet-32's "auto" passes one-sided (bound +0.494 < +0.5) but not under the
    two-sided 95 % interval (upper end +0.534), and 14 of the 24 leave-one-seed-out subsets' one-sided bounds reach
    the margin; docs/staleness.md states those numbers."""
    row = json.loads((ROOT / "docs" / "results" / "auto" / "report.json").read_text())["tasks"]["resnet32"]["auto"]
    diffs = [p["difference"] for p in row["pairs"]]

    def bound(values: list[float], p: float) -> float:
        n, mean = len(values), sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        return mean + t_quantile(p, n - 1) * sd / math.sqrt(n)

    assert len(diffs) == 24 and bound(diffs, 0.95) == pytest.approx(row["upper_95"], abs=1e-6)
    assert round(bound(diffs, 0.95), 3) == 0.494 and round(bound(diffs, 0.975), 3) == 0.534
    failing = sum(bound(diffs[:i] + diffs[i + 1 :], 0.95) >= 0.5 for i in range(len(diffs)))
    assert failing == 14
    staleness = (ROOT / "docs" / "staleness.md").read_text()
    assert "+0.534" in staleness and "14 of 24" in staleness
