"""What FDG's lock-step costs when stage times vary from tick to tick, read from a trace.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.lockstep_jitter
    ... --trace out/lockstep/trace      # analyse a trace already written

Each FDG tick needs the neighbour's previous tick (activations down, gradients up), so at K = 2 a
tick lasts about as long as the slower of the two stages *in that tick*. With per-tick compute
c_0(t), c_1(t), a pipeline of perfectly equal stages with no jitter would tick at max(mean c_0,
mean c_1); the lock-step ticks at about mean over t of max(c_0(t), c_1(t)). The difference is what
the jitter costs, on top of the imbalance between the stages' means.

By default the script runs the ResNet recipe (ResNet-56, Fashion-MNIST, K = 2, the recipe's balanced
split, ``ds_configs/resnet_fdg_k2.json`` at micro-batch 32) under the ``deepspeed`` launcher with
``pipeline.fdg.trace`` recording ticks [40, 200) (``--model``, ``--start``, ``--ticks``), then reads the
per-rank traces. A stage's compute
in a tick is the sum of its traced instructions (forward, backward, step, reduce, load, exchange);
the rest of the tick, between the exchange and the next tick's first instruction, is where a stage
waits for the neighbour's exchange to complete. Prints one Markdown table, then the traced work
replayed (:func:`replay`): the mean tick in the engine's order, and what it would be if the last stage
sent its gradient right after its backward instead of at the end of its tick.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

from fdg_schedule.tools.launch import free_port, remove_shared_memory  # noqa: E402


def per_tick(events: list[dict[str, Any]]) -> tuple[dict[int, float], dict[int, float]]:
    """One rank's traced work per tick (ms) and the time its tick-end marker is reached (ms)."""
    work: dict[int, float] = defaultdict(float)
    ends: dict[int, float] = {}
    for event in events:
        if event.get("ph") == "X":
            work[event["args"]["tick"]] += event["dur"] / 1e3
        elif event.get("cat") == "tick":
            ends[event["args"]["tick"]] = event["ts"] / 1e3
    return dict(work), ends


def lockstep(ranks: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The jitter's cost from the traces of a K = 2 pipeline's two ranks (stage 0's first)."""
    (work0, ends0), (work1, _) = per_tick(ranks[0]), per_tick(ranks[1])
    # whole ticks on both ranks, with the tick before them ended on stage 0 (to measure the tick's length)
    ticks = [t for t in sorted(set(work0) & set(work1) & set(ends0)) if t - 1 in ends0]
    if len(ticks) < 2:
        raise ValueError(f"the traces share {len(ticks)} whole ticks; need at least 2")
    c0, c1 = [work0[t] for t in ticks], [work1[t] for t in ticks]
    slower_mean = max(statistics.mean(c0), statistics.mean(c1))
    mean_max = statistics.mean(max(a, b) for a, b in zip(c0, c1, strict=True))
    return {
        "ticks": len(ticks),
        "compute_ms": [statistics.mean(c0), statistics.mean(c1)],
        "compute_sd_ms": [statistics.stdev(c0), statistics.stdev(c1)],
        "tick_ms": statistics.mean(ends0[t] - ends0[t - 1] for t in ticks),
        "slower_mean_ms": slower_mean,
        "mean_of_max_ms": mean_max,
        "jitter_ms": mean_max - slower_mean,
    }


def _before_gradient_sent(events: list[dict[str, Any]]) -> dict[int, float]:
    """The last stage's work per tick up to the end of its backward, plus its exchange (ms): when its gradient
    could leave if it were sent right after the backward, before the gradient reduce and the optimizer step."""
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    before: dict[int, float] = defaultdict(float)
    backward_end: dict[int, float] = {}
    for e in spans:
        if e.get("cat") == "backward":
            backward_end[e["args"]["tick"]] = e["ts"] + e["dur"]
    for e in spans:
        tick = e["args"]["tick"]
        if e["ts"] + e["dur"] <= backward_end.get(tick, -1.0) or e.get("cat") == "exchange":
            before[tick] += e["dur"] / 1e3
    return dict(before)


def replay(ranks: list[list[dict[str, Any]]]) -> dict[str, float]:
    """A K = 2 pipeline replayed from the traced work per tick, as the engine orders a tick and as it would tick
    with the last stage's gradient sent right after its backward (same work, same dependencies otherwise).

    The engine: each tick starts when both stages have ended the tick before (stage 0 needs the gradient, stage 1
    the activation, each sent at the end of the neighbour's tick). The what-if: stage 0 waits only for stage 1's
    backward of the tick before; stage 1 still waits for stage 0's whole tick (its activation comes last).
    Returns the mean tick (ms) of each, over the traced ticks.
    """
    (work0, _), (work1, _) = per_tick(ranks[0]), per_tick(ranks[1])
    early = _before_gradient_sent(ranks[1])
    ticks = sorted(set(work0) & set(work1) & set(early))
    if len(ticks) < 2:
        raise ValueError(f"the traces share {len(ticks)} whole ticks; need at least 2")
    end0 = end1 = 0.0  # the engine's order: when each stage ends its tick
    if_end0 = if_end1 = 0.0  # the what-if
    last_start1: float | None = None
    last_early1 = 0.0
    engine, what_if = [], []
    for t in ticks:
        start = max(end0, end1)
        end0, end1 = start + work0[t], start + work1[t]
        engine.append(max(end0, end1))
        start1 = max(if_end1, if_end0)
        gradient_sent = if_end1 if last_start1 is None else last_start1 + last_early1
        start0 = max(if_end0, gradient_sent)
        if_end0, if_end1 = start0 + work0[t], start1 + work1[t]
        last_start1, last_early1 = start1, early[t]
        what_if.append(max(if_end0, if_end1))
    n = len(ticks) - 1
    return {
        "engine_order_ms": (engine[-1] - engine[0]) / n,
        "gradient_before_step_ms": (what_if[-1] - what_if[0]) / n,
    }


def run_recipe(out: Path, model: str, start: int, ticks: int, deadline_s: float) -> Path:
    """Train ``model`` at K = 2 with FDG under the deepspeed launcher, tracing ticks [start, start + ticks);
    the trace directory."""
    config = json.loads((ROOT / "ds_configs" / "resnet_fdg_k2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 32
    trace = out / "trace"
    config["pipeline"]["fdg"]["trace"] = {"start_tick": start, "ticks": ticks, "dir": str(trace)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    steps = start + ticks + 20
    port = free_port()  # not the launcher's default, which another job may hold
    command = [
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
        "recipes/train_resnet.py", "--model", model, "--epochs", "1", "--train-subset", "8192",
        "--test-subset", "256", "--max-steps", str(steps), "--deepspeed_config", str(out / "config.json"),
    ]  # fmt: skip
    # the launcher under a deadline, its process group killed past it
    from benchmarks.common.launchers import run_launchers

    try:
        run_launchers([command], deadline_s, out / "train.log")  # the log: train.node0.log
    finally:
        remove_shared_memory(port)
    return trace


def markdown(result: dict[str, Any]) -> str:
    (c0, c1), (s0, s1) = result["compute_ms"], result["compute_sd_ms"]
    share = 100 * result["jitter_ms"] / result["tick_ms"]
    header = (
        "| ticks | stage 0 compute ms (sd) | stage 1 compute ms (sd) | slower stage's mean "
        "| mean of the per-tick max | jitter's cost | measured tick |"
    )
    row = (
        f"| {result['ticks']} | {c0:.1f} ({s0:.1f}) | {c1:.1f} ({s1:.1f}) | {result['slower_mean_ms']:.1f} "
        f"| {result['mean_of_max_ms']:.1f} | {result['jitter_ms']:.1f} ({share:.1f} % of a tick) "
        f"| {result['tick_ms']:.1f} |"
    )
    return "\n".join([header, "|---:|---|---|---:|---:|---:|---:|", row])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None, help="read this trace directory instead of running the recipe")
    parser.add_argument("--out", default=str(ROOT / "out" / "lockstep"))
    parser.add_argument("--model", default="resnet56", help="the recipe's --model")
    parser.add_argument("--start", type=int, default=40, help="first traced tick (after warm-up)")
    parser.add_argument("--ticks", type=int, default=160, help="traced ticks")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds the recipe may run")
    args = parser.parse_args(argv)
    if args.trace:
        trace = Path(args.trace)
    else:
        trace = run_recipe(Path(args.out), args.model, args.start, args.ticks, args.deadline)
    ranks = [json.loads((trace / f"trace-rank{r}.json").read_text())["traceEvents"] for r in (0, 1)]
    print(markdown(lockstep(ranks)))
    what_if = replay(ranks)
    engine, early = what_if["engine_order_ms"], what_if["gradient_before_step_ms"]
    shorter = 100 * (1 - early / engine)
    print(
        f"\nReplayed from the traced work: {engine:.1f} ms a tick in the engine's order, {early:.1f} ms with the last "
        f"stage's gradient sent right after its backward (before its reduce and step): {shorter:.1f} % shorter."
    )


if __name__ == "__main__":
    main()
