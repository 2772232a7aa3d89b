"""Where to cut the layers into stages: the contiguous split whose slowest stage is fastest, within a memory limit.

A dynamic program over (stages so far, layers so far) with prefix sums: ``O(K n^2)`` for ``n``
layers. The cost and memory of a stage are callbacks of (first layer, end layer, stage index), so
each schedule brings its own notion of a stage's work and of what it holds (e.g. FDG's stage k
keeps ``2(K-1-k)`` micro-batches, 1F1B's ``K-k``).
"""

from __future__ import annotations

from collections.abc import Callable

StageFn = Callable[[int, int, int], float]


def best_split(layers: int, stages: int, cost: StageFn, memory: StageFn | None = None,
               limit: float = float("inf")) -> list[int] | None:  # fmt: skip
    """Boundaries ``[0, b1, ..., layers]`` minimising ``max_k cost(b_k, b_k+1, k)``, or None if none fits.

    ``memory(a, b, k)`` must stay ``<= limit`` for every stage; every stage gets at least one layer.
    Ties go to the split that puts fewer layers on earlier stages (they hold more under FDG and 1F1B).
    """
    if stages < 1 or stages > layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} stages (each stage needs a layer)")
    inf = float("inf")
    # best[k][j]: smallest bottleneck for layers [0, j) on stages 0..k-1; cut[k][j] the last boundary
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[-1] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        # stage k-1 ends at j; stages after it need one layer each
        for j in range(k, layers - (stages - k) + 1):
            for i in range(j - 1, k - 2, -1):
                if best[k - 1][i] == inf:
                    continue
                if memory is not None and memory(i, j, k - 1) > limit:
                    continue
                value = max(best[k - 1][i], cost(i, j, k - 1))
                if value < best[k][j] - 1e-15:
                    best[k][j], cut[k][j] = value, i
    if best[stages][layers] == inf:
        return None
    bounds = [layers]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]
