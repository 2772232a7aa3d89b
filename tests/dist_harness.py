"""Run a function on N real ranks for a test: :func:`fdg_schedule.tools.launch.run` with the rendezvous in the test's
tmp dir.

A rank's exception reaches pytest with its traceback; a rank that does not finish in time is
killed and the test fails naming it. Worker functions live at module level so they pickle.

Note [one launch, several calls]: starting the ranks (spawn, ``import torch``, ``import deepspeed``,
the process group) costs several seconds per launch on two cores, more than most cases' training.
Calls that end cleanly on every rank (no rank dies, raises or gives up on a neighbour) can share one
launch through :func:`run_ranks_each`: they run in turn in the same processes, each building its own
engine, as ``engine_workers.train`` does with its list of cases.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


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
    # Imported here: a rank imports this module for calls_in_turn and must not import the package through it
    # (Note [a rank does not import the package] in fdg_schedule/tools/launch.py).
    from fdg_schedule.tools.launch import run

    return run(worker, world_size, *args, deadline_s=deadline_s, expect_exit=expect_exit, workdir=tmp_path)


def calls_in_turn(rank: int, world_size: int, calls: Sequence[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """``worker(rank, world_size, *args)`` for each ``(worker, args)`` in ``calls``, in turn, on this rank."""
    return [worker(rank, world_size, *args) for worker, args in calls]


def fdg_modules(rank: int, world_size: int) -> list[str]:
    """The ``fdg_schedule`` modules this rank has loaded so far (a call for :func:`run_ranks_calls`)."""
    return sorted(name for name in sys.modules if name.split(".")[0] == "fdg_schedule")


def run_ranks_calls(
    world_size: int, tmp_path: Path, calls: Sequence[tuple[Callable[..., Any], tuple]], deadline_s: float = 240
) -> list[list[Any]]:
    """``worker(rank, world_size, *args)`` for each ``(worker, args)`` in ``calls``, all in one launch
    (Note [one launch, several calls]); returns, per call, the results in rank order."""
    per_rank = run_ranks(calls_in_turn, world_size, tmp_path, list(calls), deadline_s=deadline_s)
    return [list(ranks) for ranks in zip(*per_rank)]


def run_ranks_each(
    worker: Callable[..., Any], world_size: int, tmp_path: Path, calls: Sequence[tuple], deadline_s: float = 240
) -> list[list[Any]]:
    """:func:`run_ranks_calls` with one worker: ``worker(rank, world_size, *args)`` for each ``args`` in ``calls``."""
    return run_ranks_calls(world_size, tmp_path, [(worker, args) for args in calls], deadline_s=deadline_s)
