"""benchmarks/throughput/lockstep_jitter.py: the lock-step's jitter cost read from two ranks' traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.throughput.lockstep_jitter import lockstep, replay


def rank_trace(work_ms: list[list[float]], tick_ends_ms: list[float]) -> list[dict]:
    """Spans (ms) per tick, as pipeline.fdg.trace writes them (µs), and each tick's end marker."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "stage"}}]
    for tick, (spans, end) in enumerate(zip(work_ms, tick_ends_ms, strict=True)):
        events += [{"ph": "X", "cat": "forward", "ts": 0.0, "dur": 1e3 * d, "args": {"tick": tick}} for d in spans]
        events.append({"ph": "i", "cat": "tick", "ts": 1e3 * end, "args": {"tick": tick}})
    return events


def test_the_cost_is_the_mean_per_tick_maximum_over_the_slower_stages_mean() -> None:
    # stage 0 computes 10 + 2, 20, 10, 20 ms; stage 1 20, 10, 20, 10: both average 15, their per-tick maximum is 20
    stage0 = rank_trace([[10, 2], [20], [10], [20]], [0, 21, 42, 63])
    stage1 = rank_trace([[20], [10], [20], [10]], [0, 21, 42, 63])
    result = lockstep([stage0, stage1])
    assert result["ticks"] == 3  # tick 0 has no tick before it to measure from
    assert result["compute_ms"] == pytest.approx([50 / 3, 40 / 3])
    assert result["slower_mean_ms"] == pytest.approx(50 / 3)
    assert result["mean_of_max_ms"] == pytest.approx(20)
    assert result["jitter_ms"] == pytest.approx(20 - 50 / 3)
    assert result["tick_ms"] == pytest.approx(21)


def test_equal_steady_stages_cost_nothing() -> None:
    steady = rank_trace([[15]] * 4, [0, 16, 32, 48])
    assert lockstep([steady, steady])["jitter_ms"] == pytest.approx(0)


def test_too_few_shared_ticks_is_an_error() -> None:
    with pytest.raises(ValueError, match="share 1 whole ticks"):
        lockstep([rank_trace([[1], [1]], [0, 2]), rank_trace([[1], [1]], [0, 2])])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_the_script_traces_a_recipe_run_and_prints_the_table(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "benchmarks.throughput.lockstep_jitter", "--model", "resnet20"]
    command += ["--start", "4", "--ticks", "6", "--out", str(tmp_path), "--deadline", "200"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # with the launcher's log tail
    lines = done.stdout.strip().splitlines()
    assert lines[-3].startswith("| 5 |"), done.stdout  # ticks 5 to 9: tick 4 has no traced tick before it
    assert lines[-1].startswith("Replayed from the traced work: "), done.stdout  # then the what-if
    assert json.loads((tmp_path / "config.json").read_text())["pipeline"]["fdg"]["trace"]["ticks"] == 6


def spans_trace(ticks: list[list[tuple[str, float]]]) -> list[dict]:
    """One rank's trace from (kind, ms) spans per tick, laid end to end (the replay reads only their order)."""
    events: list[dict] = []
    now = 0.0
    for tick, spans in enumerate(ticks):
        for cat, ms in spans:
            events.append({"ph": "X", "cat": cat, "ts": 1e3 * now, "dur": 1e3 * ms, "args": {"tick": tick}})
            now += ms
        events.append({"ph": "i", "cat": "tick", "ts": 1e3 * now, "args": {"tick": tick}})
    return events


def test_the_replay_in_the_engines_order_and_with_the_gradient_sent_before_the_step() -> None:
    # stage 0 computes 12, 8, 12, ... ms; stage 1 10 ms, of which its backward ends at 6 (then reduce, step, exchange)
    stage0 = spans_trace([[("backward", 7.0), ("forward", 5.0 if t % 2 == 0 else 1.0)] for t in range(41)])
    tick1 = [("forward", 2.0), ("backward", 4.0), ("reduce", 1.0), ("step", 3.0), ("exchange", 0.0)]
    stage1 = spans_trace([tick1] * 41)
    result = replay([stage0, stage1])
    # the engine: every tick waits for the slower stage's previous tick, max(12, 10) then max(8, 10): 11 ms a tick
    assert result["engine_order_ms"] == pytest.approx(11.0)
    # the gradient leaves stage 1 at 6 ms: stage 0's 12 ms tick overlaps the rest of stage 1's, 10 ms a tick
    assert result["gradient_before_step_ms"] == pytest.approx(10.0)
