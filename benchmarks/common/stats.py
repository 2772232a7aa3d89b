"""Statistics the benchmarks share: a median [min–max] cell, the lock-step's cost of two timings, Student's t."""

from __future__ import annotations

import statistics

from fdg_schedule.plan.token_overhead import t_quantile  # noqa: F401  (the benchmarks' Student t: the package's)


def lockstep_cost(a: list[float], b: list[float]) -> float:
    """What running ``a`` and ``b`` in lock-step costs: the mean per-iteration maximum over the slower mean, - 1."""
    mean_max = statistics.fmean(max(x, y) for x, y in zip(a, b, strict=True))
    return mean_max / max(statistics.fmean(a), statistics.fmean(b)) - 1


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """``median [min–max]`` of ``values`` times ``scale``, each with ``digits`` decimals: a table cell."""
    values = [v * scale for v in values]
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"
