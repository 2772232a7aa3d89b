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

Rounds alternate so a slow stretch of a shared machine falls on both modes alike.

A pipeline also runs in lock-step: each FDG tick needs the neighbour's previous tick, so at K = 2 a
tick lasts as long as the slower stage *in that tick* (docs/performance.md, benchmarks/lockstep_jitter.py).
When the time of identical work varies from iteration to iteration, that costs even perfectly
balanced stages. The pair rounds measure it without a pipeline: the two workers' i-th iterations
of a round, started together at the round's barrier, give

    lock-step cost = mean over i of max(a_i, b_i) / max(mean a, mean b) - 1

and the ceiling with the lock-step = ceiling / (1 + lock-step cost). An iteration here is the whole
model, twice a K = 2 stage's tick, so the relative spread of a tick, and so its cost, can be larger.

Prints one Markdown table: medians [min–max] over rounds of each mode's ms per iteration, the
per-iteration spread of identical work (sd / mean in the alone rounds), the slowdown, the ceiling
(the median of the per-pair-of-rounds ratios), the lock-step cost and the ceiling with it.
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

    def train() -> list[float]:
        seconds = []
        for _ in range(iterations):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            criterion(net(x), y).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
        return seconds

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
    alone = {r: statistics.fmean(s) for r, mode, _, s in seen if mode == "alone"}
    spreads = [statistics.stdev(s) / statistics.fmean(s) for _, mode, _, s in seen if mode == "alone" and len(s) > 1]
    pair: dict[int, dict[int, list[float]]] = {}
    for r, mode, rank, s in seen:
        if mode == "pair":
            pair.setdefault(r, {})[rank] = s
    pair_mean = {r: statistics.fmean([statistics.fmean(s) for s in ranks.values()]) for r, ranks in pair.items()}
    ceilings = [2 * alone[r] / pair_mean[r + 1] for r in sorted(alone)]
    lockstep = [lockstep_cost(ranks[0], ranks[1]) for _, ranks in sorted(pair.items())]
    return {
        "alone": list(alone.values()),
        "pair": list(pair_mean.values()),
        "ceiling": ceilings,
        "spread": spreads,
        "lockstep": lockstep,
    }


def lockstep_cost(a: list[float], b: list[float]) -> float:
    """What running ``a`` and ``b`` in lock-step costs: the mean per-iteration maximum over the slower mean, - 1."""
    mean_max = statistics.fmean(max(x, y) for x, y in zip(a, b, strict=True))
    return mean_max / max(statistics.fmean(a), statistics.fmean(b)) - 1


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
    print(
        "| model | ms/iteration alone | ms/iteration in a pair | spread alone (sd/mean %) | slowdown "
        "| ceiling ×BP at K = 2 | lock-step cost % | ceiling with the lock-step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        got = measure(model, args.rounds, args.iterations)
        slowdown = statistics.median(got["pair"]) / statistics.median(got["alone"])
        ceiling = statistics.median(got["ceiling"])
        lockstep = statistics.median(got["lockstep"])
        alone_spread = spread(got["spread"], 100) if got["spread"] else "-"
        print(
            f"| {model} | {spread(got['alone'], 1e3)} | {spread(got['pair'], 1e3)} | {alone_spread} | {slowdown:.2f} | "
            f"{spread(got['ceiling'], digits=2)} | {spread(got['lockstep'], 100)} | {ceiling / (1 + lockstep):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
