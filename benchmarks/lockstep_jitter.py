"""What FDG's lock-step costs when stage times vary from tick to tick, read from a trace.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/lockstep_jitter.py
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
waits for the neighbour's exchange to complete. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the package is in the repository root
    sys.path.insert(0, str(ROOT))

from fdg_schedule.launch import free_port, remove_shared_memory  # noqa: E402


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
    from multinode import run_launchers  # the launcher under a deadline, its process group killed past it

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


if __name__ == "__main__":
    main()
