"""FDG on torch's own pipelining next to torch's 1F1B and zero-bubble schedules, K = 2, side by side in one run.

    export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.torch_native                   # transformer and widemlp (a few minutes)
    python -m benchmarks.throughput.torch_native --quick           # a tiny model, one short round: a smoke run

One process tree of 2 gloo ranks (one thread each) builds every variant of a model once, warms each up, then
runs them interleaved for ``--repeats`` rounds (the order rotates every round, so drift on this shared machine
falls on all variants alike). Every variant gets the same micro-batches, ``--steps`` calls of m each:

    torch_1f1b_m{4,8}   torch's Schedule1F1B, the layers cut in two halves by count, then optimizer.step() per rank
    torch_zbv_m{4,8}    torch's ScheduleZBVZeroBubble: the layers cut in four quarters, rank 0 holding 0 and 3,
                        rank 1 holding 1 and 2 (torch's zero-bubble schedule for one pipeline of two ranks; each
                        quarter must hold parameters: a model of at least four layers with them)
    fdg_m{4,8}          fdg_schedule.torch_pipelining.ScheduleFDG on the 1F1B halves ("current" weights, "stored"
                        activations, grad_shrink 0.5): an optimizer step per stage per tick, nothing flushed

Wall time is the slowest rank's, between barriers; each variant has its own process group, so FDG's receives
posted for its next call cannot take another variant's messages. Inputs are fixed synthetic tensors
(benchmarks/common/bench_models.py). Output: ``<out>/torch_native.json`` and ``<out>/torch_native.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, before torch is imported

import torch  # noqa: E402

from fdg_schedule.tools.launch import run  # noqa: E402

LR, MOMENTUM, GRAD_SHRINK = 0.01, 0.9, 0.5
MICRO_BATCHES = (4, 8)


def _cut(layers: list[Any], parts: int) -> list[torch.nn.Sequential]:
    """``layers`` in ``parts`` consecutive pieces of (nearly) equal layer count."""
    bounds = [round(i * len(layers) / parts) for i in range(parts + 1)]
    return [torch.nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _build(rank: int, name: str, m: int, model: str) -> tuple[Any, list[Any], Any]:
    """One variant on this rank: its schedule, its optimizers and the process group it talks in."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    from benchmarks.common.bench_models import build_layers, loss_fn
    from fdg_schedule.torch_pipelining import ScheduleFDG

    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    layers = build_layers(model)
    cpu, loss = torch.device("cpu"), loss_fn(model)
    if name.startswith("torch_zbv"):
        quarters = _cut(layers, 4)
        held = [quarters[rank], quarters[3 - rank]]
        stages = [PipelineStage(q, i, 4, cpu, group=group) for q, i in zip(held, (rank, 3 - rank))]
        optimizers = [torch.optim.SGD(q.parameters(), lr=LR, momentum=MOMENTUM) for q in held]
        return ScheduleZBVZeroBubble(stages, m, loss_fn=loss), optimizers, group
    half = _cut(layers, 2)[rank]
    stage = PipelineStage(half, rank, 2, cpu, group=group)
    optimizer = torch.optim.SGD(half.parameters(), lr=LR, momentum=MOMENTUM)
    if name.startswith("fdg"):
        return ScheduleFDG(stage, m, loss, optimizer, grad_shrink=GRAD_SHRINK), [], group
    return Schedule1F1B(stage, m, loss_fn=loss), [optimizer], group


def _call(rank: int, name: str, schedule: Any, optimizers: list[Any], x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step of ``m`` micro-batches: rank 0 holds the first stage (and, under ZBV, the last)."""
    zbv = name.startswith("torch_zbv")
    if rank == 0:
        schedule.step(x, target=y) if zbv else schedule.step(x)
    else:
        schedule.step() if zbv else schedule.step(target=y)
    for optimizer in optimizers:  # torch's schedules leave the update to the loop; FDG steps inside
        optimizer.step()
        optimizer.zero_grad()


def worker(rank: int, world: int, model: str, steps: int, repeats: int) -> dict[str, Any]:
    """Build every variant, warm each up with one call, then time ``repeats`` interleaved rounds."""
    import torch.distributed as dist

    from benchmarks.common.bench_models import MODELS, fixed_data

    torch.set_num_threads(1)
    names = [f"{kind}_m{m}" for m in MICRO_BATCHES for kind in ("torch_1f1b", "torch_zbv", "fdg")]
    batches = {}
    for m in MICRO_BATCHES:
        data = fixed_data(model, m)
        batches[m] = (torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
    built = {name: _build(rank, name, int(name.rsplit("_m", 1)[1]), model) for name in names}
    for name, (schedule, optimizers, _) in built.items():  # warm-up: set-up, first fill
        _call(rank, name, schedule, optimizers, *batches[int(name.rsplit("_m", 1)[1])])
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            schedule, optimizers, group = built[name]
            x, y = batches[int(name.rsplit("_m", 1)[1])]
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(steps):
                _call(rank, name, schedule, optimizers, x, y)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            seconds[name].append(float(elapsed))
    for name, (schedule, _, _) in built.items():
        if name.startswith("fdg"):
            schedule.drain()
    micro = MODELS[model]["micro"]
    return {
        name: {
            "seconds": s,
            "samples_per_s": [steps * int(name.rsplit("_m", 1)[1]) * micro / t for t in s],
        }
        for name, s in seconds.items()
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# FDG on torch.distributed.pipelining against torch's 1F1B and zero-bubble (K = 2)",
        "",
        f"`{report['command']}` on {report['machine']}, {report['date']}; median of {report['repeats']} rounds",
        f"of {report['steps']} calls each (min and max in brackets). Samples per second, higher is better.",
        "",
        "| model | variant | samples/s | vs torch_1f1b (same m) |",
        "|---|---|---|---|",
    ]
    for model, rows in report["models"].items():
        for name, row in rows.items():
            sps = row["samples_per_s"]
            base = rows[f"torch_1f1b_m{name.rsplit('_m', 1)[1]}"]["samples_per_s"]
            ratio = statistics.median(sps) / statistics.median(base)
            lines.append(
                f"| {model} | {name} | {statistics.median(sps):.1f} [{min(sps):.1f}, {max(sps):.1f}] | {ratio:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,widemlp", help="comma-separated bench_models names")
    parser.add_argument("--steps", type=int, default=10, help="step() calls per variant per round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="widemlp_tiny, 2 calls, 1 round: a smoke run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "torch_native"))
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.repeats = "widemlp_tiny", 2, 1
    command = "OMP_NUM_THREADS=1 python -m benchmarks.throughput.torch_native " + " ".join(argv or sys.argv[1:])
    report: dict[str, Any] = {
        "command": command.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "steps": args.steps,
        "repeats": args.repeats,
        "models": {},
    }
    for model in args.models.split(","):
        report["models"][model] = run(worker, 2, model, args.steps, args.repeats, deadline_s=3600)[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch_native.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "torch_native.md").write_text(markdown(report))
    print(f"command: {report['command']}")
    print(markdown(report))


if __name__ == "__main__":
    main()
