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
