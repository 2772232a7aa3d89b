"""Bounded memory over long runs: a stage never holds more than its delay in micro-batches.

The CI-sized test runs 300 ticks; ``pytest -m slow tests/test_soak.py -s`` runs 3,000 and prints
the figures quoted in docs/fdg.md.
"""

from __future__ import annotations

import json

import engine_workers
import pytest
from dist_harness import run_ranks

from fdg_schedule.sched import ticks


def _soak(tmp_path, n_ticks: int) -> list[dict]:
    case = {"stages": 3, "n": 16, "gas": 50, "ticks": n_ticks, "weights": "stashed", "activations": "stored"}
    results = run_ranks(engine_workers.soak, 3, tmp_path, case, deadline_s=1800)
    for r in results:
        delay = ticks.delay(3, r["stage_id"])
        assert max(r["in_flight"]) == delay and r["ticks"] == n_ticks
        steady = r["held"][1:]  # after the fill
        assert max(steady) == min(steady), "what a stage holds is the same every tick in steady state"
        rss = {"rss_mib_after_first_call": r["rss_kib"][0] / 1024, "rss_mib_end": r["rss_kib"][-1] / 1024}
        print(json.dumps({"stage": r["stage_id"], "delay": delay, "held_bytes": steady[-1], **rss}))
    return results


@pytest.mark.distributed
def test_held_state_is_bounded_by_the_delay(tmp_path) -> None:
    _soak(tmp_path, 300)


@pytest.mark.slow
def test_soak_thousands_of_ticks(tmp_path) -> None:
    results = _soak(tmp_path, 3000)
    for r in results:  # no growth after warm-up beyond allocator noise
        assert r["rss_kib"][-1] - r["rss_kib"][1] < 64 * 1024
