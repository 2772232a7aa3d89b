"""benchmarks/common/throughput_report.py: the 95 % confidence interval of a paired ratio's median."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.common.throughput_report import median_ci95


def coverage(n: int, j: int) -> float:
    """P(x_(j) <= median <= x_(n+1-j)) for n independent draws of any continuous distribution."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n


@pytest.mark.parametrize("n", range(1, 31))
def test_the_interval_is_the_narrowest_pair_of_order_statistics_with_95_percent_coverage(n: int) -> None:
    got = median_ci95([float(i) for i in range(n)])  # x_(i+1) = i
    if n < 6:
        assert got is None  # even [min, max] covers < 95 %
        assert coverage(n, 1) < 0.95
        return
    assert got is not None
    j = int(got[0]) + 1
    assert got[1] == n - j  # symmetric: x_(j), x_(n+1-j)
    assert coverage(n, j) >= 0.95 > coverage(n, j + 1)


def test_known_table_values_and_unsorted_input() -> None:
    # the textbook table: n = 12 -> x_(3), x_(10); n = 20 -> x_(6), x_(15)
    values = [float(i) for i in range(12)]
    random.Random(0).shuffle(values)
    assert median_ci95(values) == (2.0, 9.0)
    assert median_ci95([float(i) for i in range(20)]) == (5.0, 14.0)


def test_it_covers_a_skewed_distributions_median_at_least_95_percent_of_the_time() -> None:
    rng = random.Random(1)
    hits = 0
    for _ in range(4000):
        lo, hi = median_ci95([rng.expovariate(1.0) for _ in range(12)]) or (math.nan, math.nan)
        hits += lo <= math.log(2) <= hi
    assert hits / 4000 > 0.94  # exactly 0.961 for n = 12; 4,000 draws put the estimate within ±0.01


def test_the_calls_summary_lists_fdg_by_transport_and_gas_and_stars_only_what_meets_the_targets(tmp_path) -> None:
    """benchmarks/throughput/calls_summary.py (issue 62): one row per FDG stored variant of a --fdg-gas list."""
    import json

    from benchmarks.throughput.calls_summary import summary

    def row(ceiling: float, one_f: float) -> dict:
        spread = lambda m: {"median": m, "min": m - 0.01, "max": m + 0.01}  # noqa: E731
        return {"samples_per_s_all": [1.0] * 6, "ratio_vs_halves": spread(ceiling), "ratio_vs_1f1b_m4": spread(one_f)}

    variants = {
        "fdg_current_stored_g4": row(0.94, 1.25),
        "fdg_current_stored_g16": row(0.9496, 1.25),  # rounds to 0.95 at two places, yet misses the target
        "fdg_current_stored_shm_g4": row(0.96, 1.21),
        "fdg_current_stored_shm_g16": row(0.97, 1.05),
        "fdg_current_recomputed_g4": row(0.5, 0.5),  # not a stored variant: left out
        "halves": {"samples_per_s_all": [1.0] * 6},
    }
    report = {"models": {"plainconv": {"variants": variants}}, "engine": "abc", "date": "d", "command": "c",
              "load_start": [1.0], "load_end": [2.0]}  # fmt: skip
    path = tmp_path / "plainconv" / "throughput.json"
    path.parent.mkdir()
    path.write_text(json.dumps(report))
    lines = summary([path]).splitlines()
    table = [line for line in lines if line.startswith("| plainconv")]
    assert table == [
        "| plainconv | process group | 4 | 6 | 0.940 [0.93–0.95] | 1.250* [1.24–1.26] |",
        "| plainconv | process group | 16 | 6 | 0.950 [0.94–0.96] | 1.250* [1.24–1.26] |",
        "| plainconv | shm | 4 | 6 | 0.960* [0.95–0.97] | 1.210* [1.20–1.22] |",
        "| plainconv | shm | 16 | 6 | 0.970* [0.96–0.98] | 1.050 [1.04–1.06] |",
    ]
    assert any("engine abc" in line and "load 1.0 → 2.0" in line for line in lines)


def test_the_calls_summary_reads_a_run_of_one_gas_and_states_the_medians_confidence_interval(tmp_path) -> None:
    """With one --fdg-gas the variants carry no ``_g<N>`` suffix: the summary takes the GAS from the report."""
    import json

    from benchmarks.throughput.calls_summary import summary

    ratio = lambda m, lo, hi: {"median": m, "min": m - 0.02, "max": m + 0.02, "ci95": [lo, hi]}  # noqa: E731
    variants = {
        "fdg_current_stored_shm": {"samples_per_s_all": [1.0] * 12, "ratio_vs_halves": ratio(0.981, 0.954, 0.996),
                                   "ratio_vs_1f1b_m4": ratio(1.27, 1.245, 1.293)},
        "fdg_current_stored_shm_predict": {"samples_per_s_all": [1.0] * 12},  # another variant: left out
    }  # fmt: skip
    report = {"models": {"mlp_1024": {"variants": variants}}, "fdg_gas": 4, "engine": "abc", "date": "d",
              "command": "c", "load_start": [1.0], "load_end": [2.0]}  # fmt: skip
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps(report))
    table = [line for line in summary([path]).splitlines() if line.startswith("| mlp_1024")]
    assert table == [
        "| mlp_1024 | shm | 4 | 12 | 0.981* [0.96–1.00] (CI 0.954–0.996) | 1.270* [1.25–1.29] (CI 1.245–1.293) |"
    ]


def test_the_throughput_benchmark_refuses_a_variant_name_it_does_not_have(capsys) -> None:
    """A variant named for several --fdg-gas values (``_g4``) in a run of one would silently drop out of it."""
    import signal

    from benchmarks.throughput.throughput import main

    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            main(["--models", "plainconv", "--fdg-gas", "4", "--variants", "halves,fdg_current_stored_shm_g4"])
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert "['fdg_current_stored_shm_g4']" in err and "fdg_current_stored_shm'" in err


def test_the_throughput_benchmark_refuses_an_optimizer_it_does_not_build(capsys) -> None:
    import signal

    from benchmarks.throughput.throughput import main

    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            main(["--models", "plainconv", "--optimizer", "adam"])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert "--optimizer 'adam' is not an optimizer the benchmark builds: use one of sgd, adamw, muon" in (
        capsys.readouterr().err
    )
