"""The time-to-loss verdicts (benchmarks/convergence/ttl_verdicts.py) apply the pre-registered rules exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.convergence import ttl_verdicts as tv

ANALYSIS = Path(__file__).resolve().parents[1] / "docs" / "results" / "time_to_loss" / "analysis.json"


def config(k: int, r: float | None, upper: float | None, interval: tuple[float, float] | None,
           nets: list[dict[str, Any]], n: int = 6, at_least: float | None = None, task: str = "lm",
           optimizer: str = "adamw") -> dict[str, Any]:  # fmt: skip
    against = {"r": r, "r_at_least": at_least, "upper_95": upper, "interval_95": None if interval is None else
               list(interval), "n": n, "n_planned": 6, "net_speedups": nets}  # fmt: skip
    return {"task": task, "optimizer": optimizer, "K": k, "against_bp_a4": against}


def predicted(key: str, ratio: float, cluster: str = "h100-ib") -> dict[str, Any]:
    return {"measured": False, "cluster": cluster, "model": "gpt-1.3b", "against": key, key: ratio, "net": None,
            "net_lower_95": None, "net_interval_95": None, "net_at_most": None}  # fmt: skip


@pytest.mark.parametrize(
    ("upper", "two_sided_end", "expected"),
    [
        (0.70, 0.75, "meets"),  # 1.04 / 0.75 = 1.387 >= 1.3
        (0.78, 0.82, "marginal"),  # 1.04 / 0.78 = 1.333 >= 1.3 > 1.04 / 0.82 = 1.268
        (0.81, 0.85, "missed"),  # 1.04 / 0.81 = 1.284 < 1.3
    ],
)
def test_the_three_verdicts_at_k4_use_the_bounds_of_r(upper: float, two_sided_end: float, expected: str) -> None:
    row = tv.row_verdict(config(4, 0.6, upper, (0.5, two_sided_end), [predicted("over_1f1b", 1.04)]))
    assert row["verdict"] == expected and row["goal"] == 1.3


def test_the_worst_cluster_decides_and_each_k_divides_by_its_own_ratio() -> None:
    nets = [predicted("over_1f1b", 1.5), predicted("over_best_sync", 0.9), predicted("over_1f1b", 1.1, "a100-100gbe")]
    row = tv.row_verdict(config(4, 0.8, 0.85, (0.75, 0.9), nets))  # 1.5 / 0.9 meets, 1.1 / 0.85 misses
    assert [s["verdict"] for s in row["sources"]] == ["meets", "missed"] and row["verdict"] == "missed"
    k8 = tv.row_verdict(config(8, 0.8, 0.85, (0.75, 0.9), nets))  # only the best-sync ratio: 0.9 / 0.85 < 1.1
    assert [s["ratio"] for s in k8["sources"]] == [0.9] and k8["verdict"] == "missed"


def test_a_seed_that_did_not_reach_is_missed_or_undecided_never_meets() -> None:
    # r > 1.1: 1.04 / 1.1 = 0.95 < 1.3 -> missed; with ratio 2.0: 2.0 / 1.1 = 1.8 >= 1.3 -> undecided
    assert tv.row_verdict(config(4, None, None, None, [predicted("over_1f1b", 1.04)], at_least=1.1))["verdict"] == (
        "missed"
    )
    assert tv.row_verdict(config(4, None, None, None, [predicted("over_1f1b", 2.0)], at_least=1.1))["verdict"] == (
        "undecided"
    )


def test_an_lm_row_counts_a_measured_ratio_only_with_its_own_optimizer() -> None:
    other = {"measured": True, "against": "ratio", "ratio": 1.2, "optimizer": "sgd", "optimizer_matches": False,
             "net": 2.0, "net_lower_95": 1.8, "net_interval_95": [1.7, 2.2], "net_at_most": None}  # fmt: skip
    row = tv.row_verdict(config(2, 0.6, 0.65, (0.55, 0.7), [other]))
    assert row["verdict"] == "pending" and row["sources"] == []
    resnet = tv.row_verdict(config(2, 0.6, 0.65, (0.55, 0.7), [other], task="resnet", optimizer="sgd"))
    assert resnet["verdict"] == "meets"  # a ResNet's SGD ratio is its own optimizer's (the flag is about LMs)


def test_a_row_without_every_seed_is_incomplete() -> None:
    row = tv.row_verdict(config(4, 0.6, 0.7, (0.5, 0.75), [predicted("over_1f1b", 1.04)], n=4))
    assert row["verdict"] == "incomplete" and "meets" in row["why"]


def test_the_committed_k2_adamw_row_meets_with_the_arithmetic_of_results_md() -> None:
    rows = tv.verdicts(json.loads(ANALYSIS.read_text()))
    first = rows[0]
    assert (first["task"], first["optimizer"], first["K"], first["verdict"]) == ("lm", "adamw", 2, "meets")
    (source,) = first["sources"]
    against = json.loads(ANALYSIS.read_text())["configs"][0]["against_bp_a4"]
    assert source["ratio"] / against["interval_95"][1] == pytest.approx(source["net_interval_95"][0])
    assert "| lm | adamw | 2 | ≥ 1 (ratio) | measured | 1.127 | 2.66 | 2.46 | 2.41–2.94 | meets |" in tv.table(rows)
