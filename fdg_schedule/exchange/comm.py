"""The point-to-point messages between a stage and its two pipeline neighbours, each sent when it exists.

Activations go down (stage k -> k+1); input gradients and the loss they belong to go up
(k+1 -> k). Every wait is bounded by the configured timeout and names the neighbour it gave up on.

Note [each message when it exists]: a message leaves as soon as the instruction that made it has
run, as its own non-blocking operation: the input gradient right after the stage's backward (before
the all-reduce, the step and the forward), the activation right after the forward. A receive is
posted as soon as the previous one was waited for (right after the tick's ``WaitGrad`` /
``WaitActivation``, or at the start of the tick before the first one), and waited for right before
the instruction that reads it. So the previous stage's gradient travels while this stage reduces,
steps and forwards, and the transfer is off the critical path whenever it is shorter than that
(under gloo a transfer starts only once both sides have posted: the early receive matters). The
schedule places each send and each posted receive (``sa`` ``sg`` ``pa`` ``pg`` in its text,
:mod:`fdg_schedule.sched.schedule`); the tick ends with :meth:`NeighbourExchange.finish_tick`, which
sends what had to wait for a header, waits for the previous tick's sends and posts the tied-gradient
messages. Under gloo this is deadlock-free without parity ordering: each direction of each link
carries one ordered stream of messages, matched in the order they were posted.

Shapes and dtypes of activations travel once, before the first activation, in a small int64
header (and before every activation when the module has ``dynamic_shape=True``). An activation that
needs a header, and the receive that expects one, wait for the end of the tick, where both
neighbours exchange the header (blocking) and then post them: the receiver cannot size its buffers
before, and a shared-memory link changes there (Note [shared-memory transport]).

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
group (its communicator also carries the tied-gradient messages, :meth:`NeighbourExchange.finish_tick`'s
``peers``) and in one operation on each of its links' communicators, in one global order: each communicator exists
before the first tick, whether or not the process group was bound to a device when it was created.

Note [shared-memory transport] (in :mod:`fdg_schedule.exchange.shm_link`): with ``pipeline.fdg.transport:
"shm"``, neighbours on one host exchange their per-tick messages (activations with their control
word, gradients with their loss) through a shared-memory :class:`~fdg_schedule.exchange.shm_link.Link`
instead of the process group, on the BLOCKING path. The link is set up inside the activation header
exchange, which then also runs when a pair has no link yet (the first tick, and the first after a
checkpoint is loaded); until then, and between neighbours on different hosts, messages travel as
they always did. Both sides of a pair gain and lose the link at the same header exchange, at a tick's
end, so they agree on which way each message goes: activations that need the header are sent after it
on the new link, and a gradient the downstream stage sent in that tick (before it reads the header)
went the old way, where the upstream stage's receive, posted earlier in the tick, takes it before it
changes links. Headers and tied gradients always travel through the group.

Note [the fastest transport by default]: ``pipeline.fdg.transport: "auto"`` (the default) is ``"shm"`` where
the shared-memory link can run (Linux, and the BLOCKING path: a stage on the CPU whose group is gloo), and
``"process_group"`` everywhere else (:func:`resolve_transport`). Under ``"shm"`` each side still checks that its
neighbour shares the host, and neighbours on other hosts keep the group, so "auto" never changes where a
message can go, only how. Measured at K = 2 on this project's CPU machine (docs/performance.md, issue 62's seven
nets at GAS 4), FDG over the link read 0.92-0.98 of the two-stage ceiling and over the process group 0.87-0.96:
gloo moves every message through a socket and a transport thread of its own that competes with the stages'
compute for the cores.

Note [no wait between calls]: a ``train_batch()`` call ends with its last tick's receives still posted and its
sends in flight; the next call's first wait takes them (:meth:`NeighbourExchange.complete` runs only where
everything must have arrived: the end of a segment, a checkpoint). The work a call does around its ticks (the
non-finite check, the loss, monitors, the caller's own loop) then overlaps the neighbour's compute instead of
following a wait for it. :attr:`NeighbourExchange.waits` counts every blocking operation with a neighbour, so a
test can check that none happens outside a tick.

Note [control words on the host]: the end-of-data word that travels with every activation (and, under
fp16, the loss-scale ceiling after it: Note [loss scale per stage] in fdg_schedule.precision.loss_scale), and
the shape header, must be read on the host (they decide what the next instructions are). They are
host-memory tensors on every path -- sent in the same batch as the data under gloo (or any
backend on host memory), through a gloo group of all ranks beside NCCL (or any backend on an
accelerator) -- so reading them (``guards.read_host``)
waits for the neighbour's message, never for the device's queue.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.guards import read_host
from fdg_schedule.base.tensors import HOST
from fdg_schedule.base.watchdog import InFlightSends, StreamWork, Watchdog, stream_mark
from fdg_schedule.exchange.shm_link import Link, message_bytes
from fdg_schedule.precision.loss_scale import from_word, to_word

_HEADER_INTS = 256
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]  # fmt: skip
TAG = 0x0FD6  # FDG traffic never matches DeepSpeed's own (tag 0) point-to-point messages
PEER_TAG = TAG + 1  # messages to other ranks than the neighbours (tied gradients): a stream of their own
NO_END = -1  # the control word of an activation while data keeps coming
_LINK_INTS = 2  # the header's last ints: a new shared-memory link's token and slot bytes (0, 0: none)

Meta = list[tuple[torch.Size, torch.dtype]]


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


def resolve_transport(transport: str, path: Path, platform: str = sys.platform) -> str:
    """``pipeline.fdg.transport`` as it will run: ``"auto"`` becomes ``"shm"`` on Linux on the BLOCKING path and
    ``"process_group"`` elsewhere (Note [the fastest transport by default]); the other values stay as given."""
    if transport != "auto":
        return transport
    return "shm" if path is Path.BLOCKING and platform.startswith("linux") else "process_group"


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


def meta_of(tensors: Sequence[Tensor]) -> Meta:
    return [(t.shape, t.dtype) for t in tensors]


@dataclasses.dataclass
class PeerMessage:
    """What a tick sends to, and receives from, one more rank than the neighbours (tied gradients).

    ``recvs`` are filled in place by :meth:`NeighbourExchange.wait_peers`; ``words_out`` / ``words_in``
    are small int64 tensors in host memory (control words, Note [control words on the host]).
    """

    peer: int  # global rank
    stage: int  # its stage, for messages
    sends: list[Tensor]
    recvs: list[Tensor]
    words_out: list[Tensor] = dataclasses.field(default_factory=list)
    words_in: list[Tensor] = dataclasses.field(default_factory=list)


class NeighbourExchange:
    """Posts and completes the per-tick point-to-point messages of one stage.

    Args:
        prev_rank / next_rank: global ranks of the neighbouring stages (None at the ends).
        device: where received tensors are allocated.
        dynamic_shape: send the activation header every time instead of once.
        stage_id: this stage.
        timeout_s: how long any wait may block before the neighbour is declared failed.
        plan: the schedule of every stage around the current tick, as text, for errors that
            mean the stages disagree on it (a wait with no receive posted).
        describe: names a stage in error messages, given its stage id and global rank.
        path: how to move and wait (default: :func:`choose_path` for the default group and ``device``).
        transport: ``pipeline.fdg.transport``. ``"shm"``: exchange with each neighbour on this host
            through a shared-memory link (Note [shared-memory transport]); the path must be BLOCKING.
            Finding the neighbours' hosts is collective: every rank builds its exchange at the same point.
            ``"auto"``: :func:`resolve_transport` (Note [the fastest transport by default]); :attr:`transport` is the
            one that runs.
        mark: under STREAM, called right after each post: whether the stream has reached it since
            (:func:`~fdg_schedule.base.watchdog.stream_mark`, Note [a timeout without a blocking wait]).
        loss_scale: fp16 (Note [loss scale per stage] in fdg_schedule.precision.loss_scale): an activation's control
        word
            also carries the loss-scale ceiling (``post(ceiling=...)``, :attr:`ceiling_in`), and the loss
            message is ``(loss, scale)``, float32 (:attr:`scale_in`).

    Under STREAM, building it is collective (Note [one communicator per link]).
    """

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        dynamic_shape: bool,
        stage_id: int,
        timeout_s: float,
        plan: Callable[[], str] = lambda: "",
        describe: Callable[[int, int | None], str] = lambda stage, rank: f"stage {stage} (global rank {rank})",
        path: Path | None = None,
        transport: str = "process_group",
        mark: Callable[[], Callable[[], bool]] = stream_mark,
        loss_scale: bool = False,
    ) -> None:
        self.path = choose_path(dist.get_backend(), device) if path is None else path
        self.transport = transport = resolve_transport(transport, self.path)
        self.waits = 0  # blocking operations with a neighbour so far (Note [no wait between calls])
        if transport == "shm" and self.path is not Path.BLOCKING:  # refused before any rank waits
            raise FDGRuntimeError(
                f'pipeline.fdg.transport "shm" moves tensors in host memory through a process group on the host; '
                f"this stage runs on {device} with {dist.get_backend()} ({self.path.value} path): remove "
                'pipeline.fdg.transport (or set it to "process_group")'
            )
        same_host = same_host_neighbours(prev_rank, next_rank) if transport == "shm" else (False, False, None)
        self.shared_memory = {"prev": same_host[0], "next": same_host[1]}
        self.next_pid = same_host[2]  # the only process the link to the next stage accepts
        self.links: dict[str, Link | None] = {"prev": None, "next": None}
        self._lent: dict[str, Link] = {}  # "activation", "grad": a message read where it lies (Note [a lent message])
        self.lent = 0  # messages read where they lay, so far
        self.wire = HOST if self.path is Path.STAGED else device  # where tensors travel from and arrive in
        self.host_group = host_group(dist.get_backend(), device)
        self.groups: dict[tuple[str, str], Any] = {  # (side, direction) -> the default group, but under STREAM:
            (side, direction): None for side in ("prev", "next") for direction in DIRECTIONS
        }
        if self.path is Path.STREAM:  # Note [one communicator per link]
            self.groups = link_groups(prev_rank, next_rank, device, self.host_group)
        self._mark = mark
        self.loss_scale = loss_scale
        self.ceiling_in: float | None = None  # what the last activation waited for carried (loss_scale)
        self.scale_in: Tensor | None = None  # ... and the last gradient: the scale it was made with
        self.plan = plan
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.device, self.dynamic_shape = device, dynamic_shape
        self.describe = describe(stage_id, dist.get_rank())
        self._describe = describe
        self._prev = describe(stage_id - 1, prev_rank)
        self._next = describe(stage_id + 1, next_rank)
        self.timeout = timedelta(seconds=timeout_s)
        self.sent_meta: Meta | None = None
        self.recv_meta: Meta | None = None
        self._sends: list[tuple[Any, str]] = []  # this tick's host-waited sends, waited at the end of the next
        self._send_refs: list[Tensor] = []
        self._older: tuple[list[tuple[Any, str]], list[Tensor]] = ([], [])  # the previous tick's
        self._deferred_send: tuple[tuple[Tensor, ...], Tensor] | None = None  # an activation waiting for its header
        self._deferred_recv = False  # the activation receive, waiting for its header
        self._in_flight = InFlightSends()  # STREAM: sends nobody waits for
        self.watchdog = Watchdog(timeout_s, self.describe) if self.path is Path.STREAM else None
        self._activation: tuple[list[Any], list[Tensor]] | None = None  # works: dist.Work or HostWork
        self._grad: tuple[list[Any], list[Tensor], Tensor] | None = None
        self._peers: tuple[list[Any], list[tuple[Tensor, Tensor]]] | None = None  # works, (wire, caller's) pairs

    def post(
        self,
        activation: Sequence[Tensor] | None,
        grads: Sequence[Tensor] | None,
        loss: Tensor | None,
        recv_activation: bool,
        recv_grad_meta: Meta | None,
        end: int = NO_END,
        peers: Sequence[PeerMessage] = (),
        ceiling: float | None = None,
    ) -> None:
        """A whole tick's messages at once, as FDG's exchange ran before the messages were split: the activation
        header first (a shared-memory link changes there, and a gradient receive still pending then is an error:
        the callers' ticks are out of step), then the gradients+loss and the activation sent, next tick's
        receives posted, and :meth:`finish_tick`.

        The engine sends and posts each message where its schedule says (Note [each message when it
        exists]); this is for tools and tests that drive an exchange tick by tick.
        """
        self._check_watchdog()
        sending = self._dummy_activation() if end != NO_END else activation
        header_out = sending is not None and self._header_out(sending)
        header_in = recv_activation and self._header_in()
        if header_out or header_in:  # the header first, as the one batch did: nothing of this tick waits for it
            self._exchange_headers(sending if header_out else None, header_in, pending_grad="refuse")
        if grads is not None:
            self.send_grad(grads, loss)
        if sending is not None:
            self.send_activation(activation, end, ceiling)
        if recv_activation:
            self.post_recv_activation()
        if recv_grad_meta is not None:
            self.post_recv_grad(recv_grad_meta)
        self.finish_tick(peers)

    def send_grad(self, grads: Sequence[Tensor], loss: Tensor | None) -> None:
        """Send a backward's input gradients and the loss they carry to the previous stage, now (non-blocking)."""
        self._check_watchdog()
        sends = [*(self._out(g) for g in grads), self._out(_loss_message(loss))]
        self._via("prev", "up", self._prev, sends, [])

    def send_activation(
        self, activation: Sequence[Tensor] | None, end: int = NO_END, ceiling: float | None = None
    ) -> None:
        """Send a forward's output to the next stage with its control word, now (non-blocking); or, when it
        needs a header first (its shapes are new, or a shared-memory link is set up), at :meth:`finish_tick`.

        ``end``: the segment's number of micro-batches when the data ran out, sent instead of an activation in
        a dummy of the last activation's shapes (Note [end of data]). ``ceiling``: the loss-scale ceiling in
        the control word (``loss_scale`` only).
        """
        self._check_watchdog()
        if end != NO_END:
            activation = self._dummy_activation()
        assert activation is not None
        words = [end, to_word(math.inf if ceiling is None else ceiling)] if self.loss_scale else [end]
        message = (tuple(activation), torch.tensor(words, dtype=torch.int64))  # the word on the host
        if self._header_out(activation):
            self._deferred_send = message
            return
        self._check_same_shapes(activation)
        self._post_activation(*message)

    def post_recv_activation(self) -> None:
        """Post the receive of the activation next tick's forward reads (at :meth:`finish_tick` when a header
        comes first)."""
        if self._header_in():
            self._deferred_recv = True
            return
        self._post_recv_activation()

    def post_recv_grad(self, meta: Meta) -> None:
        """Post the receive of the gradient (shapes ``meta``: this stage's output) next tick's backward reads."""
        if self._grad is not None:
            raise FDGRuntimeError(f"{self.describe}: a gradient receive was posted twice\n{self.plan()}")
        grads = [torch.empty(s, dtype=d, device=self.wire) for s, d in meta]
        loss = torch.empty(1 + self.loss_scale, dtype=torch.float32, device=self.wire)
        self._grad = (self._via("next", "up", self._next, [], [*grads, loss]), grads, loss)

    def finish_tick(self, peers: Sequence[PeerMessage] = ()) -> None:
        """End the tick's exchange: the activation header and what waited for it (blocking, only when a header
        travels), the previous tick's sends waited for, and the tied-gradient messages to other ranks
        (``peers``, one more batch; :meth:`wait_peers` waits for them)."""
        self._check_watchdog()
        deferred, self._deferred_send = self._deferred_send, None
        recv, self._deferred_recv = self._deferred_recv, False
        if deferred is not None or recv:
            self._exchange_headers(None if deferred is None else deferred[0], recv)
            if deferred is not None:
                self._post_activation(*deferred)
            if recv:
                self._post_recv_activation()
        self._retire_sends()
        if peers:
            self._post_peers(peers)

    def _post_activation(self, activation: Sequence[Tensor], word: Tensor) -> None:
        data = [self._out(t) for t in activation]
        if self.host_group is None:  # Note [control words on the host]: one message with its word
            self._via("next", "down", self._next, [*data, word], [])
        else:
            self._via("next", "down", self._next, data, [])
            self._batch(self.next_rank, self._next, [word], [], self.host_group)

    def _post_recv_activation(self) -> None:
        if self._activation is not None:
            raise FDGRuntimeError(f"{self.describe}: an activation receive was posted twice\n{self.plan()}")
        assert self.recv_meta is not None
        data = [torch.empty(s, dtype=_wire_dtype(d), device=self.wire) for s, d in self.recv_meta]
        word = torch.empty(1 + self.loss_scale, dtype=torch.int64)
        if self.host_group is None:
            works = self._via("prev", "down", self._prev, [], [*data, word])
        else:
            works = self._via("prev", "down", self._prev, [], data)
            works += self._batch(self.prev_rank, self._prev, [], [word], self.host_group)
        self._activation = (works, [*data, word])

    def _check_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.raise_if_failed()

    def _via(self, side: str, direction: str, name: str, sends: list[Tensor], recvs: list[Tensor]) -> list[Any]:
        """One message with one neighbour: through its shared-memory link if the pair has one, else one batch (in
        the pair's own group for that ``direction``, "down" or "up", under STREAM: Note [one communicator per
        link])."""
        link = self.links[side]
        if link is None:
            peer = self.prev_rank if side == "prev" else self.next_rank
            return self._batch(peer, name, sends, recvs, self.groups[(side, direction)])
        if sends:
            self.waits += 1  # the link's slot may still hold the neighbour's previous message
            try:
                link.send(sends, self.timeout)
            except RuntimeError as err:
                raise self._failed(f"reaching {name}", err) from err
        return [LinkReceive(link, recvs)] if recvs else []

    def _post_peers(self, peers: Sequence[PeerMessage]) -> None:
        if self._peers is not None:
            raise FDGRuntimeError(f"{self.describe}: the previous tick's peer messages were never waited for")
        name = ", ".join(sorted({self._stage_name(m) for m in peers}))
        sends = [(m.peer, self._out(t)) for m in peers for t in m.sends]
        pairs = [(self._wire_buffer(t), t) for m in peers for t in m.recvs]
        recvs = [(peer, wire) for peer, (wire, _) in zip([m.peer for m in peers for _ in m.recvs], pairs)]
        words_out = [(m.peer, w) for m in peers for w in m.words_out]
        words_in = [(m.peer, w) for m in peers for w in m.words_in]
        if self.host_group is None:  # Note [control words on the host]
            works = self._post_ops(sends + words_out, recvs + words_in, name, None, PEER_TAG)
        else:
            works = self._post_ops(sends, recvs, name, None, PEER_TAG)
            works += self._post_ops(words_out, words_in, name, self.host_group, PEER_TAG)
        self._peers = (works, pairs)

    def _wire_buffer(self, t: Tensor) -> Tensor:
        """Where a receive into ``t`` lands: ``t`` itself when it can travel as it is."""
        if t.device == self.wire and t.is_contiguous() and t.dtype != torch.bool:
            return t
        return torch.empty(t.shape, dtype=_wire_dtype(t.dtype), device=self.wire)

    def _stage_name(self, m: PeerMessage) -> str:
        return self._describe(m.stage, m.peer)

    def wait_peers(self) -> None:
        """Wait for the peer messages posted last (bounded); their receive tensors then hold what arrived."""
        if self._peers is None:
            return
        works, pairs = self._peers
        self._peers = None
        self._wait(works, "the tied gradients from the other owners")
        for wire, own in pairs:
            if wire is not own:
                own.copy_(_unwire(wire, own.dtype))

    def _out(self, t: Tensor) -> Tensor:
        """``t`` as it travels: contiguous, bool as bytes, in host memory on the STAGED path (a copy the host
        waits for: gloo reads it from there)."""
        t = _wire(t)
        return t if t.device == self.wire else t.to(self.wire)

    def _in(self, t: Tensor) -> Tensor:
        """A received tensor on the stage's device: from host memory (STAGED) without a host synchronisation."""
        return t.to(self.device, non_blocking=True)

    def _dummy_activation(self) -> tuple[Tensor, ...]:
        if self.sent_meta is None:
            raise FDGRuntimeError(
                f"{self.describe}: the data ran out before the first micro-batch; the next stage cannot be told "
                "-- give train_batch() a non-empty iterator"
            )
        return tuple(torch.zeros(s, dtype=d, device=self.device) for s, d in self.sent_meta)

    def _batch(
        self, peer: int | None, name: str, sends: list[Tensor], recvs: list[Tensor], group: Any = None
    ) -> list[Any]:
        """One batched exchange with one neighbour; returns the receives' works (sends are kept)."""
        return self._post_ops([(peer, t) for t in sends], [(peer, t) for t in recvs], name, group, TAG)

    def _post_ops(
        self, sends: list[tuple[Any, Tensor]], recvs: list[tuple[Any, Tensor]], name: str, group: Any, tag: int
    ) -> list[Any]:
        """One ``batch_isend_irecv`` of ``(peer, tensor)`` sends and receives; returns the receives' works."""
        if not sends and not recvs:
            return []
        ops = [dist.P2POp(dist.isend, t, peer, group=group, tag=tag) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=group, tag=tag) for peer, t in recvs]
        try:
            works: list[Any] = list(dist.batch_isend_irecv(ops))
        except RuntimeError as err:
            raise self._failed(f"reaching {name}", err) from err
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

    def wait_activation(self, lend: bool = False) -> tuple[tuple[Tensor, ...], int]:
        """The activation posted for this tick and its control word (blocks until it has arrived). ``lend``: through
        a shared-memory link, the tensors view its slot until :meth:`own_activation` (Note [a lent message])."""
        if self._activation is None:
            raise FDGRuntimeError(f"{self.describe}: no activation receive was posted for this tick\n{self.plan()}")
        works, bufs = self._activation
        self._activation = None
        if lend:
            bufs = self._borrow("activation", works, bufs, self._prev) or bufs
        self._wait(works, f"the activation from {self._prev}")
        assert self.recv_meta is not None
        tensors = tuple(self._in(_unwire(t, d)) for t, (_, d) in zip(bufs, self.recv_meta))
        words = read_host(bufs[-1])  # Note [control words on the host]
        if self.loss_scale:
            self.ceiling_in = from_word(words[1])
        if words[0] != NO_END:  # a dummy: nothing reads it
            self._release("activation")
        return tensors, words[0]

    def own_activation(self, leaves: Sequence[Tensor], clones: Sequence[Tensor]) -> None:
        """After the stage forward read the received activation ``leaves`` into its ``clones``: where the
        activation was lent (Note [a lent message]), each leaf takes its clone's data when the forward left the
        clone as it was (else a copy of its own), and the slot goes back to the link."""
        if self._lent.get("activation") is None:
            return
        for leaf, clone in zip(leaves, clones):
            leaf.data = clone.detach() if clone._version == 0 else leaf.detach().clone()
        self._release("activation")

    def wait_grad(self, lend: bool = False) -> tuple[tuple[Tensor, ...], Tensor]:
        """The gradients and carried loss posted for this tick (blocks until they have arrived). ``lend``: through a
        shared-memory link, the gradients view its slot until :meth:`release_grad` (Note [a lent message])."""
        if self._grad is None:
            raise FDGRuntimeError(f"{self.describe}: no gradient receive was posted for this tick\n{self.plan()}")
        works, grads, loss = self._grad
        self._grad = None
        lent = self._borrow("grad", works, [*grads, loss], self._next) if lend else None
        if lent:  # the backward reads the gradients where they lie; the loss is kept
            grads, loss = lent[:-1], lent[-1].clone()
        self._wait(works, f"the gradient from {self._next}")
        message = self._in(loss)
        if self.loss_scale:
            self.scale_in = message[1]
        return tuple(self._in(g) for g in grads), message[0]

    def release_grad(self) -> None:
        """After the backward read the gradients :meth:`wait_grad` returned: a lent message's slot goes back."""
        self._release("grad")

    def _borrow(self, what: str, works: list[Any], bufs: list[Tensor], name: str) -> list[Tensor] | None:
        """The message of ``works`` lent where it lies (Note [a lent message]): only a shared-memory receive not
        yet waited for whose tensors travel as they are read (the stage's device is the host)."""
        if len(works) != 1 or not isinstance(works[0], LinkReceive) or self.wire != self.device:
            return None
        receive = works.pop()
        self.waits += 1
        try:
            lent = receive.link.borrow(bufs, self.timeout)
        except RuntimeError as err:
            raise self._failed(f"waiting for the {what} from {name}", err) from err
        self._lent[what] = receive.link
        self.lent += 1
        return lent

    def _release(self, what: str) -> None:
        link = self._lent.pop(what, None)
        if link is not None:
            link.release()

    def wait_sends(self) -> None:
        """Wait for the host-waited sends; let go of stream-ordered send buffers whose transfer completed."""
        self._retire_sends()
        self._retire_sends()

    def _retire_sends(self) -> None:
        """Wait for the previous tick's host-waited sends (the neighbour took them in its tick, long since:
        waiting for this tick's would wait for the neighbour); this tick's become the previous."""
        sends, _ = self._older
        while sends:
            work, name = sends.pop(0)
            self._wait([work], f"{name} to take what this stage sent")
        self._older, self._sends, self._send_refs = (self._sends, self._send_refs), [], []
        self._in_flight.release_completed()

    def complete(self) -> None:
        """Wait for everything posted: sends, and receives (kept for the next tick's waits)."""
        self.wait_sends()
        if self._activation is not None:
            self._wait(self._activation[0], f"the activation from {self._prev}")
        if self._grad is not None:
            self._wait(self._grad[0], f"the gradient from {self._next}")
        self.wait_peers()

    def settle(self) -> None:
        """Until every stream-ordered send has completed (polled, bounded by the timeout): before a checkpoint."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        self._in_flight.release_completed()
        while self._in_flight.held():
            if self.watchdog is not None:
                self.watchdog.raise_if_failed()
            if time.monotonic() > deadline:
                raise self._failed("waiting for the sends to complete", TimeoutError("stream-ordered sends"))
            time.sleep(0.001)
            self._in_flight.release_completed()

    def received(self) -> dict[str, Any]:
        """What arrived for the next tick and the shape headers, after :meth:`complete` (for checkpoints)."""
        self.settle()
        pending = any(p is not None and p[0] for p in (self._activation, self._grad)) or self._peers is not None
        unsent = self._sends or self._older[0] or self._deferred_send is not None or self._deferred_recv
        if unsent or self._in_flight.held() or pending or self._lent:
            raise FDGRuntimeError(f"{self.describe}: messages still in flight; complete() the exchange first")
        return {
            "activation": None if self._activation is None else self._activation[1],
            "grad": None if self._grad is None else (self._grad[1], self._grad[2]),
            "sent_meta": self.sent_meta,
            "recv_meta": self.recv_meta,
        }

    def restore_received(self, state: dict[str, Any] | None) -> None:
        """Undo :meth:`received` in a new process (or forget everything with None)."""
        state = state or {"activation": None, "grad": None, "sent_meta": None, "recv_meta": None}
        self.close_links()  # both neighbours restore: the next header exchange sets up new ones
        self._sends, self._send_refs, self._older, self._in_flight = [], [], ([], []), InFlightSends()
        self._deferred_send, self._deferred_recv = None, False
        self._peers = None
        self.sent_meta, self.recv_meta = state["sent_meta"], state["recv_meta"]
        self._activation = None if state["activation"] is None else ([], list(state["activation"]))
        grad = state["grad"]
        self._grad = None if grad is None else ([], list(grad[0]), grad[1])

    def _header_out(self, activation: Sequence[Tensor]) -> bool:
        """Whether ``activation`` travels after a header: shapes and dtypes once (every time with dynamic
        shapes), and the shared-memory link where the pair should have one and has none yet, or the activation
        outgrew its slots (Note [shared-memory transport]). The next stage decides alike (:meth:`_header_in`)."""
        link = self.shared_memory["next"] and self._link_too_small(activation)
        return self.sent_meta is None or self.dynamic_shape or link

    def _header_in(self) -> bool:
        """Whether the next activation this stage receives comes after a header (as :meth:`_header_out`)."""
        link = self.shared_memory["prev"] and self.links["prev"] is None
        return self.recv_meta is None or self.dynamic_shape or link

    def _exchange_headers(
        self, activation: Sequence[Tensor] | None, recv_activation: bool, pending_grad: str = "receive"
    ) -> None:
        """Send the header of ``activation`` (setting up a new shared-memory link first where it needs one) and
        receive the previous stage's (joining its link), blocking: both neighbours run it at the same tick's
        end (Note [each message when it exists]). ``pending_grad``: what to do with a gradient receive pending
        when the link to the next stage changes: ``"receive"`` it the old way (the engine's order), or
        ``"refuse"`` (:meth:`post`'s order, in which none is pending then)."""
        ops = []
        if activation is not None:
            self.sent_meta = meta_of(activation)
            token = capacity = 0
            if self.shared_memory["next"] and self._link_too_small(activation):
                if pending_grad == "refuse":
                    self._check_nothing_pending(self._grad, "a gradient receive")
                self._receive_pending_grad()  # sent on the old way, before the neighbour reads this header
                self._close_link("next")
                try:
                    link = Link.create(self._activation_bytes(activation), peer_pid=self.next_pid)
                except OSError as err:
                    raise FDGRuntimeError(
                        f"{self.describe}: cannot set up the shared-memory link to {self._next} ({err}); free space in "
                        '/dev/shm, or remove pipeline.fdg.transport "shm" from ds_config'
                    ) from err
                self.links["next"] = link
                token, capacity = link.token, link.capacity
            header_out = _encode(self.sent_meta, token, capacity)
            ops.append(dist.P2POp(dist.isend, header_out, self.next_rank, self.host_group, TAG))
        header = torch.empty(_HEADER_INTS, dtype=torch.int64)  # Note [control words on the host]
        if recv_activation:
            ops.append(dist.P2POp(dist.irecv, header, self.prev_rank, self.host_group, TAG))
        works: list[Any] = list(dist.batch_isend_irecv(ops))
        if self.host_group is not None:
            works = [HostWork(w) for w in works]
        self._wait(works, f"the activation header from {self._prev}")
        if recv_activation:
            self.recv_meta, token, capacity = _decode(header)
            if token:
                self._check_nothing_pending(self._activation, "an activation receive")
                self._close_link("prev")
                try:
                    self.links["prev"] = Link.join(token, capacity, self.timeout)
                except OSError as err:
                    raise self._failed(f"joining the shared-memory link of {self._prev}", err) from err

    def _receive_pending_grad(self) -> None:
        """Before this stage changes its link to the next: the gradient receive posted this tick is for what
        the next stage sent this tick, before it reads the header, on the old way; take it from there
        (kept for the next tick's :meth:`wait_grad`)."""
        if self._grad is not None:
            self._wait(self._grad[0], f"the gradient from {self._next}")

    def _check_nothing_pending(self, posted: tuple[Any, ...] | None, what: str) -> None:
        """Note [shared-memory transport]: a pair changes links only between messages. A receive that waits
        for a header is posted only after it (:meth:`post_recv_activation`), so when the header arrives
        every activation receive posted before it has been waited for; one still pending would be matched on
        the other link."""
        if posted is not None and posted[0]:
            raise FDGRuntimeError(
                f"{self.describe}: {what} is still pending while the shared-memory link changes; the stages' "
                f"exchanges are out of step (a bug; please report it with both stages' logs)\n{self.plan()}"
            )

    def _activation_bytes(self, activation: Sequence[Tensor]) -> int:
        """A slot's size: the activation and its control word (a gradient message is never larger)."""
        word = torch.empty(1 + self.loss_scale, dtype=torch.int64)
        return message_bytes([self._out(t) for t in activation] + [word])

    def _link_too_small(self, activation: Sequence[Tensor]) -> bool:
        link = self.links["next"]
        return link is None or (self.dynamic_shape and self._activation_bytes(activation) > link.capacity)

    def _close_link(self, side: str) -> None:
        link = self.links[side]
        if link is not None:
            link.close()
            self._lent = {what: lent for what, lent in self._lent.items() if lent is not link}
        self.links[side] = None

    def close_links(self) -> None:
        """Close both shared-memory links (a neighbour waiting on one then fails at once, naming this stage)."""
        for side in self.links:
            self._close_link(side)

    def _check_same_shapes(self, activation: Sequence[Tensor]) -> None:
        meta = meta_of(activation)
        if meta != self.sent_meta:
            raise FDGRuntimeError(
                f"{self.describe}: activation shapes changed from {self.sent_meta} to {meta}; build the "
                "PipelineModule with dynamic_shape=True to send varying shapes (costs one header per tick)"
            )

    def _wait(self, works: list[Any], what: str) -> None:
        """Wait for and forget each work (a gloo receive waited twice waits for a second message).

        STREAM: a device transfer's ``wait()`` orders the compute stream after it and returns; the
        watchdog keeps its timeout (Note [a timeout without a blocking wait]). Host messages (gloo)
        are waited for on the host, bounded by the timeout, on every path.
        """
        self.waits += bool(works)
        if self.watchdog is not None:
            self.watchdog.raise_if_failed()
            stream_ordered = [w for w in works if not _is_host_work(w)]
            self.watchdog.watch(stream_ordered, what)
        while works:
            work = works.pop(0)
            try:
                if self.watchdog is not None and not _is_host_work(work):
                    work.wait()
                else:
                    work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise self._failed(f"waiting for {what}", err) from err

    def _failed(self, doing: str, err: Exception) -> FDGRuntimeError:
        return FDGRuntimeError(
            f"{self.describe}: gave up {doing} (timeout {self.timeout.total_seconds():g} s): that rank failed, was "
            f"killed or stopped sending -- see its log (the wait is pipeline.fdg.timeout) [{err}]"
        )


class HostWork:
    """A work of the host group under STREAM (control words): waited on the host, with the timeout."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def wait(self, timeout: timedelta) -> bool:
        return self.work.wait(timeout=timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class LinkReceive:
    """A receive through a shared-memory link: waiting copies the neighbour's next message into ``into``."""

    def __init__(self, link: Link, into: list[Tensor]) -> None:
        self.link, self.into = link, into

    def wait(self, timeout: timedelta) -> bool:
        self.link.receive(self.into, timeout)
        return True


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


def _is_host_work(work: Any) -> bool:
    return isinstance(work, HostWork)


def _loss_message(loss: Tensor | None) -> Tensor:
    assert loss is not None, "gradients travel with the loss they belong to"
    return loss.detach().float().reshape(-1)  # (loss,) or, under fp16, (loss, scale)


def _wire(t: Tensor) -> Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


def _unwire(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.view(torch.bool) if dtype == torch.bool else t


def _encode(meta: Meta, token: int = 0, capacity: int = 0) -> Tensor:
    """The header: the activation's shapes and dtypes, then a new link's token and slot bytes (0, 0: none)."""
    ints = [len(meta)]
    for shape, dtype in meta:
        ints += [_DTYPES.index(dtype), len(shape), *shape]
    if len(ints) > _HEADER_INTS - _LINK_INTS:
        raise FDGRuntimeError(f"activation header too long ({len(ints)} ints): send fewer or flatter tensors")
    return torch.tensor(ints + [0] * (_HEADER_INTS - _LINK_INTS - len(ints)) + [token, capacity], dtype=torch.int64)


def _decode(header: Tensor) -> tuple[Meta, int, int]:
    ints = read_host(header)
    meta, i = [], 1
    for _ in range(ints[0]):
        dtype, ndim = _DTYPES[ints[i]], ints[i + 1]
        meta.append((torch.Size(ints[i + 2 : i + 2 + ndim]), dtype))
        i += 2 + ndim
    return meta, ints[-2], ints[-1]
