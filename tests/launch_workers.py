"""Rank-side functions of tests/test_launch.py, in a module that does not import ``fdg_schedule``."""

from __future__ import annotations

import gc
import multiprocessing
import sys
import time


def sum_of_ranks(rank: int, world_size: int, scale: float) -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    # Note [a rank's own processes]: DataLoader workers start with the platform's default start method
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=2)
    return {
        "start_method": multiprocessing.get_start_method(),
        "frozen": gc.get_freeze_count(),
        "loaded": sum(float(x.sum()) for (x,) in loader),
        "rank": rank,
        "total": total * scale,
        "world": dist.get_world_size(),
        # Note [the launcher's process group]: no device bound under gloo; the operations' own timeout
        "bound_device": dist.group.WORLD.bound_device_id,
        "op_timeout_s": dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
        "fdg_schedule_modules": sorted(name for name in sys.modules if name.startswith("fdg_schedule")),
    }


def fails_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(60)  # rank 0 would wait for ever: the launcher stops it


def hangs(rank: int, world_size: int) -> None:
    time.sleep(60)
