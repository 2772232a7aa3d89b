"""What a transport is to the exchange: a :class:`Link` to one neighbour, and a :class:`Transport` that sets links up.

:class:`~fdg_schedule.exchange.comm.NeighbourExchange` owns the order of a stage's messages, the activation
header and the control words; it moves each message to a neighbour through that side's :class:`Link` and
nothing else. Every stage has a link to each neighbour through its process group
(:class:`~fdg_schedule.exchange.process_group.GroupLink`, Note [three ways to wait]); the configured transport
(``pipeline.fdg.transport``, :mod:`fdg_schedule.exchange.transports`) may replace it with a link of its own, set
up inside the activation header exchange (Note [shared-memory transport]): the upstream stage creates the
link (:meth:`Transport.create`) and sends its two set-up ints in the header; the downstream stage joins it from
them (:meth:`Transport.join`). Both sides change links at the same header exchange, between messages.

A link is the pair of directions with one neighbour: what this stage sends goes one way (activations down to
the next stage, gradients up to the previous one), what it receives comes the other. Messages are lists of
tensors in the order they were sent; the receiver knows their shapes (the header) and posts buffers of them.

Note [shared-memory transport] (begun in :mod:`fdg_schedule.exchange.shm_link`): with ``pipeline.fdg.transport:
"shm"``, neighbours on one host exchange their per-tick messages (activations with their control
word, gradients with their loss) through a shared-memory :class:`~fdg_schedule.exchange.shm_link.Link`
instead of the process group, on the BLOCKING path. The link (any transport's own: :class:`Transport`) is
set up inside the activation header exchange, which then also runs when a pair has no link yet (the first
tick, and the first after a checkpoint is loaded); until then, and between neighbours on different hosts,
messages travel as they always did. Both sides of a pair gain and lose the link at the same header exchange,
at a tick's end, so they agree on which way each message goes: activations that need the header are sent
after it on the new link, and a gradient the downstream stage sent in that tick (before it reads the header)
went the old way, where the upstream stage's receive, posted earlier in the tick, takes it before it
changes links. Headers and tied gradients always travel through the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError

SIDES = ("prev", "next")  # a stage's neighbours: the previous stage (upstream) and the next (downstream)


class Link(Protocol):
    """This stage's messages with one neighbour, each direction one ordered stream of messages.

    ``capacity``: the bytes of the largest message the link carries (``math.inf``: any); a larger activation
    gets a new link at the next header exchange. ``blocking_send``: a send may wait for the neighbour (a full
    ring), so the exchange counts it as a wait (Note [no wait between calls]).
    """

    @property
    def capacity(self) -> float: ...

    @property
    def blocking_send(self) -> bool: ...

    def send(self, tensors: Sequence[Tensor]) -> None:
        """Send a message now; it is on its way when this returns (tensors may not change until the exchange
        retires its sends, which a link that copies may ignore). Raises a :func:`gave_up` error naming the
        neighbour when it cannot be reached."""
        ...

    def post_receive(self, into: Sequence[Tensor]) -> list[Any]:
        """Post the receive of the next message into ``into`` (contiguous buffers of its shapes); returns the
        handles :meth:`wait` takes. Messages are matched in the order the receives were posted."""
        ...

    def wait(self, handles: list[Any], what: str) -> None:
        """Wait for (and forget: pop) each handle, bounded by the timeout: ``into`` then holds the message.
        ``what`` names the message and the neighbour (``"the gradient from stage 1 (global rank 1)"``) in the
        :func:`gave_up` error."""
        ...

    def borrow(self, handles: list[Any], like: Sequence[Tensor], what: str) -> list[Tensor] | None:
        """The message of ``handles`` lent where it lies (Note [a lent message]): tensors of ``like``'s shapes
        that stay valid until :meth:`release`, the handles popped. None where the link cannot lend (the message
        then arrives by :meth:`wait`)."""
        ...

    def release(self) -> None:
        """Give the lent message back to the link (no tensor of :meth:`borrow` is read after this)."""
        ...

    def close(self) -> None:
        """Let go of the link; a neighbour waiting on it fails (at once where it can tell)."""
        ...


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a stage's links go: what a transport needs to set them up. ``names``: each side's neighbour as
    error messages name it; ``path``: the process group's path (Note [three ways to wait]), ``"blocking"``
    where tensors travel in host memory and the host waits."""

    prev_rank: int | None
    next_rank: int | None
    device: torch.device
    backend: str
    path: str
    timeout: timedelta
    describe: str  # this stage
    names: Mapping[str, str]


class Transport(Protocol):
    """How a transport sets up its links (built once per exchange from a :class:`Place`; building may be
    collective over the default group, and may refuse a place it cannot run in with an error naming the config
    key). ``sides``: the neighbours it links to (the others keep the process group)."""

    @property
    def sides(self) -> Mapping[str, bool]: ...

    def create(self, nbytes: int, group_link: Link) -> tuple[Link, tuple[int, int]]:
        """Upstream: a new link to the next stage whose messages reach ``nbytes``, and the two set-up ints the
        header carries to the next stage (the first never 0: 0 means "no new link"). ``group_link``: the link
        through the process group it replaces (a transport may use it)."""
        ...

    def join(self, setup: tuple[int, int], group_link: Link) -> Link:
        """Downstream: the link the previous stage created, from the set-up ints its header carried."""
        ...


def gave_up(describe: str, timeout: timedelta, doing: str, err: Exception) -> FDGRuntimeError:
    """The error of a wait or send that failed: this stage, what it was ``doing`` with whom, the timeout and the
    key, and the transport's own error."""
    return FDGRuntimeError(
        f"{describe}: gave up {doing} (timeout {timeout.total_seconds():g} s): that rank failed, was "
        f"killed or stopped sending -- see its log (the wait is pipeline.fdg.timeout) [{err}]"
    )
