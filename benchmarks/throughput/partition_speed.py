"""How long the balanced partitioner takes: N layers into K stages, every objective, with and without a memory limit.

    python -m benchmarks.throughput.partition_speed            # N = 100, 1000, 5000; K = 2 ... 64
    python -m benchmarks.throughput.partition_speed --layers 1000 --repeats 9

Profiles are synthetic (seeded random times and sizes per layer, as tests/test_partition.py draws
them); the partitioner's work does not depend on the values, only on N and K. Prints one Markdown
table: median and max seconds over ``--repeats`` calls of ``balanced_partition``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from fdg_schedule.partitioning.partition import Objective, balanced_partition
from fdg_schedule.partitioning.profile import LayerCost, ModelProfile


def synthetic_profile(layers: int, seed: int = 0) -> ModelProfile:
    rng = random.Random(seed)
    costs = tuple(
        LayerCost(
            name=f"layer{i}",
            forward_s=rng.uniform(1e-4, 1e-2),
            backward_s=rng.uniform(2e-4, 2e-2),
            recompute_s=rng.uniform(1e-4, 1e-2),
            step_s=rng.uniform(0, 1e-3),
            param_bytes=rng.randint(0, 2**22),
            activation_bytes=rng.randint(2**16, 2**22),
            saved_bytes=rng.randint(0, 2**24),
        )
        for i in range(layers)
    )
    return ModelProfile(layers=costs, micro_batch=32, device="cpu", dtype="float32", input_bytes=2**20)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--layers", default="100,1000,5000")
    parser.add_argument("--stages", default="2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(
        f"command: python -m benchmarks.throughput.partition_speed {' '.join(sys.argv[1:] if argv is None else argv)}"
    )
    print("| layers | K | objective | median s | max s | bottleneck ms |")
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in args.layers.split(",")]:
        profile = synthetic_profile(n)
        for k in [int(x) for x in args.stages.split(",") if int(x) <= n]:
            # A limit that binds: 90% of the largest stage peak of the unlimited stored split.
            free = balanced_partition(profile, k)
            limit = int(0.9 * max(s.peak_bytes for s in free.stages))
            objectives = {
                "FDG stored": Objective(),
                "FDG stored, memory limit": Objective(memory_limit=limit),
                "FDG recomputed": Objective(activations="recomputed"),
                "1F1B m=8": Objective(schedule="1f1b", micro_batches=8),
            }
            for name, objective in objectives.items():
                times, plan = [], None
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    try:
                        plan = balanced_partition(profile, k, objective)
                    except ValueError:
                        plan = None  # the limit admits no split: still timed
                    times.append(time.perf_counter() - start)
                bottleneck = f"{plan.bottleneck_s * 1e3:.1f}" if plan is not None else "no split fits"
                print(f"| {n} | {k} | {name} | {statistics.median(times):.4f} | {max(times):.4f} | {bottleneck} |")


if __name__ == "__main__":
    main()
