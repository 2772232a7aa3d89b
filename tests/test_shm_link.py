"""The shared-memory link accepts its neighbour only (Note [who may connect] in fdg_schedule/exchange/shm_link.py): a
foreign connection to the abstract socket is refused and closed, and the neighbour still gets the link."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from datetime import timedelta

import pytest
import torch

from fdg_schedule.exchange.shm_link import Link, LinkError, _socket_name

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
