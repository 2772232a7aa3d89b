"""How much two busy cores slow each other: the ceiling of a two-stage pipeline's speed-up on this machine.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.core_contention
    ... --models resnet32,transformer --rounds 8 --iterations 6

Two worker processes, one thread each, each train the whole model (forward, backward, SGD step on
one fixed micro-batch, as the throughput benchmark's ``bp`` variant). Rounds alternate: in an
"alone" round worker 0 trains while worker 1 sleeps; in a "pair" round both train at once. A
pipeline stage shares the machine the way a "pair" round does, and single-worker BP runs the way
an "alone" round does, so a K = 2 pipeline of perfectly balanced stages with no overhead at all
reaches at most

    ceiling ×BP = 2 × (ms per iteration alone) / (ms per iteration in a pair)

Rounds alternate so a slow stretch of a shared machine falls on both modes alike. Every worker keeps
freed memory (``fdg_schedule.base.host_memory``; ``--freed-memory system`` leaves glibc's default), as the
throughput benchmark's ranks do; ``--bind-cores`` puts worker r on core r, as its ``--bind-cores``.

A pipeline also runs in lock-step: each FDG tick needs the neighbour's previous tick, so at K = 2 a
tick lasts as long as the slower stage *in that tick* (docs/performance.md, benchmarks/throughput/lockstep_jitter.py).
When the time of identical work varies from iteration to iteration, that costs even perfectly
balanced stages. A third kind of round measures it without a pipeline: in a "halves" round worker 0
trains the first of the two stages the library's partitioner cuts
(:func:`fdg_schedule.partitioning.partition.balanced_partition`
on :func:`fdg_schedule.partitioning.profile.profile_layers`) and worker 1 the second, with no communication, and
their i-th iterations, started together at the round's barrier, give

    lock-step cost = mean over i of max(a_i, b_i) / max(mean a, mean b) - 1

and the ceiling with the lock-step = ceiling / (1 + lock-step cost).

``--halves-order fdg`` runs the first half in FDG's order (stage 0 at K = 2, stored activations):
each iteration back-propagates the forward of two iterations before, so two micro-batches' activations
are held in flight and read back cold, as the pipeline's first stage does. The halves' sum then
includes what that order costs while the other core is busy too.

Prints one Markdown table: medians [min–max] over rounds of each mode's ms per iteration, the
slowdown, the ceiling (the median of the per-pair-of-rounds ratios), the split, the two stages'
summed ms per iteration in the halves rounds over the whole model's alone (the plain-torch
counterpart of the throughput benchmark's "stages' compute / BP's"), each stage's ms per iteration in
the halves rounds against the partitioner's prediction, a stage's per-iteration spread
(sd / mean in the halves rounds), the lock-step cost and the ceiling with it.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.common.cores import bind_threads
from benchmarks.common.stats import lockstep_cost, spread

MODES = ("alone", "pair", "halves")


def worker(
    rank: int, model: str, rounds: int, iterations: int, cut: int, barrier: Any, results: Any, host: dict[str, bool]
) -> None:
    import torch

    from benchmarks.common.bench_models import build_layers, fixed_data, loss_fn
    from fdg_schedule.base import host_memory

    if host["retain"]:
        host_memory.retain_freed_memory()
    if host["bind_cores"]:  # this worker on the core of its rank
        cores = sorted(os.sched_getaffinity(0))
        bind_threads({cores[rank % len(cores)]})

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*build_layers(model))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = fixed_data(model, 1)[0]
    criterion = loss_fn(model)
    layers = build_layers(model)  # this worker's stage of the split, trained alone in the halves rounds
    stage = torch.nn.Sequential(*(layers[:cut] if rank == 0 else layers[cut:]))
    stage_optimizer = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)
    with torch.no_grad():
        boundary = torch.nn.Sequential(*layers[:cut])(x)

    def whole() -> None:
        criterion(net(x), y).backward()

    held: collections.deque[torch.Tensor] = collections.deque()

    def half() -> None:  # stage 0: backward with a fixed gradient; stage 1: from the fixed boundary activation
        if rank == 0 and host["fdg_order"]:  # FDG's stage 0 at K = 2: back-propagate the forward of 2 ticks ago
            if len(held) == 2:
                out = held.popleft()
                out.backward(torch.full_like(out, 1e-4))
            # as the engine's stored forward: saved weights are read live at backward time, after the steps
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                held.append(stage(x))
        elif rank == 0:
            out = stage(x)
            out.backward(torch.full_like(out, 1e-4))
        else:
            criterion(stage(boundary.detach().requires_grad_()), y).backward()

    def train(step: Any, opt: Any, count: int) -> list[float]:
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            step()
            opt.step()
            seconds.append(time.perf_counter() - start)
        return seconds

    train(whole, optimizer, 1)  # warm-up
    train(half, stage_optimizer, 3 if host["fdg_order"] else 1)  # FDG's order: two forwards in flight from here on
    for round_ in range(len(MODES) * rounds):
        mode = MODES[round_ % len(MODES)]
        barrier.wait()
        if mode == "halves":  # a stage's tick is about half an iteration: twice as many
            results.put((round_, mode, rank, train(half, stage_optimizer, 2 * iterations)))
        elif mode == "pair" or rank == 0:
            results.put((round_, mode, rank, train(whole, optimizer, iterations)))
        barrier.wait()


def balanced_cut(model: str) -> tuple[int, list[float]]:
    """The boundary of the library's balanced K = 2 split of ``model`` (profiled here, on one thread) and the
    stages' predicted seconds per tick."""
    import torch

    from benchmarks.common.bench_models import fixed_data, loss_fn, model_layers
    from fdg_schedule.partitioning.partition import balanced_partition
    from fdg_schedule.partitioning.profile import profile_layers

    torch.set_num_threads(1)
    x, y = fixed_data(model, 1)[0]
    profile = profile_layers(model_layers(model), x, y, loss_fn(model), device="cpu")
    plan = balanced_partition(profile, 2)
    return plan.parts[1], [stage.time_s for stage in plan.stages]


def measure(model: str, rounds: int, iterations: int, host: dict[str, bool]) -> dict[str, Any]:
    cut, predicted = balanced_cut(model)
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    args = (model, rounds, iterations, cut, barrier, results, host)
    procs = [context.Process(target=worker, args=(r, *args)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    seen = [results.get(timeout=3600) for _ in range(rounds * 5)]  # alone: one result, pair and halves: two
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise SystemExit(f"{model}: a worker failed (exit code {proc.exitcode})")
    alone = {r: statistics.fmean(s) for r, mode, _, s in seen if mode == "alone"}
    both: dict[str, dict[int, dict[int, list[float]]]] = {"pair": {}, "halves": {}}
    for r, mode, rank, s in seen:
        if mode in both:
            both[mode].setdefault(r, {})[rank] = s
    pair_mean = {
        r: statistics.fmean([statistics.fmean(s) for s in ranks.values()]) for r, ranks in both["pair"].items()
    }
    halves = [ranks for _, ranks in sorted(both["halves"].items())]
    stage_means = {r: [statistics.fmean(ranks[rank]) for rank in (0, 1)] for r, ranks in both["halves"].items()}
    return {
        "alone": list(alone.values()),
        "pair": list(pair_mean.values()),
        "ceiling": [2 * alone[r] / pair_mean[r + 1] for r in sorted(alone)],
        "cut": cut,
        "predicted": predicted,
        "stage_ms": [statistics.median(means[rank] for means in stage_means.values()) for rank in (0, 1)],
        "stages_sum": [sum(stage_means[r + 2]) / alone[r] for r in sorted(alone)],  # halves follow alone by 2
        "spread": [statistics.stdev(s) / statistics.fmean(s) for ranks in halves for s in ranks.values() if len(s) > 1],
        "lockstep": [lockstep_cost(ranks[0], ranks[1]) for ranks in halves],
    }


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common.bench_models import model_layers

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="resnet32,transformer")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each mode, alternating")
    parser.add_argument("--iterations", type=int, default=6, help="training iterations per round")
    parser.add_argument(
        "--freed-memory", choices=("retain", "system"), default="retain", help="fdg_schedule.base.host_memory"
    )
    parser.add_argument("--bind-cores", action="store_true", help="worker r and all its threads on core r")
    parser.add_argument(
        "--halves-order",
        choices=("plain", "fdg"),
        default="plain",
        help="plain: each half trains one micro-batch per iteration; fdg: the first half back-propagates the "
        "forward of two iterations ago, holding two in flight (FDG's stage 0 at K = 2, stored activations)",
    )
    args = parser.parse_args(argv)
    host = {
        "retain": args.freed_memory == "retain",
        "bind_cores": args.bind_cores,
        "fdg_order": args.halves_order == "fdg",
    }
    if host["retain"]:  # the profile behind the halves' cut too
        from fdg_schedule.base import host_memory

        host_memory.retain_freed_memory()
    print(
        f"command: python -m benchmarks.throughput.core_contention {' '.join(sys.argv[1:] if argv is None else argv)}"
    )
    print(
        "| model | ms/iteration alone | ms/iteration in a pair | slowdown | ceiling ×BP at K = 2 "
        "| split | stages' sum / alone | stage 0 / 1 ms in the halves (predicted) | a stage's spread (sd/mean %) "
        "| lock-step cost % | ceiling with the lock-step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        got = measure(model, args.rounds, args.iterations, host)
        slowdown = statistics.median(got["pair"]) / statistics.median(got["alone"])
        ceiling = statistics.median(got["ceiling"])
        lockstep = statistics.median(got["lockstep"])
        stage_spread = spread(got["spread"], 100) if got["spread"] else "-"
        (m0, m1), (p0, p1) = got["stage_ms"], got["predicted"]
        halves_ms = f"{1e3 * m0:.1f} / {1e3 * m1:.1f} ({1e3 * p0:.1f} / {1e3 * p1:.1f})"
        print(
            f"| {model} | {spread(got['alone'], 1e3)} | {spread(got['pair'], 1e3)} | {slowdown:.2f} | "
            f"{spread(got['ceiling'], digits=2)} | 0,{got['cut']},{len(model_layers(model))} | "
            f"{spread(got['stages_sum'], digits=2)} | {halves_ms} | {stage_spread} | "
            f"{spread(got['lockstep'], 100)} | {ceiling / (1 + lockstep):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
