"""The Link interface: its contract on both implementations, the transport registry, and a transport added from
outside the package (a test's counting wrapper of the process group's link) running an engine (real ranks)."""

from __future__ import annotations

import time
from typing import Any

import engine_workers
import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.distributed


def test_the_registry_and_the_config_key_offer_the_same_transports() -> None:
    """A new transport is one module, its entry in TRANSPORTS and its name among the config key's choices."""
    from fdg_schedule.base import config
    from fdg_schedule.exchange import transports

    assert set(config.TRANSPORTS) == {"auto", *transports.TRANSPORTS}


def test_a_transport_nobody_registered_is_an_error_naming_the_key() -> None:
    from fdg_schedule.base.errors import FDGRuntimeError
    from fdg_schedule.exchange import transports

    with pytest.raises(FDGRuntimeError, match=r"transport must be one of \['process_group', 'shm'\], got 'tcp' "):
        transports.build("tcp", None)  # type: ignore[arg-type]  (refused before the place is read)


# -- the contract, on the process group's link and the shared-memory link ----------------------------------


def _links(rank: int, kind: str, timeout_s: float) -> Any:
    """Rank 0's link to rank 1 (its next stage) or rank 1's to rank 0, of ``kind``."""
    from datetime import timedelta

    import torch.distributed as dist

    from fdg_schedule.exchange.link import Place
    from fdg_schedule.exchange.process_group import GroupLink, GroupTraffic, Path
    from fdg_schedule.exchange.shm_transport import SharedMemoryTransport

    timeout, describe = timedelta(seconds=timeout_s), f"stage {rank} (global rank {rank})"
    traffic = GroupTraffic(Path.BLOCKING, None, timeout, describe, lambda: lambda: True)
    peer, name = 1 - rank, f"stage {1 - rank} (global rank {1 - rank})"
    group = GroupLink(traffic, peer, name, None, None)
    if kind == "process_group":
        return traffic, group
    names = {"prev": name, "next": name}
    place = Place(None if rank == 0 else 0, 1 if rank == 0 else None, torch.device("cpu"), "gloo", "blocking",
                  timeout, describe, names)  # fmt: skip
    transport = SharedMemoryTransport(place)
    assert transport.sides == {"prev": rank == 1, "next": rank == 0}
    setup: list[Any] = [None]
    link = None
    if rank == 0:
        link, setup[0] = transport.create(4096, group)
    dist.broadcast_object_list(setup, src=0)  # what the header carries
    if rank == 1:
        link = transport.join(setup[0], group)
    return traffic, link


def contract(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Rank 0 sends three messages down; rank 1 waits for two and borrows the third (where the link lends),
    releases it and answers up; then a receive that never comes fails within the timeout, naming the neighbour
    (last: a gloo pair that timed out is closed)."""
    traffic, link = _links(rank, kind, timeout_s=1.5)
    out: dict[str, Any] = {"capacity": link.capacity, "blocking_send": link.blocking_send}
    if rank == 0:
        for i in range(3):
            link.send([torch.full((4,), float(i)), torch.tensor([i], dtype=torch.int64)])
        back = torch.empty(2)
        handles = link.post_receive([back])
        link.wait(handles, "the answer from stage 1 (global rank 1)")
        out["back"] = back
        traffic.retire_sends()
        traffic.retire_sends()  # the sends of both "ticks": taken
        time.sleep(6)  # alive past stage 1's timeout: its last wait gives up on a neighbour that sends nothing
    else:
        got = []
        for _ in range(2):
            bufs = [torch.empty(4), torch.empty(1, dtype=torch.int64)]
            handles = link.post_receive(bufs)
            link.wait(handles, "a message from stage 0 (global rank 0)")
            assert handles == []  # waited for: forgotten
            got.append([t.clone() for t in bufs])
        bufs = [torch.empty(4), torch.empty(1, dtype=torch.int64)]
        handles = link.post_receive(bufs)
        lent = link.borrow(handles, bufs, "a message from stage 0 (global rank 0)")
        out["lent"] = lent is not None
        if lent is None:
            link.wait(handles, "a message from stage 0 (global rank 0)")
            lent = bufs
        got.append([t.clone() for t in lent])
        if out["lent"]:
            link.release()
        out["got"] = got
        link.send([torch.tensor([7.0, 8.0])])
        traffic.retire_sends()
        traffic.retire_sends()
        start = time.monotonic()
        try:
            link.wait(link.post_receive([torch.empty(1)]), "the late message from stage 0 (global rank 0)")
            out["error"] = None
        except Exception as err:  # noqa: BLE001  (what the exchange would raise)
            out["error"] = f"{type(err).__name__}: {err}"
        out["waited_s"] = time.monotonic() - start
    link.close()
    return out


@pytest.mark.parametrize("kind", ["process_group", "shm"])
def test_either_link_keeps_the_contract(tmp_path, kind: str) -> None:
    stage0, stage1 = run_ranks(contract, 2, tmp_path, kind, deadline_s=120)
    for i, (values, word) in enumerate(stage1["got"]):  # in the order sent, shapes and dtypes kept
        assert torch.equal(values, torch.full((4,), float(i))) and word.tolist() == [i]
    assert torch.equal(stage0["back"], torch.tensor([7.0, 8.0]))
    assert stage1["lent"] == (kind == "shm")  # only shared memory lends (Note [a lent message])
    assert stage1["error"].startswith("FDGRuntimeError: stage 1 (global rank 1): gave up waiting for the late ")
    assert "from stage 0 (global rank 0) (timeout 1.5 s)" in stage1["error"] and 1.4 <= stage1["waited_s"] < 6
    assert stage1["blocking_send"] == (kind == "shm") and (stage1["capacity"] == float("inf")) == (kind != "shm")


# -- a transport from outside the package -----------------------------------------------------------------


class CountingLink:
    """A toy transport's link: the process group's, counting what goes through it."""

    counts = {"sent": 0, "received": 0}
    blocking_send = False

    def __init__(self, group_link: Any) -> None:
        self.inner = group_link
        self.capacity = group_link.capacity

    def send(self, tensors):
        CountingLink.counts["sent"] += 1
        self.inner.send(tensors)

    def post_receive(self, into):
        return self.inner.post_receive(into)

    def wait(self, handles, what):
        CountingLink.counts["received"] += bool(handles)
        self.inner.wait(handles, what)

    def borrow(self, handles, like, what):
        return None

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class CountingTransport:
    """A toy transport: links to both neighbours, set up at the header exchange like shared memory's."""

    def __init__(self, place: Any) -> None:
        self.sides = {"prev": place.prev_rank is not None, "next": place.next_rank is not None}

    def create(self, nbytes: int, group_link: Any):
        return CountingLink(group_link), (1, nbytes)

    def join(self, setup: tuple[int, int], group_link: Any):
        return CountingLink(group_link)


def counted_ticks(rank: int, world: int, ticks: int) -> dict[str, Any]:
    """The ticks of test_comm's two transports, through the toy transport registered here."""
    from test_comm import exchange_ticks

    from fdg_schedule.exchange import comm, transports

    transports.TRANSPORTS["counting"] = CountingTransport
    plain = exchange_ticks(rank, world, False, ticks)
    original = comm.NeighbourExchange.__init__

    def counting(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "transport": "counting"})

    comm.NeighbourExchange.__init__ = counting  # type: ignore[method-assign]
    try:
        toy = exchange_ticks(rank, world, False, ticks)
    finally:
        comm.NeighbourExchange.__init__ = original  # type: ignore[method-assign]
    return {"plain": plain["got"], "toy": toy["got"], "counts": dict(CountingLink.counts)}


def test_a_transport_registered_from_outside_carries_every_message(tmp_path) -> None:
    ticks = 5
    stage0, stage1 = run_ranks(counted_ticks, 2, tmp_path, ticks, deadline_s=120)
    for stage in (stage0, stage1):
        assert repr(stage["toy"]) == repr(stage["plain"])
    assert stage0["counts"] == {"sent": ticks, "received": ticks}  # activations down, gradients up
    assert stage1["counts"] == {"sent": ticks, "received": ticks}


def train_counted(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case trained on the process group, then again with the toy transport registered under that name
    (the config key's choices are the package's; a new transport adds its own there)."""
    from fdg_schedule.exchange import transports

    plain = engine_workers.train(rank, world, cases)
    original = transports.TRANSPORTS["process_group"]
    transports.TRANSPORTS["process_group"] = CountingTransport
    try:
        toy = engine_workers.train(rank, world, cases)
    finally:
        transports.TRANSPORTS["process_group"] = original
    return {"plain": plain, "toy": toy, "counts": dict(CountingLink.counts)}


def test_an_engine_on_a_transport_registered_from_outside_equals_the_process_group(tmp_path) -> None:
    case = {"stages": 2, "n": 64, "gas": 3, "calls": 2, "grad_shrink": 0.5, "transport": "process_group"}
    results = run_ranks(train_counted, 2, tmp_path, [case], deadline_s=300)
    for r in results:
        (plain,), (toy,) = r["plain"], r["toy"]
        assert toy["losses"] == plain["losses"]
        for got, want in zip(toy["states"], plain["states"]):
            for name in want:
                assert torch.equal(got[name], want[name]), name
        assert toy["links"] == (["next"] if toy["stage_id"] == 0 else ["prev"])  # the toy's links carried them
        assert r["counts"]["sent"] > 0 and r["counts"]["received"] > 0
