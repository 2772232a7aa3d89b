"""benchmarks/common/: the helpers the throughput benchmarks share (table cells, the lock-step's cost, core binding)."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks.common.cores import bind_threads
from benchmarks.common.stats import lockstep_cost, spread


def test_lockstep_cost_is_the_mean_per_iteration_maximum_over_the_slower_mean() -> None:
    assert lockstep_cost([1.0, 3.0], [3.0, 1.0]) == pytest.approx(3 / 2 - 1)  # both average 2, the max is 3
    assert lockstep_cost([2.0, 2.0], [1.0, 1.0]) == pytest.approx(0)  # steady: only the slower one counts
    with pytest.raises(ValueError):
        lockstep_cost([1.0, 2.0], [1.0])  # one time per iteration on each side


def test_spread_is_the_scaled_median_and_range() -> None:
    assert spread([0.003, 0.001, 0.002], 1e3) == "2.0 [1.0–3.0]"
    assert spread([1.0, 1.25], digits=2) == "1.12 [1.00–1.25]"  # the median of two: their mean, rounded half even


def test_bind_threads_pins_every_thread_of_the_process() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    started, stop = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def other() -> None:
        started.set()
        stop.wait()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=other)
    thread.start()
    started.wait()
    try:
        bind_threads({core})
        assert os.sched_getaffinity(0) == {core}
    finally:
        stop.set()
        thread.join()
        bind_threads(before)
    assert seen == [{core}]  # the thread that was running already is bound too
