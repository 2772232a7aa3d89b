"""How much two busy cores slow each other: the ceiling of a two-stage pipeline's speed-up on this machine.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/core_contention.py
    ... --models resnet32,transformer --rounds 8 --iterations 6

Two worker processes, one thread each, each train the whole model (forward, backward, SGD step on
one fixed micro-batch, as the throughput benchmark's ``bp`` variant). Rounds alternate: in an
"alone" round worker 0 trains while worker 1 sleeps; in a "pair" round both train at once. A
pipeline stage shares the machine the way a "pair" round does, and single-worker BP runs the way
an "alone" round does, so a K = 2 pipeline of perfectly balanced stages with no overhead at all
reaches at most

    ceiling ×BP = 2 × (ms per iteration alone) / (ms per iteration in a pair)

Rounds alternate so a slow stretch of a shared machine falls on both modes alike. Prints one
Markdown table: medians [min–max] over rounds of each mode's ms per iteration, the slowdown and
the ceiling (the median of the per-pair-of-rounds ratios).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:  # run as a script: the package and bench_models from this checkout
        sys.path.insert(0, str(path))


def worker(rank: int, model: str, rounds: int, iterations: int, barrier: Any, results: Any) -> None:
    import torch
    from bench_models import build_layers, fixed_data, loss_fn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*build_layers(model))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = fixed_data(model, 1)[0]
    criterion = loss_fn(model)

    def train() -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            optimizer.zero_grad(set_to_none=True)
            criterion(net(x), y).backward()
            optimizer.step()
        return (time.perf_counter() - start) / iterations

    train()  # warm-up
    for round_ in range(2 * rounds):
        mode = "alone" if round_ % 2 == 0 else "pair"
        barrier.wait()
        if mode == "pair" or rank == 0:
            results.put((round_, mode, rank, train()))
        barrier.wait()


def measure(model: str, rounds: int, iterations: int) -> dict[str, Any]:
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    procs = [context.Process(target=worker, args=(r, model, rounds, iterations, barrier, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    seen = [results.get(timeout=3600) for _ in range(rounds * 3)]  # alone: one result, pair: two
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise SystemExit(f"{model}: a worker failed (exit code {proc.exitcode})")
    alone = {r: s for r, mode, _, s in seen if mode == "alone"}
    pair: dict[int, list[float]] = {}
    for r, mode, _, s in seen:
        if mode == "pair":
            pair.setdefault(r, []).append(s)
    pair_mean = {r: statistics.fmean(s) for r, s in pair.items()}
    ceilings = [2 * alone[r] / pair_mean[r + 1] for r in sorted(alone)]
    return {"alone": list(alone.values()), "pair": list(pair_mean.values()), "ceiling": ceilings}


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="resnet32,transformer")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each mode, alternating")
    parser.add_argument("--iterations", type=int, default=6, help="training iterations per round")
    args = parser.parse_args(argv)
    print(f"command: python benchmarks/core_contention.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print("| model | ms/iteration alone | ms/iteration in a pair | slowdown | ceiling ×BP at K = 2 |")
    print("|---|---|---|---|---|")
    for model in args.models.split(","):
        got = measure(model, args.rounds, args.iterations)
        slowdown = statistics.median(got["pair"]) / statistics.median(got["alone"])
        print(
            f"| {model} | {spread(got['alone'], 1e3)} | {spread(got['pair'], 1e3)} | {slowdown:.2f} | "
            f"{spread(got['ceiling'], digits=2)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
