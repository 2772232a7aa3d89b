"""Run a function on N real ranks for a test: :func:`fdg_schedule.launch.run` with the rendezvous in the test's tmp dir.

A rank's exception reaches pytest with its traceback; a rank that does not finish in time is
killed and the test fails naming it. Worker functions live at module level so they pickle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fdg_schedule.launch import run


def run_ranks(
    worker: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    deadline_s: float = 240,
    expect_exit: dict[int, int] | None = None,
) -> list[Any]:
    """``worker(rank, world_size, *args)`` on every rank; returns the results in rank order.

    Ranks in ``expect_exit`` must die with that exit code instead of returning (their result is None).
    """
    return run(worker, world_size, *args, deadline_s=deadline_s, expect_exit=expect_exit, workdir=tmp_path)
