"""Run a function on N real ranks (spawned processes, gloo, file:// rendezvous) with a deadline.

A rank's exception reaches pytest with its traceback; a rank that does not finish in time is
killed and the test fails naming it. Worker functions live at module level so they pickle.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    pass


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
    expect_exit = expect_exit or {}
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    init_file = tmp_path / f"rendezvous-{time.monotonic_ns()}"
    procs = [
        ctx.Process(
            target=_entry,
            args=(worker, rank, world_size, str(init_file), results, args, max(1.0, deadline_s - 5)),
            daemon=False,  # DeepSpeed data loaders start worker processes of their own
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(done) < world_size:
            for r, code in expect_exit.items():
                if r not in done and procs[r].exitcode is not None:
                    if procs[r].exitcode != code:
                        raise RankFailed(f"rank {r} exited with {procs[r].exitcode}, expected {code}")
                    done[r] = None
            try:
                status, rank, payload = results.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > end:
                    missing = sorted(set(range(world_size)) - set(done))
                    raise RankFailed(f"ranks {missing} did not finish within {deadline_s:.0f} s") from None
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in done and r not in expect_exit
                ]
                if dead:
                    # A rank may abort in interpreter teardown just after its result was queued: read
                    # once more before calling it dead.
                    late = dead_since.setdefault(dead[0], time.monotonic())
                    if time.monotonic() - late > 3:
                        raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if rank in expect_exit:
                raise RankFailed(f"rank {rank} was expected to die with exit code {expect_exit[rank]}: {status}")
            if status == "error":
                raise RankFailed(f"rank {rank} raised:\n{payload}")
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    return [done[r] for r in range(world_size)]


def _entry(
    worker: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    results: Any,
    args: tuple,
    dump_after_s: float,
) -> None:
    # A rank still running just before the deadline prints where it is stuck.
    faulthandler.dump_traceback_later(dump_after_s, exit=False)
    os.environ.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    try:
        import deepspeed
        import torch

        torch.set_num_threads(1)
        deepspeed.init_distributed(
            dist_backend="gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
            verbose=False,
        )
        result = worker(rank, world_size, *args)
        # Plain bytes: shared-memory tensors would need this process alive until they are read.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put(("ok", rank, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put(("error", rank, traceback.format_exc()))
