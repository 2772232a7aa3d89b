"""Where the planner cuts the layers into stages: :func:`fdg_schedule.partitioning.contiguous_split.solve` on callbacks.

The cost and memory of a stage are callbacks of (first layer, end layer, stage index), so each
schedule brings its own notion of a stage's work and of what it holds (e.g. FDG's stage k keeps
``2(K-1-k)`` micro-batches, 1F1B's ``K-k``: :mod:`fdg_schedule.partitioning.stage_memory`). The solver is the
partitioner's (Note [the split solver]), with the planner's tie rule unless told ``spread``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fdg_schedule.partitioning import contiguous_split

StageFn = Callable[[int, int, int], float]


def best_split(layers: int, stages: int, cost: StageFn, memory: StageFn | None = None,
               limit: float = float("inf"), spread: bool = False) -> list[int] | None:  # fmt: skip
    """Boundaries ``[0, b1, ..., layers]`` minimising ``max_k cost(b_k, b_k+1, k)``, or None if none fits.

    ``memory(a, b, k)`` must stay ``<= limit`` for every stage; every stage gets at least one layer.
    Ties go to the split that puts more layers on earlier stages (for every stop, the last start
    within ``contiguous_split.TIE`` of the least bottleneck); ``spread=True``: the partitioner's
    rule instead, among the splits with the least bottleneck the one whose fastest stage is slowest.
    """
    if stages < 1 or stages > layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} stages (each stage needs a layer)")

    def matrix(fn: StageFn, k: int, empty: float) -> np.ndarray:
        """``fn`` of stage k at every (start, stop) it may take (stages before and after it need a layer each)."""
        out = np.full((layers + 1, layers + 1), empty)
        for i in range(k, layers - (stages - 1 - k)):
            for j in range(i + 1, layers - (stages - 1 - k) + 1):
                out[i, j] = fn(i, j, k)
        return out

    costs: dict[int, np.ndarray] = {}
    fits: dict[int, np.ndarray] = {}

    def cost_of(k: int) -> np.ndarray:
        if k not in costs:
            costs[k] = matrix(cost, k, np.inf)
        return costs[k]

    def allowed(k: int) -> np.ndarray:
        assert memory is not None
        if k not in fits:
            fits[k] = matrix(memory, k, np.inf) <= limit
        return fits[k]

    return contiguous_split.solve(layers, stages, cost_of, allowed if memory is not None else None, spread)
