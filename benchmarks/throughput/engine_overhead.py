"""What running a model through DeepSpeed and the FDG engine costs on one core, against plain torch.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.engine_overhead --models resnet32,transformer

One process, one thread, a one-rank gloo world. Per model, three variants train the throughput
benchmark's layers on its fixed micro-batches (``throughput_variants``): ``bp`` (an nn.Sequential, an
SGD step per micro-batch), ``fdg`` (the FDG engine at K = 1, current weights, stored activations, a
step per micro-batch) and ``stock`` (DeepSpeed's own pipeline engine at K = 1, one step per
``--gas`` micro-batches). Windows of ``--gas`` micro-batches alternate between the variants for
``--rounds`` rounds, so a slow stretch of the machine falls on all three alike. Prints one Markdown
table: ms per micro-batch, median [min–max] over rounds, and each variant's median per-round ratio to
``bp``. At K = 1 there is no neighbour: what ``fdg`` and ``stock`` add over ``bp`` is the per-micro-batch
path through DeepSpeed and the engine (instruction dispatch, timers, hooks, the loss on the host).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported


def measure(model: str, rounds: int, gas: int) -> dict[str, list[float]]:
    """Per variant, ms per micro-batch in each round."""
    from benchmarks.common.bench_models import model_layers
    from benchmarks.common.throughput_variants import DeepSpeedVariant, PlainBP

    layers = len(model_layers(model))
    variants: dict[str, Any] = {
        "bp": PlainBP(model),
        "fdg": DeepSpeedVariant(
            dict(kind="fdg", stages=1, gas=gas, weights="current", activations="stored"), model, [0, layers]
        ),
        "stock": DeepSpeedVariant(dict(kind="1f1b", stages=1, gas=gas), model, [0, layers]),
    }
    units = {"bp": gas, "fdg": 1, "stock": 1}  # a DeepSpeed unit is one train_batch() of gas micro-batches

    def window(name: str) -> float:
        start = time.perf_counter()
        for _ in range(units[name]):
            variants[name].unit()
        return 1e3 * (time.perf_counter() - start) / gas

    for name in variants:
        window(name)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name in variants:
            times[name].append(window(name))
    return times


def row(model: str, times: dict[str, list[float]]) -> str:
    """One Markdown row: ms per micro-batch per variant, and the median per-round ratios to ``bp``."""

    from benchmarks.common.stats import spread  # median [min–max]

    def ratio(name: str) -> str:
        return f"{statistics.median(a / b for a, b in zip(times[name], times['bp'], strict=True)):.3f}"

    cells = [spread(times[name]) for name in ("bp", "fdg", "stock")] + [ratio("fdg"), ratio("stock")]
    return f"| {model} | {' | '.join(cells)} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="resnet32,transformer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--gas", type=int, default=16, help="micro-batches per window (DeepSpeed's GAS)")
    parser.add_argument(
        "--freed-memory", choices=("retain", "system"), default="retain", help="fdg_schedule.base.host_memory"
    )
    args = parser.parse_args(argv)
    if args.freed_memory == "retain":
        from fdg_schedule.base import host_memory

        host_memory.retain_freed_memory()

    import deepspeed
    import torch

    from fdg_schedule.tools.launch import free_port, remove_shared_memory

    torch.set_num_threads(1)
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        given = " ".join(sys.argv[1:] if argv is None else argv)
        print(f"command: python -m benchmarks.throughput.engine_overhead {given}")
        print("| model | bp ms/µb | fdg K = 1 ms/µb | stock K = 1 ms/µb | fdg ×bp time | stock ×bp time |")
        print("|---|---|---|---|---|---|")
        for model in args.models.split(","):
            print(row(model, measure(model, args.rounds, args.gas)))
    finally:
        torch.distributed.destroy_process_group()
        remove_shared_memory(port)


if __name__ == "__main__":
    main()
