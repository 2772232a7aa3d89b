"""The point-to-point messages between a stage and its two pipeline neighbours, each sent when it exists.

Activations go down (stage k -> k+1); input gradients and the loss they belong to go up
(k+1 -> k). Every wait is bounded by the configured timeout and names the neighbour it gave up on.
Long because it is one class whose message order, deferred header exchange with its link set-up, control words
and receive bookkeeping are one protocol; transports, paths and the wire form live in the modules named below.

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

How tensors travel and a stage waits for them through the process group (the three paths, Note [three
ways to wait]; a communicator per pair under NCCL, Note [one communicator per link]) is
:mod:`fdg_schedule.exchange.process_group`'s. The exchange reaches each neighbour through a
:class:`~fdg_schedule.exchange.link.Link` only: the process group's, or the configured transport's
(:mod:`fdg_schedule.exchange.transports`, where Note [the fastest transport by default] is), set up at a header
exchange (Note [shared-memory transport], continued in :mod:`fdg_schedule.exchange.link`).

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
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.guards import read_host
from fdg_schedule.base.tensors import HOST
from fdg_schedule.base.watchdog import stream_mark
from fdg_schedule.exchange import transports
from fdg_schedule.exchange.link import Link, Place
from fdg_schedule.exchange.process_group import (
    TAG,
    GroupTraffic,
    HostWork,
    Path,
    choose_path,
    group_links,
    host_group,
)
from fdg_schedule.exchange.shm_link import message_bytes
from fdg_schedule.exchange.transports import resolve_transport
from fdg_schedule.exchange.wire import (
    HEADER_INTS,
    Meta,
    PeerMessage,
    decode,
    encode,
    loss_message,
    meta_of,
    unwire,
    wire,
    wire_dtype,
)
from fdg_schedule.precision.loss_scale import from_word, to_word

__all__ = ["NO_END", "Meta", "NeighbourExchange", "Path", "PeerMessage", "choose_path", "meta_of", "resolve_transport"]

NO_END = -1  # the control word of an activation while data keeps coming


@dataclasses.dataclass
class Posted:
    """A receive posted through a link: the link, its handles, the buffers the message lands in, and (beside an
    accelerator backend) the works of its control word in the host group (Note [control words on the host])."""

    link: Link | None
    handles: list[Any]
    bufs: list[Tensor]
    words: list[Any] = dataclasses.field(default_factory=list)

    def pending(self) -> bool:
        return bool(self.handles or self.words)


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
        transport: ``pipeline.fdg.transport``, a name in :data:`~fdg_schedule.exchange.transports.TRANSPORTS` or
            ``"auto"`` (:func:`resolve_transport`, Note [the fastest transport by default]); :attr:`transport` is
            the one that runs. ``"shm"``: each neighbour on this host through a shared-memory link (Note
            [shared-memory transport]); the path must be BLOCKING. Building a transport may be collective
            (``"shm"`` finds the neighbours' hosts): every rank builds its exchange at the same point.
        mark: under STREAM, called right after each post: whether the stream has reached it since
            (:func:`~fdg_schedule.base.watchdog.stream_mark`, Note [a timeout without a blocking wait]).
        loss_scale: fp16 (Note [loss scale per stage] in fdg_schedule.precision.loss_scale): an activation's
            control word also carries the loss-scale ceiling (``post(ceiling=...)``, :attr:`ceiling_in`), and the
            loss message is ``(loss, scale)``, float32 (:attr:`scale_in`).

    Each neighbour is reached through a :class:`~fdg_schedule.exchange.link.Link`: :attr:`links` holds the
    transport's own where one is set up, else the process group's (:attr:`group_links`) carries the messages.
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
        self.transport = resolve_transport(transport, self.path)
        self.waits = 0  # blocking operations with a neighbour so far (Note [no wait between calls])
        self.describe = describe(stage_id, dist.get_rank())
        self._describe = describe
        self._prev = describe(stage_id - 1, prev_rank)
        self._next = describe(stage_id + 1, next_rank)
        self.timeout = timedelta(seconds=timeout_s)
        names = {"prev": self._prev, "next": self._next}
        place = Place(prev_rank, next_rank, device, dist.get_backend(), self.path.value, self.timeout, self.describe,
                      names)  # fmt: skip
        self._transport = transports.build(self.transport, place)  # refuses a place it cannot run in: before any wait
        self.links: dict[str, Link | None] = {"prev": None, "next": None}  # the transport's own, once set up
        self._lent: dict[str, Link] = {}  # "activation", "grad": a message read where it lies (Note [a lent message])
        self.lent = 0  # messages read where they lay, so far
        self.wire = HOST if self.path is Path.STAGED else device  # where tensors travel from and arrive in
        self.host_group = host_group(dist.get_backend(), device)
        self.traffic = GroupTraffic(self.path, self.host_group, self.timeout, self.describe, mark)
        self.watchdog = self.traffic.watchdog
        # (side, direction) -> the default group, but under STREAM the pair's own (Note [one communicator per link])
        self.group_links, self.groups = group_links(self.traffic, prev_rank, next_rank, names, device)
        self.loss_scale = loss_scale
        self.ceiling_in: float | None = None  # what the last activation waited for carried (loss_scale)
        self.scale_in: Tensor | None = None  # ... and the last gradient: the scale it was made with
        self.plan = plan
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.device, self.dynamic_shape = device, dynamic_shape
        self.sent_meta: Meta | None = None
        self.recv_meta: Meta | None = None
        self._deferred_send: tuple[tuple[Tensor, ...], Tensor] | None = None  # an activation waiting for its header
        self._deferred_recv = False  # the activation receive, waiting for its header
        self._activation: Posted | None = None
        self._grad: Posted | None = None  # bufs: the gradients, then the loss message
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
        header first (a link changes there, and a gradient receive still pending then is an error: the callers'
        ticks are out of step), then the gradients+loss and the activation sent, next tick's receives posted,
        and :meth:`finish_tick`.

        The engine sends and posts each message where its schedule says (Note [each message when it
        exists]); this is for tools and tests that drive an exchange tick by tick.
        """
        self.traffic.check()
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
        self.traffic.check()
        self._send("prev", [*(self._out(g) for g in grads), self._out(loss_message(loss))])

    def send_activation(
        self, activation: Sequence[Tensor] | None, end: int = NO_END, ceiling: float | None = None
    ) -> None:
        """Send a forward's output to the next stage with its control word, now (non-blocking); or, when it
        needs a header first (its shapes are new, or a link is set up), at :meth:`finish_tick`.

        ``end``: the segment's number of micro-batches when the data ran out, sent instead of an activation in
        a dummy of the last activation's shapes (Note [end of data]). ``ceiling``: the loss-scale ceiling in
        the control word (``loss_scale`` only).
        """
        self.traffic.check()
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
        link = self._link("next")
        self._grad = Posted(link, link.post_receive([*grads, loss]), [*grads, loss])

    def finish_tick(self, peers: Sequence[PeerMessage] = ()) -> None:
        """End the tick's exchange: the activation header and what waited for it (blocking, only when a header
        travels), the previous tick's sends waited for, and the tied-gradient messages to other ranks
        (``peers``, one more batch; :meth:`wait_peers` waits for them)."""
        self.traffic.check()
        deferred, self._deferred_send = self._deferred_send, None
        recv, self._deferred_recv = self._deferred_recv, False
        if deferred is not None or recv:
            self._exchange_headers(None if deferred is None else deferred[0], recv)
            if deferred is not None:
                self._post_activation(*deferred)
            if recv:
                self._post_recv_activation()
        self.waits += self.traffic.retire_sends()
        if peers:
            self._post_peers(peers)

    def _link(self, side: str) -> Link:
        """The link a message to the ``side`` neighbour takes: the transport's where it is set up, else the group's."""
        return self.links[side] or self.group_links[side]

    def _send(self, side: str, tensors: list[Tensor]) -> None:
        link = self._link(side)
        self.waits += link.blocking_send  # e.g. the link's slot may still hold the neighbour's previous message
        link.send(tensors)

    def _post_activation(self, activation: Sequence[Tensor], word: Tensor) -> None:
        data = [self._out(t) for t in activation]
        if self.host_group is None:  # Note [control words on the host]: one message with its word
            self._send("next", [*data, word])
        else:
            self._send("next", data)
            self.traffic.post([(self.next_rank, word)], [], self._next, self.host_group)

    def _post_recv_activation(self) -> None:
        if self._activation is not None:
            raise FDGRuntimeError(f"{self.describe}: an activation receive was posted twice\n{self.plan()}")
        assert self.recv_meta is not None
        data = [torch.empty(s, dtype=wire_dtype(d), device=self.wire) for s, d in self.recv_meta]
        word = torch.empty(1 + self.loss_scale, dtype=torch.int64)
        link = self._link("prev")
        if self.host_group is None:
            self._activation = Posted(link, link.post_receive([*data, word]), [*data, word])
        else:
            words = self.traffic.post([], [(self.prev_rank, word)], self._prev, self.host_group)
            self._activation = Posted(link, link.post_receive(data), [*data, word], words)

    def _post_peers(self, peers: Sequence[PeerMessage]) -> None:
        if self._peers is not None:
            raise FDGRuntimeError(f"{self.describe}: the previous tick's peer messages were never waited for")
        name = ", ".join(sorted({self._describe(m.stage, m.peer) for m in peers}))
        self._peers = self.traffic.post_peers(peers, name, self._out, self.wire)

    def wait_peers(self) -> None:
        """Wait for the peer messages posted last (bounded); their receive tensors then hold what arrived."""
        if self._peers is None:
            return
        works, pairs = self._peers
        self._peers = None
        self._wait(works, "the tied gradients from the other owners")
        for landed, own in pairs:
            if landed is not own:
                own.copy_(unwire(landed, own.dtype))

    def _out(self, t: Tensor) -> Tensor:
        """``t`` as it travels: contiguous, bool as bytes, in host memory on the STAGED path (a copy the host
        waits for: gloo reads it from there)."""
        t = wire(t)
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

    def wait_activation(self, lend: bool = False) -> tuple[tuple[Tensor, ...], int]:
        """The activation posted for this tick and its control word (blocks until it has arrived). ``lend``: where
        its link can lend it, the tensors view the link's memory until :meth:`own_activation` (Note [a lent
        message])."""
        if self._activation is None:
            raise FDGRuntimeError(f"{self.describe}: no activation receive was posted for this tick\n{self.plan()}")
        posted, self._activation = self._activation, None
        what = f"the activation from {self._prev}"
        bufs = (self._borrow("activation", posted, what) if lend else None) or posted.bufs
        self._wait_posted(posted, what)
        assert self.recv_meta is not None
        tensors = tuple(self._in(unwire(t, d)) for t, (_, d) in zip(bufs, self.recv_meta))
        words = read_host(bufs[-1])  # Note [control words on the host]
        if self.loss_scale:
            self.ceiling_in = from_word(words[1])
        if words[0] != NO_END:  # a dummy: nothing reads it
            self._release("activation")
        return tensors, words[0]

    def own_activation(self, leaves: Sequence[Tensor], clones: Sequence[Tensor]) -> None:
        """After the stage forward read the received activation ``leaves`` into its ``clones``: where the
        activation was lent (Note [a lent message]), each leaf takes its clone's data when the forward left the
        clone as it was (else a copy of its own), and the message goes back to the link."""
        if self._lent.get("activation") is None:
            return
        for leaf, clone in zip(leaves, clones):
            leaf.data = clone.detach() if clone._version == 0 else leaf.detach().clone()
        self._release("activation")

    def wait_grad(self, lend: bool = False) -> tuple[tuple[Tensor, ...], Tensor]:
        """The gradients and carried loss posted for this tick (blocks until they have arrived). ``lend``: where
        its link can lend them, the gradients view the link's memory until :meth:`release_grad` (Note [a lent
        message])."""
        if self._grad is None:
            raise FDGRuntimeError(f"{self.describe}: no gradient receive was posted for this tick\n{self.plan()}")
        posted, self._grad = self._grad, None
        what = f"the gradient from {self._next}"
        grads, loss = posted.bufs[:-1], posted.bufs[-1]
        lent = self._borrow("grad", posted, what) if lend else None
        if lent:  # the backward reads the gradients where they lie; the loss is kept
            grads, loss = lent[:-1], lent[-1].clone()
        self._wait_posted(posted, what)
        message = self._in(loss)
        if self.loss_scale:
            self.scale_in = message[1]
        return tuple(self._in(g) for g in grads), message[0]

    def release_grad(self) -> None:
        """After the backward read the gradients :meth:`wait_grad` returned: a lent message goes back."""
        self._release("grad")

    def _borrow(self, what: str, posted: Posted, message: str) -> list[Tensor] | None:
        """The message of ``posted`` lent where it lies (Note [a lent message]): only where its link lends, the
        receive is not yet waited for, and its tensors travel as they are read (the stage's device is the wire)."""
        if posted.link is None or posted.words or self.wire != self.device:
            return None
        lent = posted.link.borrow(posted.handles, posted.bufs, message)
        if lent is None:
            return None
        self.waits += 1
        self._lent[what] = posted.link
        self.lent += 1
        return lent

    def _release(self, what: str) -> None:
        link = self._lent.pop(what, None)
        if link is not None:
            link.release()

    def wait_sends(self) -> None:
        """Wait for the host-waited sends; let go of stream-ordered send buffers whose transfer completed."""
        self.waits += self.traffic.retire_sends()
        self.waits += self.traffic.retire_sends()

    def complete(self) -> None:
        """Wait for everything posted: sends, and receives (kept for the next tick's waits)."""
        self.wait_sends()
        if self._activation is not None:
            self._wait_posted(self._activation, f"the activation from {self._prev}")
        if self._grad is not None:
            self._wait_posted(self._grad, f"the gradient from {self._next}")
        self.wait_peers()

    def settle(self) -> None:
        """Until every stream-ordered send has completed (polled, bounded by the timeout): before a checkpoint."""
        self.traffic.settle()

    def received(self) -> dict[str, Any]:
        """What arrived for the next tick and the shape headers, after :meth:`complete` (for checkpoints)."""
        self.settle()
        pending = any(p is not None and p.pending() for p in (self._activation, self._grad)) or self._peers is not None
        unsent = self.traffic.unsent() or self._deferred_send is not None or self._deferred_recv
        if unsent or pending or self._lent:
            raise FDGRuntimeError(f"{self.describe}: messages still in flight; complete() the exchange first")
        return {
            "activation": None if self._activation is None else self._activation.bufs,
            "grad": None if self._grad is None else (self._grad.bufs[:-1], self._grad.bufs[-1]),
            "sent_meta": self.sent_meta,
            "recv_meta": self.recv_meta,
        }

    def restore_received(self, state: dict[str, Any] | None) -> None:
        """Undo :meth:`received` in a new process (or forget everything with None)."""
        state = state or {"activation": None, "grad": None, "sent_meta": None, "recv_meta": None}
        self.close_links()  # both neighbours restore: the next header exchange sets up new ones
        self.traffic.reset()
        self._deferred_send, self._deferred_recv = None, False
        self._peers = None
        self.sent_meta, self.recv_meta = state["sent_meta"], state["recv_meta"]
        self._activation = None if state["activation"] is None else Posted(None, [], list(state["activation"]))
        grad = state["grad"]
        self._grad = None if grad is None else Posted(None, [], [*grad[0], grad[1]])

    def _header_out(self, activation: Sequence[Tensor]) -> bool:
        """Whether ``activation`` travels after a header: shapes and dtypes once (every time with dynamic
        shapes), and the transport's link where the pair should have one and has none yet, or the activation
        outgrew it (Note [shared-memory transport]). The next stage decides alike (:meth:`_header_in`)."""
        link = self._transport.sides["next"] and self._link_too_small(activation)
        return self.sent_meta is None or self.dynamic_shape or link

    def _header_in(self) -> bool:
        """Whether the next activation this stage receives comes after a header (as :meth:`_header_out`)."""
        link = self._transport.sides["prev"] and self.links["prev"] is None
        return self.recv_meta is None or self.dynamic_shape or link

    def _exchange_headers(
        self, activation: Sequence[Tensor] | None, recv_activation: bool, pending_grad: str = "receive"
    ) -> None:
        """Send the header of ``activation`` (setting up the transport's new link to the next stage first where it
        needs one) and receive the previous stage's (joining its link), blocking: both neighbours run it at the
        same tick's end (Note [each message when it exists]). ``pending_grad``: what to do with a gradient receive
        pending when the link to the next stage changes: ``"receive"`` it the old way (the engine's order), or
        ``"refuse"`` (:meth:`post`'s order, in which none is pending then)."""
        ops = []
        if activation is not None:
            self.sent_meta = meta_of(activation)
            setup = (0, 0)
            if self._transport.sides["next"] and self._link_too_small(activation):
                if pending_grad == "refuse":
                    self._check_nothing_pending(self._grad, "a gradient receive")
                self._receive_pending_grad()  # sent on the old way, before the neighbour reads this header
                self._close_link("next")
                nbytes = self._activation_bytes(activation)
                self.links["next"], setup = self._transport.create(nbytes, self.group_links["next"])
            header_out = encode(self.sent_meta, *setup)
            ops.append(dist.P2POp(dist.isend, header_out, self.next_rank, self.host_group, TAG))
        header = torch.empty(HEADER_INTS, dtype=torch.int64)  # Note [control words on the host]
        if recv_activation:
            ops.append(dist.P2POp(dist.irecv, header, self.prev_rank, self.host_group, TAG))
        works: list[Any] = list(dist.batch_isend_irecv(ops))
        if self.host_group is not None:
            works = [HostWork(w) for w in works]
        self._wait(works, f"the activation header from {self._prev}")
        if recv_activation:
            self.recv_meta, *joined = _decode(header)
            if joined[0]:
                self._check_nothing_pending(self._activation, "an activation receive")
                self._close_link("prev")
                self.links["prev"] = self._transport.join((joined[0], joined[1]), self.group_links["prev"])

    def _receive_pending_grad(self) -> None:
        """Before this stage changes its link to the next: the gradient receive posted this tick is for what
        the next stage sent this tick, before it reads the header, on the old way; take it from there
        (kept for the next tick's :meth:`wait_grad`)."""
        if self._grad is not None:
            self._wait_posted(self._grad, f"the gradient from {self._next}")

    def _check_nothing_pending(self, posted: Posted | None, what: str) -> None:
        """Note [shared-memory transport]: a pair changes links only between messages. A receive that waits
        for a header is posted only after it (:meth:`post_recv_activation`), so when the header arrives
        every activation receive posted before it has been waited for; one still pending would be matched on
        the other link."""
        if posted is not None and posted.pending():
            raise FDGRuntimeError(
                f"{self.describe}: {what} is still pending while the shared-memory link changes; the stages' "
                f"exchanges are out of step (a bug; please report it with both stages' logs)\n{self.plan()}"
            )

    def _activation_bytes(self, activation: Sequence[Tensor]) -> int:
        """A link's message size: the activation and its control word (a gradient message is never larger)."""
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
        """Close the transport's links (a neighbour waiting on one then fails, at once where the link can tell)."""
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
        """Wait for the process group's ``works`` (:meth:`GroupTraffic.wait`), counted as one wait."""
        self.waits += bool(works)
        self.traffic.wait(works, what)

    def _wait_posted(self, posted: Posted, what: str) -> None:
        """Wait for a posted receive through its link (and its control word's works), counted as one wait."""
        self.waits += posted.pending()
        if posted.link is not None:
            posted.link.wait(posted.handles, what)
        self.traffic.wait(posted.words, what)


def _decode(header: Tensor) -> tuple[Meta, int, int]:
    return decode(read_host(header))  # Note [control words on the host]
