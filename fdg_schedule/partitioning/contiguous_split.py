"""Where to cut layers into pipeline stages: the contiguous split whose slowest stage is fastest, within limits.

Torch-free; the one split solver of the partitioner (:mod:`fdg_schedule.partitioning.partition`) and the planner
(:mod:`fdg_schedule.plan.split`). A caller describes stage ``k`` holding layers ``[i, j)`` by two
``(n+1) x (n+1)`` matrices over (start ``i``, stop ``j``): its cost ``cost(k)[i, j]`` (time per
micro-batch or per tick, any comparable numbers: the partitioner's are integer picoseconds, so
equal times compare equal) and whether it is allowed at all, ``allowed(k)[i, j]`` (memory within
the limit, a layer with parameters of its own, ...). Entries with ``j <= i`` are ignored, and
every stage gets at least one layer.

Note [the split solver]: three dynamic programs over (stages so far, layers so far), each a
vectorised ``O(K n^2)`` sweep (a few milliseconds for a hundred layers, about a second for a thousand):

1. the least bottleneck ``T*``: ``best[k+1][j] = min_i max(best[k][i], cost_k[i, j])``;
2. among the splits whose every stage costs at most ``T*``, the largest fastest stage ``L*``
   (``max_i min(...)``): the slack is spread over the stages rather than left on one, so a stage
   predicted below the bottleneck has room for prediction error;
3. the stops reachable with every stage in ``[L*, T*]``, then the boundaries from the last stage
   back, each at the first (smallest) start that works: a deterministic split.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Matrix = Callable[[int], np.ndarray]
TIE = 1e-15  # without spread: costs this close to the least count as equal


def solve(
    layers: int, stages: int, cost: Matrix, allowed: Matrix | None = None, spread: bool = True
) -> list[int] | None:
    """Boundaries ``[0, b1, ..., layers]`` minimising the slowest stage, then maximising the fastest; None if
    no split is allowed (see the module docstring). Raises ValueError when ``stages`` is not in [1, layers].

    ``spread=False`` stops after the first program and keeps, for every stop, the last start within
    ``TIE`` of the least bottleneck (the planner's rule: its costs are floats and its published
    predictions were made with it)."""
    if stages < 1 or stages > layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} stages (each stage needs a layer)")
    n = layers
    positions = np.arange(n + 1)

    def usable(k: int) -> tuple[np.ndarray, np.ndarray]:
        """Stage k's cost matrix and where it may run: i < j, stages before it and after it get a layer each."""
        matrix = np.asarray(cost(k))
        ok = (positions[:, None] < positions[None, :]) & (positions[:, None] >= k)
        ok &= positions[None, :] <= n - (stages - 1 - k)
        if allowed is not None:
            ok &= np.asarray(allowed(k), dtype=bool)
        return matrix, ok

    # 1. the least bottleneck
    best = np.full(n + 1, np.inf)
    best[0] = -np.inf
    cuts = []
    for k in range(stages):
        matrix, ok = usable(k)
        through = np.where(ok & (best < np.inf)[:, None], np.maximum(best[:, None], matrix), np.inf)
        near = through <= through.min(axis=0)[None, :] + TIE
        cut = n - np.argmax(near[::-1], axis=0)  # the last start within TIE of the least
        cuts.append(cut)
        best = through[cut, positions]
    if best[n] == np.inf:
        return None
    if not spread:
        parts = [n]
        for k in range(stages - 1, -1, -1):
            parts.append(int(cuts[k][parts[-1]]))
        return parts[::-1]
    bottleneck = best[n]
    # 2. the largest fastest stage among splits within the bottleneck
    least = np.full(n + 1, -np.inf)
    least[0] = np.inf
    for k in range(stages):
        matrix, ok = usable(k)
        ok &= matrix <= bottleneck
        through = np.where(ok & (least > -np.inf)[:, None], np.minimum(least[:, None], matrix), -np.inf)
        least = through.max(axis=0)
    floor = least[n]
    # 3. reachable stops within [floor, bottleneck], then boundaries from the back
    reach = [positions == 0]
    windows = []
    for k in range(stages):
        matrix, ok = usable(k)
        window = ok & (matrix <= bottleneck) & (matrix >= floor)
        windows.append(window)
        reach.append((reach[-1][:, None] & window).any(axis=0))
    parts = [n]
    for k in range(stages - 1, -1, -1):
        parts.append(int(np.flatnonzero(reach[k] & windows[k][:, parts[-1]])[0]))
    return parts[::-1]
