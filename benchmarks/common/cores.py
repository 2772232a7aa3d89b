"""Pinning a benchmark process to cores (Linux)."""

from __future__ import annotations

import contextlib
import os


def bind_threads(cores: set[int]) -> None:
    """Let every thread of this process (gloo's transport threads too) run only on ``cores``."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing needs no binding
            os.sched_setaffinity(int(thread), cores)
