"""A stage's data-parallel replicas end together: a failure or uneven data on one ends every rank within the timeout.

Note [replicas end together]: the replicas of a stage meet in DeepSpeed's gradient all-reduce at
every optimizer step. When one replica stops -- its loss is not finite under ``nonfinite="error"``,
it raised, or its data ended earlier than the others' -- its peers would wait in that all-reduce
for the process group's own timeout (30 minutes by default) or, worse, pair it with a different
collective. So:

* the stage's data-parallel group waits at most ``pipeline.fdg.timeout`` in any collective
  (set on the group when the engine is built), and an all-reduce that gives up is reported as an
  error naming the stage, this replica and the group's ranks. Only where the host waits for its
  collectives (gloo): under NCCL an all-reduce is queued on the stream and never waited on the
  host, and torch's NCCL watchdog ends the process (no message naming anyone) once an operation
  has been queued for the group's timeout -- counted from when the host queued it, which can be
  long before the stream gets there. So an NCCL group keeps its own timeout (10 minutes by default,
  ``deepspeed.init_distributed(timeout=...)``; keep it well above ``pipeline.fdg.timeout``), and a
  replica that stopped is named by the end-of-call check below, bounded by ``pipeline.fdg.timeout``;
* at the end of every call the replicas agree, in a gloo group of their own (so this never pairs
  with a gradient all-reduce), on two things: that none of them failed in the call's check, and
  where their data ended. A replica that found a non-finite value tells its peers before it stops;
  they stop with an error naming it (a non-finite loss on one replica usually reaches the others as
  a non-finite gradient through the all-reduce: their own error then names the replica it came
  from). Replicas whose data ended at different micro-batches stop with an error naming which ones
  ended. A replica stuck elsewhere is reported when the wait times out.

All of this runs only with more than one data-parallel replica, once per call, on host memory.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.guards import read_host
from fdg_schedule.exchange.comm import Path, choose_path

NO_LIMIT = -1  # the data has not ended on this replica
FAILURES = ["", "non-finite loss", "non-finite gradient"]  # what a replica's status word says it stopped on


class Replicas:
    """The data-parallel replicas of one stage (``grid``: DeepSpeed's ``PipelineParallelGrid``).

    Building it is collective (every rank builds its engine at the same point): it makes one gloo
    group per stage's replicas, in the same order on every rank. ``device``: the stage's (where
    DeepSpeed all-reduces its gradients; default the accelerator's).
    """

    def __init__(self, grid: Any, stage_id: int, timeout_s: float, where: str, device: Any = None) -> None:
        self.stage_id, self.where = stage_id, where
        self.timeout = timedelta(seconds=timeout_s)
        self.ranks: list[int] = list(grid.dp_group)
        self.replica = grid.data_parallel_id
        self.group: Any = None
        if len(self.ranks) < 2:
            return
        for ranks in grid.dp_groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks=list(ranks), timeout=self.timeout, backend="gloo")
            if grid.global_rank in ranks:
                self.group = group
        data_group = grid.get_data_parallel_group()
        device = torch.device(get_accelerator().device_name()) if device is None else device
        if choose_path(dist.get_backend(data_group), device) is not Path.STREAM:  # waited on the host
            set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
            set_timeout(self.timeout, data_group)

    def describe(self, replica: int) -> str:
        return f"data-parallel replica {replica} of stage {self.stage_id} (global rank {self.ranks[replica]})"

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Report a data-parallel collective that failed or timed out as an error naming the group."""
        try:
            yield
        except FDGRuntimeError:
            raise
        except RuntimeError as err:
            raise FDGRuntimeError(
                f"{self.where}: gave up on {what} among the data-parallel replicas of stage {self.stage_id} "
                f"(global ranks {self.ranks}, timeout {self.timeout.total_seconds():g} s): a replica failed, was "
                f"killed, or its data ended at another length -- see the logs of those ranks [{err}]"
            ) from err

    def mean_loss(self, losses: list[Tensor], data_group: Any, device: Any) -> Tensor:
        """The mean of a call's ``losses`` (NaN without any) over the stage's replicas, all-reduced in
        ``data_group`` (DeepSpeed's data-parallel group: the peers of this stage only)."""
        loss = torch.stack(losses).mean() if losses else torch.tensor(math.nan, device=device)
        if len(self.ranks) > 1:
            with self.collective("the loss all-reduce"):
                dist.all_reduce(loss, group=data_group)
            loss /= len(self.ranks)
        return loss

    def agree(self, limit: int | None, failed: str | None = None) -> str:
        """End of a call: raise unless every replica is fine and its data ended where this one's did.

        ``limit``: micro-batches of the segment that ended in this call (None: it did not end).
        ``failed``: this replica is about to raise for a non-finite ``"loss"`` or ``"gradient"``; its
        peers are told, nothing is raised here, and what other replicas stopped on is returned (a
        non-finite value on one replica reaches all of them through the gradient all-reduce).
        """
        if self.group is None:
            return ""
        code = 0 if failed is None else FAILURES.index(f"non-finite {failed}")
        status = torch.tensor([NO_LIMIT if limit is None else limit, code], dtype=torch.int64)
        gathered = [torch.empty_like(status) for _ in self.ranks]
        with self.collective("the end-of-call check"):
            dist.all_gather(gathered, status, group=self.group)
        rows = [read_host(t) for t in gathered]
        stopped = [(r, FAILURES[c]) for r, (_, c) in enumerate(rows) if c and r != self.replica]
        told = "; ".join(f"{self.describe(r)} stopped in the same call: {what}" for r, what in stopped)
        if failed is not None:
            return told
        if stopped:
            raise FDGRuntimeError(f"{self.where}: {told} (see its log); every replica stops with it")
        limits = {r: lim for r, (lim, _) in enumerate(rows)}
        if len(set(limits.values())) > 1:
            ended = ", ".join(
                f"replica {r}: {'not ended' if lim == NO_LIMIT else f'after {lim} micro-batches'}"
                for r, lim in limits.items()
            )
            raise FDGRuntimeError(
                f"{self.where}: the data-parallel replicas of stage {self.stage_id} (global ranks {self.ranks}) "
                f"read data of different lengths ({ended}); give every replica data of equal length (a "
                "DistributedSampler with drop_last=True, or deepspeed.initialize(training_data=...))"
            )
        return ""
