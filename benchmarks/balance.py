"""Stage boundaries for the throughput benchmark, balanced on measured per-layer times.

The benchmark's own balancing, kept in this one module: a library partitioner can replace
:func:`balanced_split` (and :func:`layer_costs`) here without touching the measuring or reporting.
"""

from __future__ import annotations

import itertools
import time

import torch
from throughput_variants import fixed_data, model_layers


def layer_costs(model: str, repeats: int = 5) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each layer alone (best of ``repeats``), in one thread."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [spec.build() for spec in model_layers(model)]
    h = fixed_data(model, 1)[0][0]
    forward, backward = [], []
    for layer in layers:
        x = h.detach().requires_grad_(True)
        best_f = best_b = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = layer(x)
            t1 = time.perf_counter()
            out.sum().backward()
            t2 = time.perf_counter()
            best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
        forward.append(best_f)
        backward.append(best_b)
        h = out.detach()
    return forward, backward


def balanced_split(forward: list[float], backward: list[float], stages: int, recompute: bool = False) -> list[int]:
    """Stage boundaries that minimise the slowest stage's measured work per micro-batch.

    A stage's work is its layers' forward + backward; with ``recompute`` every stage but the last
    runs its forward twice (FDG ``activations="recomputed"``), which moves the best cut towards stage 0.
    """
    n = len(forward)

    def cost(a: int, b: int, last: bool) -> float:
        return sum(forward[a:b]) * (1 if last or not recompute else 2) + sum(backward[a:b])

    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        worst = max(cost(bounds[i], bounds[i + 1], i == stages - 1) for i in range(stages))
        if best is None or worst < best[0]:
            best = (worst, bounds)
    assert best is not None, f"cannot cut {n} layers into {stages} stages"
    return best[1]
