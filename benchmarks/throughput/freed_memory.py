"""What glibc's handing freed memory back to the kernel costs a training step, and what keeping it saves.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.freed_memory --models resnet32,convstack

Plain backprop on one thread (the throughput benchmark's ``bp``: its layers, its fixed micro-batches,
SGD with momentum), each measurement in a fresh process, because the setting is process-wide and one-way:
``system`` leaves glibc's defaults, ``retained`` calls ``fdg_schedule.base.host_memory.retain_freed_memory()``
first. The two alternate for ``--rounds`` rounds (order flipped every round), so a slow stretch of the
machine falls on both. Per micro-batch, after ``--warmup`` untimed ones: wall ms, page faults (minor)
and the kernel's CPU ms. Prints one Markdown table: medians [min–max] over rounds and the median
per-round ratio of retained to system time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

MODES = ("system", "retained")


def _measure(model: str, mode: str, warmup: int, iterations: int, results: Any) -> None:
    """In a fresh process: the allocator setting first, then BP's time, faults and kernel time per micro-batch.

    (The spawned process inherits the parent's ``sys.path``: the repository root, first under ``python -m``.)
    """
    from fdg_schedule.base import host_memory

    if mode == "retained":
        host_memory.retain_freed_memory()
    import torch

    from benchmarks.common.throughput_variants import PlainBP

    torch.set_num_threads(1)
    bp = PlainBP(model)
    for _ in range(warmup):
        bp.unit()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(iterations):
        bp.unit()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    results.put(
        {
            "ms": 1e3 * wall / iterations,
            "faults": (after.ru_minflt - before.ru_minflt) / iterations,
            "kernel_ms": 1e3 * (after.ru_stime - before.ru_stime) / iterations,
            "setting": host_memory.describe(),
        }
    )


def measure(model: str, rounds: int, warmup: int, iterations: int) -> dict[str, list[dict[str, Any]]]:
    """Per mode, one record per round, each from its own process."""
    context = mp.get_context("spawn")
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            results = context.Queue()
            worker = context.Process(target=_measure, args=(model, mode, warmup, iterations, results))
            worker.start()
            runs[mode].append(results.get(timeout=1800))
            worker.join(timeout=60)
            if worker.exitcode != 0:
                raise RuntimeError(f"{model} {mode}: the measuring process exited with code {worker.exitcode}")
    return runs


def row(model: str, runs: dict[str, list[dict[str, Any]]]) -> str:
    from benchmarks.common.stats import spread  # median [min–max]

    def cells(key: str, digits: int) -> list[str]:
        return [spread([run[key] for run in runs[mode]], digits=digits) for mode in MODES]

    ratio = statistics.median(
        r["ms"] / s["ms"] for s, r in zip(runs["system"], runs["retained"], strict=True)
    )  # rounds pair up: the two modes of one round ran back to back
    return (
        f"| {model} | {' | '.join(cells('ms', 1))} | {ratio:.3f} | {' | '.join(cells('faults', 0))} | "
        + " | ".join(cells("kernel_ms", 1))
        + " |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="resnet32,convstack")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both settings, alternating")
    parser.add_argument("--warmup", type=int, default=6, help="untimed micro-batches per process")
    parser.add_argument("--iterations", type=int, default=8, help="timed micro-batches per process")
    args = parser.parse_args(argv)
    print(
        "| model | system ms/µb | retained ms/µb | retained / system time | system faults/µb | retained faults/µb "
        "| system kernel ms/µb | retained kernel ms/µb |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        print(row(model, measure(model, args.rounds, args.warmup, args.iterations)), flush=True)


if __name__ == "__main__":
    main()
