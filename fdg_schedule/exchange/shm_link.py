"""A link between two neighbouring stages on one host: tensors through shared memory, doorbells over a socket.

Note [shared-memory transport]: under gloo every tensor a stage sends to its neighbour crosses gloo's
TCP transport, whose threads run on the stages' cores. With ``pipeline.fdg.transport: "shm"``, two
neighbours on one host exchange their per-tick messages through a :class:`Link` instead:

- Each direction (activations down, gradients up) is a ring of :data:`SLOTS` slots in one file in
  /dev/shm that both ranks map. The sender copies a message's tensors into the next slot; the
  receiver copies them out into its receive buffers, or reads them where they lie (Note [a lent message]).
  One copy each way, no thread.
- A stream Unix socket between the two (Linux's abstract namespace: no file) carries 32-byte
  records: ``READY`` after a message was written, ``FREE`` after it was read (copied out or released). A slot is
  rewritten only after its ``FREE``. The records also order the copies: the sender's stores come
  before its ``send()``, the receiver's loads after its ``recv()``, and the kernel's socket locks
  make that a happens-before on any CPU.
- The peer is woken by a doorbell, an eventfd per direction rung after each record, not by the
  record itself (Note [doorbells]). A wait blocks in ``poll()`` on its eventfd, and on the socket
  for its closing only, for at most the remaining timeout. A neighbour that dies closes its end,
  so the wait fails at once with an error naming it instead of at the timeout.

Note [doorbells]: a write to a Unix socket wakes a reader blocked on it with a *synchronous*
wake-up (the kernel assumes the writer is about to sleep), and Linux's wake-affine placement then
queues the woken rank on the writer's CPU when its own CPU is busy with anything else. A stage goes
on computing after it sends, so the two ranks shared one core until the load balancer separated
them: 10-20 ms of runnable-but-waiting time per tick on a 2-core machine with background load
(docs/performance.md, "FDG's tick on models nobody tuned for"). An eventfd write wakes without
that hint, as gloo's futex wake-ups do. The downstream creates both eventfds and sends them over the
socket (``SCM_RIGHTS``) as soon as it connects; the upstream takes them when it accepts. So the downstream never
waits for the accept: it may post records (and ring the upstream's doorbell) before it.

Note [a lent message]: :meth:`Link.borrow` hands a message over as it lies in its slot, and its ``FREE``
waits for :meth:`Link.release`. The receiving stage reads it once, in the copy it makes anyway (the stage
forward's clone of its input, the backward's reading of its gradient), and releases it right after: one copy
of each boundary tensor fewer per tick on either side (issue 62: two 4 MiB copies, about 1 ms each, on a
plain conv net). One message per direction is lent at a time, so ``FREE`` records stay in order.

Set up once per pair of neighbours, inside the activation header exchange (Note [control words on
the host] in :mod:`fdg_schedule.exchange.comm`). The upstream stage, which sends the header, first creates
both ring files and a listening socket under a random token, and puts the token and the ring size
in the header. The downstream stage maps the files and connects. When the upstream accepts that
connection it removes the files' names: from then on nothing is left in /dev/shm, and the
mappings live as long as the link.

Note [who may connect]: an abstract socket name has no file permissions and is listed in
/proc/net/unix, so any local process can connect to it. The upstream accepts only its neighbour:
the kernel's credentials of the connecting process (``SO_PEERCRED``) must carry this process's uid
and the pid the neighbour announced through the process group when the exchange was built
(:func:`fdg_schedule.exchange.shm_transport.same_host_neighbours`). Any other connection is closed, counted in
:attr:`Link.refused`, and the upstream goes on listening until its timeout.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
from torch import Tensor

SLOTS = 4  # unread messages a direction holds before its sender waits (FDG sends one a tick, read the next tick)
_RECORD = struct.Struct("<qqqq")  # kind, direction, sequence number, bytes
_ALIGN = 64


class LinkError(RuntimeError):
    """The neighbour closed the link (its process ended) or did not answer within the timeout."""


class Kind(enum.IntEnum):
    READY = 1  # a message was written into its slot
    FREE = 2  # a message was read out of its slot (copied, or borrowed and released)


class Direction(enum.IntEnum):
    DOWN = 0  # activations: upstream -> downstream
    UP = 1  # gradients and the loss: downstream -> upstream


def ring_path(token: int, direction: Direction) -> str:
    return f"/dev/shm/fdg_link_{token:016x}_{direction.name.lower()}"


def _socket_name(token: int) -> bytes:
    return f"\0fdg_link_{token:016x}".encode()  # the abstract namespace: no file to remove


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel recorded them."""
    creds = struct.Struct("3i")
    return creds.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size))


def message_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(_padded(t.numel() * t.element_size()) for t in tensors)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Link:
    """The two rings and the doorbell socket between an upstream and a downstream stage.

    Build it with :meth:`create` (upstream) and :meth:`join` (downstream, with the token and
    capacity the upstream sent). ``capacity``: the bytes of a slot, the largest message either way.
    """

    def __init__(self, token: int, capacity: int, upstream: bool, peer_pid: int | None = None) -> None:
        self.token, self.capacity, self.upstream = token, capacity, upstream
        self.peer_pid = peer_pid  # the only process the upstream accepts (Note [who may connect]); None: any of ours
        self.refused: list[tuple[int, int, int]] = []  # (pid, uid, gid) of connections refused
        self.out_direction = Direction.DOWN if upstream else Direction.UP
        self.in_direction = Direction.UP if upstream else Direction.DOWN
        self.sent = 0  # messages written
        self.taken = 0  # messages copied out or borrowed
        self.lent = False  # message `taken` is borrowed: its slot is not yet free (Note [a lent message])
        self.ready = 0  # the peer's READY records seen: its messages up to this one can be read
        self.freed = 0  # the peer's FREE records seen: this side's slots up to this one are free again
        self._rings: dict[Direction, mmap.mmap] = {}
        self._views: dict[Direction, Tensor] = {}
        self._listener: socket.socket | None = None
        self._sock: socket.socket | None = None
        self._pending = b""
        self._bells: tuple[int, int] | None = None  # (rung by this side, waited on by this side): Note [doorbells]
        self._poll: select.poll | None = None
        self._ready_bytes: dict[int, int] = {}  # a READY record's message size, until the message is taken
        self._paths: list[str] = []

    @classmethod
    def create(cls, capacity: int, peer_pid: int | None = None) -> Link:
        """The upstream's side: new ring files and a listening socket under a fresh token; only process
        ``peer_pid`` of this user may connect (Note [who may connect])."""
        link = cls(1 + secrets.randbits(62), _padded(capacity), upstream=True, peer_pid=peer_pid)  # 0: "no link"
        try:
            for direction in Direction:
                path = ring_path(link.token, direction)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                link._paths.append(path)
                try:
                    os.ftruncate(fd, SLOTS * link.capacity)
                    link._map(direction, fd)
                finally:
                    os.close(fd)
            link._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            link._listener.bind(_socket_name(link.token))
            link._listener.listen(4)  # a foreign connection waiting to be refused does not block the neighbour
        except OSError:
            link.close()  # no file left behind
            raise
        return link

    @classmethod
    def join(cls, token: int, capacity: int, timeout: timedelta) -> Link:
        """The downstream's side: map the upstream's ring files, then connect (which lets it remove them)."""
        link = cls(token, capacity, upstream=False)
        for direction in Direction:
            fd = os.open(ring_path(token, direction), os.O_RDWR)
            try:
                link._map(direction, fd)
            finally:
                os.close(fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout.total_seconds())
        sock.connect(_socket_name(token))
        sock.settimeout(None)
        link._sock = sock
        # Note [doorbells]: the downstream makes both and sends them at once (the socket holds them until the
        # upstream accepts), so nothing of this side waits for the upstream to accept.
        down, up = (os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in Direction)
        link._bells = (up, down)  # rings the upstream's, waits on its own
        try:
            socket.send_fds(sock, [b"B"], [down, up])
        except OSError as err:
            link.close()
            raise LinkError(f"closed the shared-memory link before it was set up ({err})") from err
        return link

    def _map(self, direction: Direction, fd: int) -> None:
        ring = mmap.mmap(fd, SLOTS * self.capacity)
        self._rings[direction] = ring
        self._views[direction] = torch.frombuffer(ring, dtype=torch.uint8)

    def send(self, tensors: Sequence[Tensor], timeout: timedelta) -> None:
        """Copy ``tensors`` (contiguous, on the host) into the next slot and ring the peer's doorbell."""
        nbytes = message_bytes(tensors)
        if nbytes > self.capacity:
            raise LinkError(
                f"a message of {nbytes} bytes does not fit the link's {self.capacity}-byte slots (set up from the "
                "activation's shapes); send gradients no larger than the activations they belong to"
            )
        seq = self.sent + 1
        self._wait_until(lambda: self.freed >= seq - SLOTS, timeout, "free a slot")
        slot = self._slot(self.out_direction, seq)
        at = 0
        for t in tensors:
            size = t.numel() * t.element_size()
            slot[at : at + size].copy_(t.reshape(-1).view(torch.uint8))
            at += _padded(size)
        self.sent = seq
        self._post(Kind.READY, self.out_direction, seq, nbytes)

    def receive(self, into: Sequence[Tensor], timeout: timedelta) -> None:
        """Wait for the peer's next message and copy it into ``into`` (contiguous, the message's shapes)."""
        for t, lent in zip(into, self.borrow(into, timeout)):
            assert t.is_contiguous(), "receive buffers are fresh, contiguous tensors"
            t.copy_(lent)
        self.release()

    def borrow(self, like: Sequence[Tensor], timeout: timedelta) -> list[Tensor]:
        """Wait for the peer's next message and lend it as it lies in its slot (Note [a lent message]): tensors
        of ``like``'s shapes and dtypes that view the slot, no copy. The slot is this side's until :meth:`release`."""
        if self.lent:
            raise LinkError(f"message {self.taken} was never released before the next was borrowed (a bug)")
        seq = self.taken + 1
        self._wait_until(lambda: self.ready >= seq, timeout, "send its message")
        expected = message_bytes(like)
        if self._ready_bytes.get(seq) != expected:
            raise LinkError(
                f"message {seq} has {self._ready_bytes.get(seq)} bytes, this stage expected {expected}: the stages "
                "disagree on what travels (a bug; please report it with both stages' logs)"
            )
        del self._ready_bytes[seq]
        slot = self._slot(self.in_direction, seq)
        views, at = [], 0
        for t in like:
            size = t.numel() * t.element_size()
            views.append(slot[at : at + size].view(t.dtype).view(t.shape).detach())
            at += _padded(size)
        self.taken = seq
        self.lent = True
        return views

    def release(self) -> None:
        """Give the borrowed message's slot back: the peer may write its next message there (no tensor of
        :meth:`borrow` may be read after this)."""
        if not self.lent:
            raise LinkError("released a message that was not borrowed (a bug)")
        self.lent = False
        self._post(Kind.FREE, self.in_direction, self.taken, 0)

    def _slot(self, direction: Direction, seq: int) -> Tensor:
        at = (seq - 1) % SLOTS * self.capacity
        return self._views[direction][at : at + self.capacity]

    def _connected(self, deadline: float) -> socket.socket:
        if self._sock is None:
            assert self._listener is not None
            while self._sock is None:  # Note [who may connect]
                self._listener.settimeout(max(0.0, deadline - time.monotonic()))
                try:
                    sock, _ = self._listener.accept()
                except TimeoutError as err:
                    refused = (
                        f" (refused {len(self.refused)} other connection(s): {self.refused})" if self.refused else ""
                    )
                    raise LinkError(f"never connected to this stage's shared-memory link{refused}") from err
                except OSError as err:
                    raise LinkError(f"could not be accepted on this stage's shared-memory link ({err})") from err
                who = peer_credentials(sock)
                if who[1] == os.getuid() and (self.peer_pid is None or who[0] == self.peer_pid):
                    try:
                        self._bells = self._receive_bells(sock, deadline)
                    except LinkError:
                        sock.close()
                        raise
                    self._sock = sock
                else:
                    self.refused.append(who)
                    sock.close()
            self._sock.settimeout(None)
            self._listener.close()
            self._listener = None
            self._remove_files()  # both sides have mapped them
        if self._poll is None:
            assert self._bells is not None
            self._poll = select.poll()
            self._poll.register(self._bells[1], select.POLLIN)
            self._poll.register(self._sock, select.POLLRDHUP)  # its closing only: data must not wake us
        return self._sock

    @staticmethod
    def _receive_bells(sock: socket.socket, deadline: float) -> tuple[int, int]:
        """The upstream's side of Note [doorbells]: the two eventfds the downstream sent as it connected, as (rung by
        this side, waited on by this side)."""
        sock.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        except TimeoutError as err:
            raise LinkError("connected to the shared-memory link but sent no doorbells") from err
        except OSError as err:
            raise LinkError(f"closed the shared-memory link before it was set up ({err})") from err
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise LinkError("closed the shared-memory link before it was set up (no doorbells received)")
        down, up = fds
        return down, up

    def _post(self, kind: Kind, direction: Direction, seq: int, nbytes: int) -> None:
        sock = self._sock
        assert sock is not None, "every send and receive waits (and so connects) before it posts a record"
        # A neighbour whose process has ended leaves a record unread, which is no error in itself (a neighbour
        # that finished its last call exits while this stage frees its last slot). Whatever this stage waits
        # for next on the link fails, reading the closed socket.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(_RECORD.pack(kind, direction, seq, nbytes))
        assert self._bells is not None, "connected, so the doorbells are known"
        os.eventfd_write(self._bells[0], 1)  # Note [doorbells]: after the record it announces

    def _wait_until(self, done: Callable[[], bool], timeout: timedelta, what: str) -> None:
        """Read records until ``done()`` holds; LinkError past the timeout or when the peer closed the link."""
        deadline = time.monotonic() + timeout.total_seconds()
        sock = self._connected(deadline)
        assert self._poll is not None and self._bells is not None
        while not done():
            # Read what has come, then sleep until the next doorbell. A record is written before its doorbell
            # is rung, and the doorbell is reset before the socket is read, so no record goes unseen.
            closed = self._read_available(sock)
            if done():
                return
            if closed:
                raise LinkError("closed the shared-memory link: its process ended")
            left = deadline - time.monotonic()
            if not self._poll.poll(max(0.0, left) * 1e3):
                raise LinkError(f"did not {what} within {timeout.total_seconds():g} s")
            with contextlib.suppress(BlockingIOError):  # rung since the last read
                os.eventfd_read(self._bells[1])

    def _read_available(self, sock: socket.socket) -> bool:
        """Read every record already in the socket, without blocking; True if the peer closed its end."""
        while True:
            try:
                data = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except ConnectionResetError:  # it ended with records of this stage unread
                return True
            if not data:
                return True
            self._read_records(data)

    def _read_records(self, data: bytes) -> None:
        self._pending += data
        whole = len(self._pending) - len(self._pending) % _RECORD.size
        for kind, direction, seq, nbytes in _RECORD.iter_unpack(self._pending[:whole]):
            if kind == Kind.READY and direction == self.in_direction:
                self.ready = seq
                self._ready_bytes[seq] = nbytes
            elif kind == Kind.FREE and direction == self.out_direction:
                self.freed = seq
            else:
                raise LinkError(f"sent a record this link does not know: {(kind, direction, seq, nbytes)}")
        self._pending = self._pending[whole:]

    def _remove_files(self) -> None:
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._paths = []

    def close(self) -> None:
        """Close the socket (the peer's waits then fail at once) and remove any file not yet removed."""
        for sock in (self._sock, self._listener):
            if sock is not None:
                sock.close()
        self._sock = self._listener = None
        self._poll = None
        for bell in self._bells or ():
            with contextlib.suppress(OSError):
                os.close(bell)
        self._bells = None
        self._remove_files()
        self._views.clear()
        for ring in self._rings.values():
            with contextlib.suppress(BufferError):  # a tensor still views it: the garbage collector unmaps it
                ring.close()
        self._rings.clear()
