"""Statistics the benchmarks share: a median [min–max] cell, the lock-step's cost of two timings, Student's t."""

from __future__ import annotations

import math
import statistics


def lockstep_cost(a: list[float], b: list[float]) -> float:
    """What running ``a`` and ``b`` in lock-step costs: the mean per-iteration maximum over the slower mean, - 1."""
    mean_max = statistics.fmean(max(x, y) for x, y in zip(a, b, strict=True))
    return mean_max / max(statistics.fmean(a), statistics.fmean(b)) - 1


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """``median [min–max]`` of ``values`` times ``scale``, each with ``digits`` decimals: a table cell."""
    values = [v * scale for v in values]
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def t_quantile(p: float, df: int) -> float:
    """The Student-t quantile t_{p, df} (p > 0.5), by bisection on its CDF (Simpson's rule on the density)."""

    def cdf(x: float) -> float:
        n = 2000
        h = x / n
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        f = lambda t: c * (1 + t * t / df) ** (-(df + 1) / 2)  # noqa: E731
        s = f(0) + f(x) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
        return 0.5 + s * h / 3

    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2
