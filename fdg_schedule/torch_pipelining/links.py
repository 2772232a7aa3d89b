"""A PipelineStage's messages to its two neighbours, one tick at a time, with every wait bounded by a timeout.

Note [one post per tick]: at the end of tick t a stage posts, as non-blocking operations, the activation
and the input gradient it made in tick t and the receives of what it reads in tick t + 1 (the activation
of the micro-batch it forwards, the gradient of the one it back-propagates). It waits for a receive right
before the instruction that reads it, and for its sends of tick t at the end of tick t + 1, before it posts
again. Each direction of each link carries one ordered stream of messages (activations down, gradients
up), matched in the order they were posted, so no ordering between neighbours is needed: every wait of
tick t + 1 depends only on what the neighbours posted at the end of tick t. The operations are torch's own
``P2POp``s from the stage (``get_fwd_send_ops`` ...), issued one by one as torch's ``_batch_p2p`` issues a
batch of one kind. Posted receives outlive a ``step()`` call: that is how micro-batches carry over.

A wait gives up after ``timeout`` (gloo's ``work.wait(timeout)``) and raises :class:`FDGRuntimeError`
naming the neighbour; a neighbour whose process ended usually fails the wait at once (its connection closes).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fdg_schedule.base.errors import FDGRuntimeError


def describe_rank(stage_index: int, group: Any, group_rank: int, replica: int | None = None) -> str:
    """``stage 1 (global rank 3)``, with ``, data-parallel replica 1`` when there are replicas."""
    try:
        global_rank = dist.get_global_rank(group or dist.distributed_c10d._get_default_group(), group_rank)
    except (RuntimeError, ValueError):
        global_rank = group_rank
    extra = "" if replica is None else f", data-parallel replica {replica}"
    return f"stage {stage_index} (global rank {global_rank}{extra})"


class Links:
    """Posts and waits for one stage's per-tick messages (Note [one post per tick]).

    Args:
        name: how errors name this stage (:func:`describe_rank`).
        prev, next: how errors name the neighbours (None: no such neighbour).
        timeout: seconds any wait may take.
    """

    def __init__(self, name: str, prev: str | None, next: str | None, timeout: float) -> None:
        self.name, self.prev, self.next = name, prev, next
        self.timeout = timedelta(seconds=timeout)
        self._activation: list[Any] = []  # works of the posted activation receives
        self._grad: list[Any] = []  # ... of the gradient receives
        self._sends: list[tuple[Any, Any]] = []  # (work, tensor): a send and what it reads, until waited

    def post(
        self,
        sends: Sequence[tuple[dist.P2POp, str | None]],
        activations: Sequence[dist.P2POp],
        grads: Sequence[dist.P2POp],
    ) -> None:
        """Wait for the previous post's sends, then post this tick's sends (each with the neighbour it goes to)
        and next tick's receives."""
        self.wait_sends()
        for op, to in sends:
            try:
                work = op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
            except RuntimeError as err:
                raise self._failed(f"sending to {to}", err) from err
            self._sends.append((work, op.tensor))
        for ops, works, source in ((activations, self._activation, self.prev), (grads, self._grad, self.next)):
            for op in ops:
                try:
                    works.append(op.op(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer))
                except RuntimeError as err:
                    raise self._failed(f"posting a receive from {source}", err) from err

    def wait_activation(self) -> None:
        self._wait(self._activation, f"the activation from {self.prev}")

    def wait_grad(self) -> None:
        self._wait(self._grad, f"the gradient from {self.next}")

    def wait_sends(self) -> None:
        works = [work for work, _ in self._sends if work is not None]
        self._sends.clear()
        self._wait(works, "a neighbour to take what this stage sent")

    def pending_activation(self) -> bool:
        return bool(self._activation)

    def pending_grad(self) -> bool:
        return bool(self._grad)

    def _wait(self, works: list[Any], what: str) -> None:
        while works:
            work = works.pop(0)
            if work is None:
                continue
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise self._failed(f"waiting for {what}", err) from err

    def _failed(self, doing: str, err: Exception) -> FDGRuntimeError:
        return FDGRuntimeError(
            f"{self.name}: gave up {doing} (timeout {self.timeout.total_seconds():g} s): that rank failed, was "
            f"killed or stopped sending -- see its log (ScheduleFDG(timeout=...)) [{err}]"
        )
