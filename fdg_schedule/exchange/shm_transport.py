"""``pipeline.fdg.transport: "shm"``: neighbours on one host linked through shared memory (:mod:`.shm_link`).

The transport finds which neighbours share this stage's host (collective, when the exchange is built); the
upstream stage of such a pair creates a :class:`~fdg_schedule.exchange.shm_link.Link` at the header exchange
and the downstream stage joins it (Note [shared-memory transport]). :class:`SharedMemoryLink` is that link
as the exchange sees it (:class:`~fdg_schedule.exchange.link.Link`): a send copies into the ring, a receive
copies out or lends the message where it lies (Note [a lent message]).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.exchange import shm_link
from fdg_schedule.exchange.link import Link, Place, gave_up


def host_id() -> str:
    """This host, as far as shared memory goes: its name, the kernel's boot id and this process's pid namespace
    (a neighbour's pid, which its link checks, means something only in the same one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = namespace = ""
    return f"{socket.gethostname()}/{boot}/{namespace}"


def same_host_neighbours(prev_rank: int | None, next_rank: int | None) -> tuple[bool, bool, int | None]:
    """Whether the previous and the next stage run on this host (Note [shared-memory transport]), and the next
    stage's pid: the only process this stage's link accepts (Note [who may connect] in fdg_schedule.exchange.shm_link).

    Collective over the default group: every rank builds its engine, and so calls this, at the same point.
    """
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, (host_id(), os.getpid()))
    mine = hosts[dist.get_rank()][0]
    prev, nxt = (rank is not None and hosts[rank][0] == mine for rank in (prev_rank, next_rank))
    return prev, nxt, hosts[next_rank][1] if nxt and next_rank is not None else None


class LinkReceive:
    """A receive through a shared-memory link: waiting copies the neighbour's next message into ``into``."""

    def __init__(self, link: shm_link.Link, into: Sequence[Tensor]) -> None:
        self.link, self.into = link, into

    def wait(self, timeout: timedelta) -> bool:
        self.link.receive(self.into, timeout)
        return True


class SharedMemoryLink:
    """A :class:`~fdg_schedule.exchange.shm_link.Link` (``shm``) as the exchange's link to one neighbour."""

    blocking_send = True  # the ring's next slot may still hold the neighbour's unread message

    def __init__(self, shm: shm_link.Link, name: str, timeout: timedelta, describe: str) -> None:
        self.shm, self.name, self.timeout, self.describe = shm, name, timeout, describe

    @property
    def capacity(self) -> float:
        return self.shm.capacity

    def send(self, tensors: Sequence[Tensor]) -> None:
        try:
            self.shm.send(tensors, self.timeout)
        except RuntimeError as err:
            raise gave_up(self.describe, self.timeout, f"reaching {self.name}", err) from err

    def post_receive(self, into: Sequence[Tensor]) -> list[Any]:
        return [LinkReceive(self.shm, into)]

    def wait(self, handles: list[Any], what: str) -> None:
        while handles:
            try:
                handles.pop(0).wait(self.timeout)
            except RuntimeError as err:
                raise gave_up(self.describe, self.timeout, f"waiting for {what}", err) from err

    def borrow(self, handles: list[Any], like: Sequence[Tensor], what: str) -> list[Tensor] | None:
        if len(handles) != 1 or not isinstance(handles[0], LinkReceive):
            return None
        handles.pop()
        try:
            return self.shm.borrow(like, self.timeout)
        except RuntimeError as err:
            raise gave_up(self.describe, self.timeout, f"waiting for {what}", err) from err

    def release(self) -> None:
        self.shm.release()

    def close(self) -> None:
        self.shm.close()


class SharedMemoryTransport:
    """Links to the neighbours on this host (:func:`same_host_neighbours`, collective); the BLOCKING path only."""

    def __init__(self, place: Place) -> None:
        if place.path != "blocking":  # refused before any rank waits
            raise FDGRuntimeError(
                f'pipeline.fdg.transport "shm" moves tensors in host memory through a process group on the host; '
                f"this stage runs on {place.device} with {place.backend} ({place.path} path): remove "
                'pipeline.fdg.transport (or set it to "process_group")'
            )
        self.place = place
        prev, nxt, self.next_pid = same_host_neighbours(place.prev_rank, place.next_rank)
        self.sides = {"prev": prev, "next": nxt}

    def create(self, nbytes: int, group_link: Link) -> tuple[Link, tuple[int, int]]:
        place = self.place
        try:
            shm = shm_link.Link.create(nbytes, peer_pid=self.next_pid)
        except OSError as err:
            raise FDGRuntimeError(
                f"{place.describe}: cannot set up the shared-memory link to {place.names['next']} ({err}); free space "
                'in /dev/shm, or remove pipeline.fdg.transport "shm" from ds_config'
            ) from err
        return SharedMemoryLink(shm, place.names["next"], place.timeout, place.describe), (shm.token, shm.capacity)

    def join(self, setup: tuple[int, int], group_link: Link) -> Link:
        place, name = self.place, self.place.names["prev"]
        try:
            shm = shm_link.Link.join(*setup, place.timeout)
        except OSError as err:
            raise gave_up(place.describe, place.timeout, f"joining the shared-memory link of {name}", err) from err
        return SharedMemoryLink(shm, name, place.timeout, place.describe)
