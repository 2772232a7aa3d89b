"""Pinning a benchmark process to cores (Linux)."""

from __future__ import annotations

import contextlib
import os


def bind_threads(cores: set[int]) -> None:
    """Let every thread of this process (gloo's transport threads too) run only on ``cores``."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing needs no binding
            os.sched_setaffinity(int(thread), cores)


class Cores:
    """Where a rank's threads may run: every core it started with, or one of its own (rank r: the r-th)."""

    def __init__(self, rank: int, always_bound: bool) -> None:
        self.all = sorted(os.sched_getaffinity(0))
        self.own = {self.all[rank % len(self.all)]}
        self.always_bound = always_bound
        self.bound: bool | None = None

    def bind(self, bound: bool) -> None:
        """Move every thread of the process (gloo's transport threads too) onto its own core, or free it."""
        bound = bound or self.always_bound
        if bound != self.bound:
            bind_threads(self.own if bound else set(self.all))
            self.bound = bound
