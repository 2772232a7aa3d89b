"""The shared-memory link (fdg_schedule/exchange/shm_link.py) accepts its neighbour only (Note [who may connect]): a
foreign connection to the abstract socket is refused and closed, and the neighbour still gets the link. Its
doorbells (Note [doorbells]) wake every wait, need no accept first, and a neighbour's exit ends a wait at once."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.process import BaseProcess

import pytest
import torch

from fdg_schedule.exchange.shm_link import SLOTS, Link, LinkError, _socket_name

TIMEOUT = timedelta(seconds=30)


def _neighbour(token: int, capacity: int, results: mp.Queue) -> None:
    """The downstream stage: join, receive one message, send one back."""
    link = Link.join(token, capacity, TIMEOUT)
    got = torch.empty(4)
    link.receive([got], TIMEOUT)
    link.send([got * 2], TIMEOUT)
    results.put(got.tolist())
    link.close()


@pytest.mark.timeout(60)
def test_a_foreign_connection_is_refused_and_the_neighbour_still_connects() -> None:
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    link = Link.create(64)  # its peer_pid is set once the neighbour's process exists (it is read at accept time)
    # A foreign process of this user (this very process) connects first, before the neighbour.
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    foreign.connect(_socket_name(link.token))
    neighbour = ctx.Process(target=_neighbour, args=(link.token, link.capacity, results))
    neighbour.start()
    try:
        link.peer_pid = neighbour.pid
        link.send([torch.arange(4.0)], TIMEOUT)  # accepts: refuses the foreign connection, then the neighbour's
        back = torch.empty(4)
        link.receive([back], TIMEOUT)
        assert back.tolist() == [0.0, 2.0, 4.0, 6.0] and results.get(timeout=30) == [0.0, 1.0, 2.0, 3.0]
        assert link.refused == [(os.getpid(), os.getuid(), os.getgid())]
        foreign.settimeout(5)
        assert foreign.recv(1) == b""  # closed by the link
    finally:
        neighbour.join(30)
        link.close()
        foreign.close()
    assert neighbour.exitcode == 0


@pytest.mark.timeout(30)
def test_a_link_whose_neighbour_never_connects_names_what_it_refused() -> None:
    link = Link.create(64, peer_pid=os.getpid() + 1_000_000)  # no such process will connect
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    foreign.connect(_socket_name(link.token))
    with pytest.raises(LinkError, match=r"never connected .*\(refused 1 other connection\(s\)"):
        link.send([torch.zeros(4)], timedelta(seconds=1))
    foreign.settimeout(5)
    assert foreign.recv(1) == b""  # closed by the link
    link.close()
    foreign.close()


@contextlib.contextmanager
def _downstream_running(target: Callable[..., None], *args: object) -> Iterator[tuple[Link, BaseProcess]]:
    """A link and its downstream stage, ``target(token, capacity, *args)`` in a process of its own; joined and
    closed on the way out."""
    link = Link.create(64)
    neighbour = mp.get_context("spawn").Process(target=target, args=(link.token, link.capacity, *args))
    neighbour.start()
    try:
        link.peer_pid = neighbour.pid
        yield link, neighbour
    finally:
        neighbour.join(30)
        link.close()


def _take_all_then_send_back(token: int, capacity: int, messages: int) -> None:
    """The downstream stage: join, receive ``messages`` messages (slowly), then send each back doubled."""
    link = Link.join(token, capacity, TIMEOUT)
    got = [torch.empty(4) for _ in range(messages)]
    for i, into in enumerate(got):
        if i % SLOTS == 0:
            time.sleep(0.05)  # the upstream has filled every slot and sleeps until a FREE record rings it
        link.receive([into], TIMEOUT)
    for t in got:
        link.send([t * 2], TIMEOUT)
    link.close()


@pytest.mark.timeout(60)
def test_every_record_wakes_its_reader_through_many_reuses_of_every_slot() -> None:
    """Note [doorbells]: each side sleeps in turn on READY records (a message to read) and on FREE records (a slot
    to reuse), many times over every slot. A record whose doorbell is lost hangs its reader until the timeout."""
    messages = 6 * SLOTS
    with _downstream_running(_take_all_then_send_back, messages) as (link, neighbour):
        for i in range(messages):
            link.send([torch.full((4,), float(i))], TIMEOUT)
        back = torch.empty(4)
        received = []
        for i in range(messages):
            if i % SLOTS == 0:
                time.sleep(0.05)  # now the neighbour waits for FREE records
            link.receive([back], TIMEOUT)
            received.append(back[0].item())
        assert received == [2.0 * i for i in range(messages)]
        assert link.sent == link.taken == link.freed == messages
    assert neighbour.exitcode == 0


def _receive_once_then_exit(token: int, capacity: int) -> None:
    link = Link.join(token, capacity, TIMEOUT)
    link.receive([torch.empty(4)], TIMEOUT)
    os._exit(0)  # no close: the kernel closes the socket as the process ends


@pytest.mark.timeout(60)
def test_a_wait_on_a_neighbour_that_exited_fails_at_once_naming_it() -> None:
    with _downstream_running(_receive_once_then_exit) as (link, neighbour):
        link.send([torch.zeros(4)], TIMEOUT)
        neighbour.join(30)
        start = time.monotonic()
        with pytest.raises(LinkError, match="closed the shared-memory link: its process ended"):
            link.receive([torch.empty(4)], TIMEOUT)
        assert time.monotonic() - start < 5, "the closed socket ends the wait, not the 30 s timeout"


def _send_first(token: int, capacity: int) -> None:
    link = Link.join(token, capacity, TIMEOUT)
    link.send([torch.arange(4.0)], TIMEOUT)  # before the upstream has accepted: must not wait for it
    link.close()


@pytest.mark.timeout(60)
def test_the_downstream_sends_before_the_upstream_accepts() -> None:
    """Note [doorbells]: the downstream brings the doorbells as it connects, so its first record waits for nothing
    of the upstream's (the exchange relies on it when a link is replaced mid-run)."""
    with _downstream_running(_send_first) as (link, neighbour):
        neighbour.join(30)  # it sent and exited while this side had not yet accepted
        assert neighbour.exitcode == 0
        got = torch.empty(4)
        link.receive([got], TIMEOUT)  # accepts now, and the record and its doorbell are there
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0]


def _send_many(token: int, capacity: int, messages: int, sent: mp.Queue) -> None:
    """The downstream stage: send ``messages`` messages as fast as slots free, reporting each once it was sent."""
    link = Link.join(token, capacity, TIMEOUT)
    for i in range(messages):
        link.send([torch.full((4,), float(i))], TIMEOUT)
        sent.put(i)
    time.sleep(0.5)  # keep the link up while the upstream reads the last ones
    link.close()


@pytest.mark.timeout(60)
def test_a_lent_message_is_read_where_it_lies_and_its_slot_waits_for_the_release() -> None:
    """Note [a lent message]: borrow() views the slot (no copy) and the sender may not rewrite that slot before
    release(); one message is lent at a time."""
    sent: mp.Queue = mp.get_context("spawn").Queue()
    with _downstream_running(_send_many, SLOTS + 1, sent) as (link, neighbour):
        like = [torch.empty(4)]
        first = link.borrow(like, TIMEOUT)
        assert first[0].tolist() == [0.0] * 4
        assert first[0].untyped_storage().data_ptr() == link._views[link.in_direction].untyped_storage().data_ptr()
        with pytest.raises(LinkError, match="never released"):
            link.borrow(like, TIMEOUT)
        assert [sent.get(timeout=30) for _ in range(SLOTS)] == list(range(SLOTS))
        time.sleep(0.3)
        assert sent.empty(), "message SLOTS + 1 reuses the lent slot: it must wait for the release"
        assert first[0].tolist() == [0.0] * 4
        link.release()
        assert sent.get(timeout=30) == SLOTS
        for i in range(1, SLOTS + 1):
            assert link.borrow(like, TIMEOUT)[0].tolist() == [float(i)] * 4
            link.release()
        with pytest.raises(LinkError, match="not borrowed"):
            link.release()
    assert neighbour.exitcode == 0
