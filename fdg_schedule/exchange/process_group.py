"""A stage's messages through its process group: the three paths, the groups they use, and the group's link.

Note [three ways to wait]: :func:`choose_path` picks how tensors travel and how a stage waits,
from the process group's backend and the stage's device:

    path       backend, device        tensors travel          a wait                      timeout
    BLOCKING   gloo, host memory      as they are             host waits for the work     work.wait(timeout)
               (or another backend)
    STAGED     gloo, an accelerator   through host memory     host waits, copies back     work.wait(timeout)
    STREAM     nccl                   as they are (device)    the compute stream waits    a watchdog thread

The backend is the one the process group uses for the stage's device type: a default group
``"cpu:gloo,cuda:nccl"`` moves CUDA tensors through NCCL (:func:`backend_for`).

STREAM is what a GPU job runs: ``work.wait()`` without a timeout orders the compute stream after
the transfer and returns at once, so the host keeps queuing kernels; the failure timeout is kept by
:class:`~fdg_schedule.base.watchdog.Watchdog` (Note [a timeout without a blocking wait]) and send
buffers stay referenced until their transfer completes (:class:`~fdg_schedule.base.watchdog.InFlightSends`).
STAGED exists so that several ranks can share one GPU (NCCL refuses two ranks on one device), as
the device check does; it synchronises every tick and is not for training. gloo jobs on host
memory keep exactly the behaviour they always had. The STREAM path has not yet run on a GPU (no
device was lent while it was written); docs/gpu.md says how to check it.

Note [one communicator per link]: NCCL runs the operations of one communicator in order on one
stream, and a batch completes only when every send and receive in it has. Were both neighbours'
batches posted in the default group, a stage's batch with its next neighbour would wait for its batch
with its previous one, which waits for the previous stage's batch with *its* previous one, and so on:
every stage's transfers would wait for stage 0's, the lock step FDG exists to remove. Under STREAM each
pair of neighbouring stages therefore has a process group of its own per direction (:func:`link_groups`):
with one message per operation (Note [each message when it exists]) a gradient receive posted early
would otherwise hold up, on the pair's one stream, the activation send the neighbour is waiting for,
while the neighbour's early activation receive holds up the gradient send -- a deadlock. With a
communicator for each direction each stream carries the sends of one side and the receives of the
other, in one order.
Building them is collective, and so is a communicator's first operation: a ``batch_isend_irecv`` that
is a group's first operation needs every rank of the group, but at tick 0 of K >= 3 only stages 0 and 1
post. So when the exchange is built, every rank takes part in one all-ranks operation on the default
group (its communicator also carries the tied-gradient messages, ``NeighbourExchange.finish_tick``'s
``peers``) and in one operation on each of its links' communicators, in one global order: each communicator exists
before the first tick, whether or not the process group was bound to a device when it was created.

:class:`GroupTraffic` posts every operation a stage runs on its process groups (the neighbours' messages
through :class:`GroupLink`, the activation header, the control words, the tied gradients) and waits for
them as its path says; it keeps the sends until they are done.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.tensors import HOST
from fdg_schedule.base.watchdog import InFlightSends, StreamWork, Watchdog
from fdg_schedule.exchange.link import Link, Place, gave_up
from fdg_schedule.exchange.wire import PeerMessage, wire_dtype

TAG = 0x0FD6  # FDG traffic never matches DeepSpeed's own (tag 0) point-to-point messages
PEER_TAG = TAG + 1  # messages to other ranks than the neighbours (tied gradients): a stream of their own


class Path(enum.Enum):
    """How tensors travel and a stage waits for them (Note [three ways to wait])."""

    BLOCKING = "blocking"
    STAGED = "staged"
    STREAM = "stream"


def backend_for(backend: str, device_type: str) -> str:
    """The backend a process group (``dist.get_backend()``) uses for tensors of ``device_type``:
    ``"nccl"`` for ``"cuda"`` in ``"cpu:gloo,cuda:nccl"``; a single name stands for every device type."""
    if ":" not in backend:
        return backend
    per_device = dict(part.split(":", 1) for part in backend.split(","))
    return per_device.get(device_type, "")


def choose_path(backend: str, device: torch.device) -> Path:
    """The exchange path for a process group ``backend`` and the stage's ``device`` (Note [three ways to wait])."""
    used = backend_for(backend, device.type)
    if used == "nccl":
        return Path.STREAM
    if used == "gloo" and device.type != HOST.type:
        return Path.STAGED
    return Path.BLOCKING


_host_groups: dict[int, Any] = {}
_link_groups: dict[tuple[int, int, int, str], Any] = {}  # (id of the default group, rank, next rank, direction)
_warmed: set[tuple[Any, ...]] = set()  # communicators whose first operation has run (Note [one communicator per link])


def needs_host_group(backend: str, device: torch.device) -> bool:
    """Whether control words need a gloo group of their own: the data goes through a backend on an accelerator."""
    return backend_for(backend, device.type) != "gloo" and device.type != HOST.type


def host_group(backend: str, device: torch.device) -> Any:
    """The group control words travel in (Note [control words on the host]): None for the default group,
    or a gloo group of all ranks beside an accelerator backend (NCCL).

    Creating it is collective: every rank builds its engine (and so calls this) at the same point.
    """
    if not needs_host_group(backend, device):
        return None
    key = id(dist.group.WORLD)
    if key not in _host_groups:
        _host_groups[key] = dist.new_group(backend="gloo")
    return _host_groups[key]


DIRECTIONS = ("down", "up")  # activations down (stage k -> k+1), gradients up


def link_groups(
    prev_rank: int | None, next_rank: int | None, device: torch.device, host: Any
) -> dict[tuple[str, str], Any]:
    """This stage's process groups with its previous and next neighbour (None at the ends), each with its
    first operation run (Note [one communicator per link]).

    Collective over the default group: every rank builds its exchange, and so calls this, at the same
    point. ``host``: the group the ranks' links are gathered in (the control words' gloo group, or None).
    """
    world, rank = id(dist.group.WORLD), dist.get_rank()
    nexts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nexts, next_rank, group=host)  # every rank's next stage: every link of the job
    links = sorted((r, n) for r, n in enumerate(nexts) if n is not None)
    keys = [(world, *link, direction) for link in links for direction in DIRECTIONS]
    for key in keys:  # new_group is collective: every rank creates every group, in one order
        if key not in _link_groups:
            _link_groups[key] = dist.new_group(ranks=[key[1], key[2]])
    first: list[tuple[tuple[Any, ...], Any]] = [((world,), None)]
    first += [(key, _link_groups[key]) for key in keys if rank in key[1:3]]
    for key, group in first:  # the default group (all ranks), then this rank's links in the job's order
        if key not in _warmed:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
            _warmed.add(key)
    return {
        (side, direction): None if peer is None else _link_groups[(world, *pair, direction)]
        for side, peer, pair in (("prev", prev_rank, (prev_rank, rank)), ("next", next_rank, (rank, next_rank)))
        for direction in DIRECTIONS
    }


class HostWork:
    """A work of the host group under STREAM (control words): waited on the host, with the timeout."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def wait(self, timeout: timedelta) -> bool:
        return self.work.wait(timeout=timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()


def split_works(works: list[Any], sends: int, recvs: int) -> tuple[list[Any], list[Any]]:
    """The works of a batch's sends and of its receives.

    gloo returns one work per operation, in order. NCCL coalesces the whole batch into one work
    (``batch_isend_irecv``'s coalescing manager): it stands for the sends and for the receives.
    """
    if len(works) == sends + recvs:
        return works[:sends], works[sends:]
    if len(works) != 1:
        raise FDGRuntimeError(f"batch_isend_irecv returned {len(works)} works for {sends + recvs} operations")
    return (works if sends else []), (works if recvs else [])


class GroupTraffic:
    """Every operation of one stage on its process groups, posted and waited for as its :class:`Path` says.

    ``host_group``: the control words' group (:func:`host_group`); ``mark``: under STREAM, called right after
    each post (:func:`~fdg_schedule.base.watchdog.stream_mark`). Host-waited sends are kept until the end of
    the next tick (:meth:`retire_sends`); stream-ordered ones until their transfer completes.
    """

    def __init__(
        self, path: Path, host: Any, timeout: timedelta, describe: str, mark: Callable[[], Callable[[], bool]]
    ) -> None:
        self.path, self.host_group, self.timeout, self.describe = path, host, timeout, describe
        self._mark = mark
        self.watchdog = Watchdog(timeout.total_seconds(), describe) if path is Path.STREAM else None
        self.reset()

    def reset(self) -> None:
        """Forget every send (a new process restoring a checkpoint)."""
        self._sends: list[tuple[Any, str]] = []  # this tick's host-waited sends, waited at the end of the next
        self._send_refs: list[Tensor] = []
        self._older: tuple[list[tuple[Any, str]], list[Tensor]] = ([], [])  # the previous tick's
        self._in_flight = InFlightSends()  # STREAM: sends nobody waits for

    def check(self) -> None:
        """Raise the watchdog's failure, if it recorded one (Note [a timeout without a blocking wait])."""
        if self.watchdog is not None:
            self.watchdog.raise_if_failed()

    def post(
        self, sends: list[tuple[Any, Tensor]], recvs: list[tuple[Any, Tensor]], name: str, group: Any, tag: int = TAG
    ) -> list[Any]:
        """One ``batch_isend_irecv`` of ``(peer, tensor)`` sends and receives; returns the receives' works."""
        if not sends and not recvs:
            return []
        ops = [dist.P2POp(dist.isend, t, peer, group=group, tag=tag) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=group, tag=tag) for peer, t in recvs]
        try:
            works: list[Any] = list(dist.batch_isend_irecv(ops))
        except RuntimeError as err:
            raise gave_up(self.describe, self.timeout, f"reaching {name}", err) from err
        host = group is not None and group is self.host_group
        if host:  # Note [control words on the host]: waited on the host
            works = [HostWork(w) for w in works]
        elif self.watchdog is not None:  # the clock of its timeout starts when the stream gets here
            reached = self._mark()
            works = [StreamWork(w, reached) for w in works]
        send_works, recv_works = split_works(works, len(sends), len(recvs))
        tensors = [t for _, t in sends]
        if self.watchdog is not None and not host:  # stream-ordered: nobody waits for these sends
            self.watchdog.watch(send_works, f"{name} to take what this stage sent")
            self._in_flight.keep(send_works, tensors)
        else:
            self._sends += [(w, name) for w in send_works]
            self._send_refs += tensors  # isend does not copy: keep the tensors alive until it completes
        return recv_works

    def post_peers(
        self, peers: Sequence[PeerMessage], name: str, out: Callable[[Tensor], Tensor], wire: torch.device
    ) -> tuple[list[Any], list[tuple[Tensor, Tensor]]]:
        """The tied-gradient messages to other ranks (one batch, :data:`PEER_TAG`; their control words in the host
        group beside an accelerator backend): the receives' works, and each receive's (landing, caller's) tensors.
        ``out``: a tensor as it travels; ``wire``: where tensors travel from and arrive in."""
        sends = [(m.peer, out(t)) for m in peers for t in m.sends]
        pairs = [(_landing(t, wire), t) for m in peers for t in m.recvs]
        recvs = [(peer, landing) for peer, (landing, _) in zip([m.peer for m in peers for _ in m.recvs], pairs)]
        words_out = [(m.peer, w) for m in peers for w in m.words_out]
        words_in = [(m.peer, w) for m in peers for w in m.words_in]
        if self.host_group is None:  # Note [control words on the host]
            works = self.post(sends + words_out, recvs + words_in, name, None, PEER_TAG)
        else:
            works = self.post(sends, recvs, name, None, PEER_TAG)
            works += self.post(words_out, words_in, name, self.host_group, PEER_TAG)
        return works, pairs

    def wait(self, works: list[Any], what: str) -> None:
        """Wait for and forget each work (a gloo receive waited twice waits for a second message).

        STREAM: a device transfer's ``wait()`` orders the compute stream after it and returns; the
        watchdog keeps its timeout (Note [a timeout without a blocking wait]). Host messages (gloo)
        are waited for on the host, bounded by the timeout, on every path.
        """
        if self.watchdog is not None:
            self.watchdog.raise_if_failed()
            stream_ordered = [w for w in works if not isinstance(w, HostWork)]
            self.watchdog.watch(stream_ordered, what)
        while works:
            work = works.pop(0)
            try:
                if self.watchdog is not None and not isinstance(work, HostWork):
                    work.wait()
                else:
                    work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise gave_up(self.describe, self.timeout, f"waiting for {what}", err) from err

    def retire_sends(self) -> int:
        """Wait for the previous tick's host-waited sends (the neighbour took them in its tick, long since:
        waiting for this tick's would wait for the neighbour); this tick's become the previous. Returns the
        waits it ran."""
        sends, _ = self._older
        waited = len(sends)
        while sends:
            work, name = sends.pop(0)
            self.wait([work], f"{name} to take what this stage sent")
        self._older, self._sends, self._send_refs = (self._sends, self._send_refs), [], []
        self._in_flight.release_completed()
        return waited

    def settle(self) -> None:
        """Until every stream-ordered send has completed (polled, bounded by the timeout): before a checkpoint."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        self._in_flight.release_completed()
        while self._in_flight.held():
            self.check()
            if time.monotonic() > deadline:
                err = TimeoutError("stream-ordered sends")
                raise gave_up(self.describe, self.timeout, "waiting for the sends to complete", err)
            time.sleep(0.001)
            self._in_flight.release_completed()

    def unsent(self) -> bool:
        """Whether a send is not yet known to have completed."""
        return bool(self._sends or self._older[0] or self._in_flight.held())


def _landing(t: Tensor, wire: torch.device) -> Tensor:
    """Where a receive into ``t`` lands: ``t`` itself when it can travel as it is."""
    if t.device == wire and t.is_contiguous() and t.dtype != torch.bool:
        return t
    return torch.empty(t.shape, dtype=wire_dtype(t.dtype), device=wire)


class GroupLink:
    """The link to one neighbour through the process group (the :class:`~fdg_schedule.exchange.link.Link` every
    stage starts with): each message one batch, in the pair's own group for its direction under STREAM."""

    capacity = math.inf
    blocking_send = False

    def __init__(self, traffic: GroupTraffic, peer: int | None, name: str, send_group: Any, recv_group: Any) -> None:
        self.traffic, self.peer, self.name = traffic, peer, name
        self.send_group, self.recv_group = send_group, recv_group

    def send(self, tensors: Sequence[Tensor]) -> None:
        self.traffic.post([(self.peer, t) for t in tensors], [], self.name, self.send_group)

    def post_receive(self, into: Sequence[Tensor]) -> list[Any]:
        return self.traffic.post([], [(self.peer, t) for t in into], self.name, self.recv_group)

    def wait(self, handles: list[Any], what: str) -> None:
        self.traffic.wait(handles, what)

    def borrow(self, handles: list[Any], like: Sequence[Tensor], what: str) -> list[Tensor] | None:
        return None  # gloo writes into the posted buffers: nothing to lend

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def group_links(
    traffic: GroupTraffic, prev_rank: int | None, next_rank: int | None, names: Mapping[str, str], device: torch.device
) -> tuple[dict[str, Link], dict[tuple[str, str], Any]]:
    """This stage's :class:`GroupLink` to each neighbour, and the groups they use by (side, direction): the
    default group (None), but under STREAM the pairs' own (Note [one communicator per link]; then collective)."""
    groups: dict[tuple[str, str], Any] = {(side, d): None for side in ("prev", "next") for d in DIRECTIONS}
    if traffic.path is Path.STREAM:
        groups = link_groups(prev_rank, next_rank, device, traffic.host_group)
    links: dict[str, Link] = {
        "prev": GroupLink(traffic, prev_rank, names["prev"], groups[("prev", "up")], groups[("prev", "down")]),
        "next": GroupLink(traffic, next_rank, names["next"], groups[("next", "down")], groups[("next", "up")]),
    }
    return links, groups


class ProcessGroupTransport:
    """``pipeline.fdg.transport: "process_group"``: no links of its own; every message goes through the group."""

    sides: Mapping[str, bool] = {"prev": False, "next": False}

    def __init__(self, place: Place) -> None:
        del place  # nothing to set up

    def create(self, nbytes: int, group_link: Link) -> tuple[Link, tuple[int, int]]:
        raise FDGRuntimeError("the process-group transport sets up no link (a bug)")

    def join(self, setup: tuple[int, int], group_link: Link) -> Link:
        raise FDGRuntimeError("the process-group transport sets up no link (a bug)")
