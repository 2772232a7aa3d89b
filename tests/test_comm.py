"""The neighbour exchange on its own: tuple activations of mixed dtypes, gradients and the loss (2 ranks)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.distributed


def exchange(rank: int, world: int) -> dict:
    from fdg_schedule.exchange.comm import NeighbourExchange

    comm = NeighbourExchange(
        prev_rank=None if rank == 0 else 0,
        next_rank=1 if rank == 0 else None,
        device=torch.device("cpu"),
        dynamic_shape=False,
        describe=lambda stage, r: f"stage {stage} (global rank {r})",
        stage_id=rank,
        timeout_s=30,
    )
    activation = (torch.arange(6.0).reshape(2, 3), torch.tensor([True, False]), torch.tensor([7, 8]))
    float_meta = [(torch.Size([2, 3]), torch.float32)]
    if rank == 0:  # tick 0: send the activation, post the receive of its gradient
        comm.post(activation, None, None, recv_activation=False, recv_grad_meta=float_meta)
        grads, loss = comm.wait_grad()
        comm.complete()
        return {"grads": grads, "loss": loss}
    comm.post(None, None, None, recv_activation=True, recv_grad_meta=None)  # tick 0: post the receive
    received = comm.wait_activation()  # tick 1: the activation, then the gradient and loss go back
    comm.post(None, (torch.full((2, 3), 3.0),), torch.tensor(1.5), recv_activation=False, recv_grad_meta=None)
    comm.complete()
    return {"received": received}


def test_tuple_activations_gradients_and_loss_arrive_intact(tmp_path) -> None:
    stage0, stage1 = run_ranks(exchange, 2, tmp_path, deadline_s=120)
    tensors, end = stage1["received"]
    assert end == -1  # the control word: data keeps coming
    assert [t.dtype for t in tensors] == [torch.float32, torch.bool, torch.int64]
    assert torch.equal(tensors[0], torch.arange(6.0).reshape(2, 3))
    assert tensors[1].tolist() == [True, False] and tensors[2].tolist() == [7, 8]
    assert torch.equal(stage0["grads"][0], torch.full((2, 3), 3.0)) and stage0["loss"].item() == 1.5


def test_a_wait_with_no_receive_posted_prints_every_stages_plan(one_rank_group: None) -> None:
    from fdg_schedule.base.errors import FDGRuntimeError
    from fdg_schedule.exchange.comm import NeighbourExchange
    from fdg_schedule.sched import grid
    from fdg_schedule.sched.schedule import FDGTrainSchedule

    schedule = FDGTrainSchedule(4, 2, 1)  # stage 1 of K = 2, at tick 1
    comm = NeighbourExchange(None, None, torch.device("cpu"), False, stage_id=1, timeout_s=5,
                             plan=lambda: grid.around(schedule, 1))  # fmt: skip
    with pytest.raises(FDGRuntimeError, match="no activation receive was posted") as failed:
        comm.wait_activation()
    assert "> A0 pa1 L1 F0 B0 sg0 R S X T+ <" in str(failed.value)  # stage 1's cell at tick 1, marked


# -- the path and the stream-ordered machinery, without NCCL (Note [three ways to wait]) ------------


@pytest.mark.parametrize(
    "backend,device,path",
    [
        ("gloo", "cpu", "blocking"),  # today's behaviour, unchanged
        ("gloo", "cuda", "staged"),  # several ranks on one GPU: gloo moves host memory
        ("nccl", "cuda", "stream"),
        ("ccl", "xpu", "blocking"),  # a backend this package does not know: host waits, as on gloo
        # a default group with a backend per device type (init_process_group() without a backend): the device's
        ("cpu:gloo,cuda:nccl", "cuda", "stream"),
        ("cpu:gloo,cuda:nccl", "cpu", "blocking"),
        ("cpu:gloo,cuda:gloo", "cuda", "staged"),
    ],
)
def test_the_path_follows_backend_and_device(backend: str, device: str, path: str) -> None:
    from fdg_schedule.exchange.process_group import choose_path, needs_host_group

    assert choose_path(backend, torch.device(device)).value == path
    # control words beside the data unless the data goes through a backend on an accelerator
    assert needs_host_group(backend, torch.device(device)) == (path == "stream" or backend == "ccl")


class FakeWork:
    """A stream-ordered work as the watchdog sees it: only ``is_completed()`` (NCCL cannot run here)."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_watchdog_fails_the_stage_when_a_transfer_outlives_the_timeout() -> None:
    from fdg_schedule.base.errors import FDGRuntimeError
    from fdg_schedule.base.watchdog import Watchdog

    stuck: list[FDGRuntimeError] = []
    dog = Watchdog(0.2, "stage 1 (global rank 1)", on_stuck=stuck.append, poll_s=0.01, grace_s=0.2)
    arrives, never = FakeWork(), FakeWork()
    dog.watch([arrives], "the gradient from stage 2 (global rank 2)")
    arrives.done = True
    dog.poll()
    assert dog.watching() == 0 and dog.failure is None  # completed in time: forgotten
    dog.watch([never], "the activation from stage 0 (global rank 0)")
    dog.raise_if_failed()  # not late yet
    deadline = time.monotonic() + 5
    while not stuck and time.monotonic() < deadline:  # the thread fails it, then gives the main thread grace
        time.sleep(0.02)
    assert stuck and "gave up waiting for the activation from stage 0 (global rank 0) (timeout 0.2 s)" in str(stuck[0])
    with pytest.raises(FDGRuntimeError, match="stage 1 \\(global rank 1\\): gave up waiting"):
        dog.raise_if_failed()


def test_watchdog_leaves_a_main_thread_that_raised_alone() -> None:
    from fdg_schedule.base.errors import FDGRuntimeError
    from fdg_schedule.base.watchdog import Watchdog

    stuck: list[FDGRuntimeError] = []
    dog = Watchdog(0.05, "stage 0 (global rank 0)", on_stuck=stuck.append, poll_s=0.01, grace_s=0.5)
    dog.watch([FakeWork()], "stage 1 (global rank 1) to take what this stage sent")
    deadline = time.monotonic() + 5
    while dog.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(FDGRuntimeError):
        dog.raise_if_failed()  # the main thread got the error: the process is not ended under it
    time.sleep(0.7)
    assert stuck == []


def test_the_timeout_of_a_stream_ordered_transfer_runs_from_when_the_stream_reaches_it() -> None:
    """Note [a timeout without a blocking wait]: the host posts ahead of its stream; the clock starts at the stream."""
    from fdg_schedule.base.watchdog import StreamWork, Watchdog

    reached, stuck = [False], []
    dog = Watchdog(0.1, "stage 1 (global rank 1)", on_stuck=stuck.append, poll_s=60, grace_s=60)  # polled here
    dog.watch([StreamWork(FakeWork(), lambda: reached[0])], "the gradient from stage 2 (global rank 2)")
    time.sleep(0.3)
    dog.poll()
    assert dog.failure is None  # posted 0.3 s ago, three timeouts, but its stream has not got there yet
    reached[0] = True
    dog.poll()  # the stream got there: the clock starts now
    assert dog.failure is None
    time.sleep(0.3)
    dog.poll()
    assert "gave up waiting for the gradient from stage 2 (global rank 2) (timeout 0.1 s)" in str(dog.failure)
    dog.close()
    assert stuck == []


class FakeP2POp:
    """What ``dist.P2POp`` was asked for (the stage's links are faked, so no real group can be checked)."""

    def __init__(self, op, tensor, peer, group=None, tag=0) -> None:
        self.op, self.peer, self.group = op.__name__, peer, group


class FakeBatchWork(FakeWork):
    def wait(self, timeout=None) -> bool:
        return True


def test_under_stream_each_link_gets_its_own_group_ready_before_the_first_tick(one_rank_group, monkeypatch) -> None:
    """Note [one communicator per link]: stage 1 of K = 3 (global ranks 0, 1, 2), faked around a one-rank group.
    Two exchanges are built (two engines in one process): the groups, one per link and direction (activations
    down, gradients up), are made, and first used, once."""
    import torch.distributed as dist

    from fdg_schedule.base.watchdog import StreamWork
    from fdg_schedule.exchange import comm, process_group

    made, first_ops, posted = [], [], []
    monkeypatch.setattr(process_group, "_link_groups", {})
    monkeypatch.setattr(process_group, "_warmed", set())
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(
        dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [1, 2, None])
    )
    monkeypatch.setattr(dist, "new_group", lambda ranks: made.append(tuple(ranks)) or f"link{tuple(ranks)}#{len(made)}")
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: first_ops.append(group))
    monkeypatch.setattr(dist, "P2POp", FakeP2POp)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted.append(ops) or [FakeBatchWork() for _ in ops])
    reached = [False]
    for _ in range(2):
        exchange = comm.NeighbourExchange(0, 2, torch.device("cpu"), False, stage_id=1, timeout_s=60,
                                          path=comm.Path.STREAM, mark=lambda: lambda: reached[0])  # fmt: skip
    assert made == [(0, 1), (0, 1), (1, 2), (1, 2)]
    down01, up01, down12, up12 = "link(0, 1)#1", "link(0, 1)#2", "link(1, 2)#3", "link(1, 2)#4"
    assert first_ops == [None, down01, up01, down12, up12]  # the default group (every rank), then each link's two
    assert exchange.groups == {("prev", "down"): down01, ("prev", "up"): up01, ("next", "down"): down12,
                               ("next", "up"): up12}  # fmt: skip
    meta = [(torch.Size([2]), torch.float32)]
    exchange.sent_meta = exchange.recv_meta = meta  # the headers went before
    exchange.post((torch.ones(2),), (torch.ones(2),), torch.tensor(0.5), recv_activation=True, recv_grad_meta=meta)
    groups = {(op.op, op.peer): op.group for batch in posted for op in batch}
    assert groups == {("isend", 0): up01, ("irecv", 0): down01,  # gradient up, activation in
                      ("isend", 2): down12, ("irecv", 2): up12}  # fmt: skip
    works = exchange._activation.handles
    assert all(isinstance(w, StreamWork) for w in works) and not any(w.started() for w in works)
    reached[0] = True  # the stream got to the post
    assert all(w.started() for w in works)
    exchange.watchdog.close()


def test_send_buffers_live_until_their_transfer_completes() -> None:
    import gc
    import weakref

    from fdg_schedule.base.watchdog import InFlightSends

    kept = InFlightSends()
    work = FakeWork()
    buffer = torch.ones(4)
    alive = weakref.ref(buffer)
    kept.keep([work], [buffer])
    del buffer
    gc.collect()
    kept.release_completed()
    assert alive() is not None and kept.held() == 1  # the transfer may still read it
    work.done = True
    kept.release_completed()
    gc.collect()
    assert alive() is None and kept.held() == 0


def test_control_words_are_read_only_from_host_memory() -> None:
    from fdg_schedule.base.errors import FDGRuntimeError
    from fdg_schedule.base.guards import read_host

    assert read_host(torch.tensor([-1], dtype=torch.int64)) == [-1]
    with pytest.raises(FDGRuntimeError, match="read_host\\(\\) is for tensors in host memory, got one on meta"):
        read_host(torch.empty(1, dtype=torch.int64, device="meta"))


def test_a_coalesced_batch_work_stands_for_its_sends_and_receives() -> None:
    from fdg_schedule.exchange.process_group import split_works

    assert split_works(["s1", "s2", "r1"], 2, 1) == (["s1", "s2"], ["r1"])  # gloo: one work per operation
    assert split_works(["all"], 2, 1) == (["all"], ["all"])  # NCCL: one work for the batch
    assert split_works(["all"], 0, 2) == ([], ["all"])


# -- the shared-memory transport (Note [shared-memory transport]) ---------------------------------


def _pair(rank: int, shm: bool, timeout_s: float = 30):
    from fdg_schedule.exchange.comm import NeighbourExchange

    return NeighbourExchange(
        prev_rank=None if rank == 0 else 0,
        next_rank=1 if rank == 0 else None,
        device=torch.device("cpu"),
        dynamic_shape=False,
        stage_id=rank,
        timeout_s=timeout_s,
        transport="shm" if shm else "process_group",
    )


def exchange_ticks(rank: int, world: int, shm: bool, ticks: int) -> dict:
    """Stage 0 sends a tuple activation every tick; stage 1 answers each with gradients and a loss."""
    comm = _pair(rank, shm)
    float_meta = [(torch.Size([2, 3]), torch.float32)]
    got = []
    if rank == 0:
        for tick in range(ticks):
            if tick:
                got.append(comm.wait_grad())
            activation = (torch.full((2, 3), float(tick)), torch.tensor([tick % 2 == 0, True]), torch.tensor([tick, 8]))
            comm.post(activation, None, None, recv_activation=False, recv_grad_meta=float_meta)
        got.append(comm.wait_grad())
    else:
        comm.post(None, None, None, recv_activation=True, recv_grad_meta=None)
        for tick in range(ticks):
            tensors, end = comm.wait_activation()
            got.append((tensors, end))
            grads = (tensors[0] * 10 + 1,)
            comm.post(None, grads, torch.tensor(tick + 0.5), recv_activation=tick < ticks - 1, recv_grad_meta=None)
    comm.complete()
    link = comm.links["next" if rank == 0 else "prev"]
    shm = getattr(link, "shm", None)  # a shared-memory link's files (tests/test_link.py runs this on a toy's link)
    files_left = [] if shm is None else [p for p in shm._paths if os.path.exists(p)]
    return {"got": got, "linked": link is not None, "files_left": files_left}


@pytest.mark.parametrize("shm", [False, True], ids=["process_group", "shm"])
def test_every_tick_arrives_intact_through_either_transport(tmp_path, shm: bool) -> None:
    ticks = 7  # more messages than the link has slots: the ring wraps around
    stage0, stage1 = run_ranks(exchange_ticks, 2, tmp_path, shm, ticks, deadline_s=120)
    assert stage0["linked"] == stage1["linked"] == shm
    assert stage0["files_left"] == stage1["files_left"] == []  # nothing left in /dev/shm
    for tick, ((a, flags, ints), end) in enumerate(stage1["got"]):
        assert end == -1
        assert torch.equal(a, torch.full((2, 3), float(tick)))
        assert flags.dtype == torch.bool and flags.tolist() == [tick % 2 == 0, True]
        assert ints.dtype == torch.int64 and ints.tolist() == [tick, 8]
    for tick, (grads, loss) in enumerate(stage0["got"]):
        assert torch.equal(grads[0], torch.full((2, 3), 10.0 * tick + 1)) and loss.item() == tick + 0.5


def dies_after_the_first_activation(rank: int, world: int) -> dict:
    comm = _pair(rank, shm=True, timeout_s=60)
    meta = [(torch.Size([2]), torch.float32)]
    if rank == 1:
        comm.post(None, None, None, recv_activation=True, recv_grad_meta=None)
        comm.wait_activation()
        os._exit(3)  # killed before it sends the gradient
    comm.post((torch.ones(2),), None, None, recv_activation=False, recv_grad_meta=meta)
    start = time.monotonic()
    try:
        comm.wait_grad()
    except Exception as err:  # noqa: BLE001  (what the stage would raise)
        return {"error": f"{type(err).__name__}: {err}", "after_s": time.monotonic() - start}
    return {"error": None, "after_s": time.monotonic() - start}


def test_a_neighbour_that_dies_fails_the_wait_at_once_naming_it(tmp_path) -> None:
    stage0, _ = run_ranks(dies_after_the_first_activation, 2, tmp_path, deadline_s=120, expect_exit={1: 3})
    assert stage0["error"] is not None and stage0["error"].startswith("FDGRuntimeError")
    assert "gave up waiting for the gradient from stage 1 (global rank 1)" in stage0["error"]
    assert "closed the shared-memory link: its process ended" in stage0["error"]
    assert stage0["after_s"] < 30  # long before the 60 s timeout


def growing_activations(rank: int, world: int, sizes: list[int]) -> dict:
    """dynamic_shape=True through shared memory, in the engine's order at K = 2: an activation that outgrows
    the link's slots gets a new link. Stage 0 back-propagates micro-batch t - 2 at tick t; stage 1 forwards
    and back-propagates micro-batch t - 1; both drain at the end."""
    from fdg_schedule.exchange.comm import NeighbourExchange

    comm = NeighbourExchange(
        prev_rank=None if rank == 0 else 0, next_rank=1 if rank == 0 else None, device=torch.device("cpu"),
        dynamic_shape=True, stage_id=rank, timeout_s=30, transport="shm",
    )  # fmt: skip
    got, tokens, n = [], [], len(sizes)
    if rank == 0:
        for tick in range(n + 2):
            if tick >= 2:
                got.append(comm.wait_grad()[0][0])
            activation = (torch.full((sizes[tick],), float(tick)),) if tick < n else None
            backward_next = 0 <= tick - 1 < n  # micro-batch tick - 1, back-propagated next tick
            meta = [(torch.Size([sizes[tick - 1]]), torch.float32)] if backward_next else None
            comm.post(activation, None, None, recv_activation=False, recv_grad_meta=meta)
            if activation is not None:
                tokens.append(comm.links["next"].shm.token)
    else:
        for tick in range(n + 1):
            grads = None
            if tick >= 1:
                (a,), _ = comm.wait_activation()
                got.append(a)
                grads = (a + 1,)
            comm.post(None, grads, torch.tensor(0.0) if grads else None, recv_activation=tick < n, recv_grad_meta=None)
            if tick < n:
                tokens.append(comm.links["prev"].shm.token)
    comm.complete()
    return {"got": got, "tokens": tokens}


def test_an_activation_that_outgrows_its_slots_gets_a_new_link(tmp_path) -> None:
    sizes = [1000, 800, 1000, 60000, 2000, 60000]  # grows at tick 3 only (the slots keep the largest size)
    stage0, stage1 = run_ranks(growing_activations, 2, tmp_path, sizes, deadline_s=120)
    for tick, n in enumerate(sizes):
        assert torch.equal(stage1["got"][tick], torch.full((n,), float(tick)))
        assert torch.equal(stage0["got"][tick], torch.full((n,), tick + 1.0))
    first, second = stage0["tokens"][0], stage0["tokens"][3]
    assert stage0["tokens"] == [first] * 3 + [second] * 3 and first != second
    assert stage1["tokens"] == stage0["tokens"]  # the downstream stage joined each link the upstream made


def test_the_shared_memory_transport_on_an_accelerator_path_is_an_error_naming_the_key(one_rank_group: None) -> None:
    from fdg_schedule.base.errors import FDGRuntimeError
    from fdg_schedule.exchange.comm import NeighbourExchange, Path

    with pytest.raises(FDGRuntimeError, match='pipeline.fdg.transport "shm" moves tensors in host memory') as err:
        NeighbourExchange(None, 1, torch.device("cpu"), False, stage_id=0, timeout_s=5, path=Path.STAGED,
                          transport="shm")  # fmt: skip
    assert '(or set it to "process_group")' in str(err.value)


def out_of_step(rank: int, world: int) -> str | None:
    """Stage 0 leaves a gradient receive pending while its activation outgrows the link: an error, not a hang."""
    from fdg_schedule.exchange.comm import NeighbourExchange

    comm = NeighbourExchange(
        prev_rank=None if rank == 0 else 0, next_rank=1 if rank == 0 else None, device=torch.device("cpu"),
        dynamic_shape=True, stage_id=rank, timeout_s=5, transport="shm",
    )  # fmt: skip
    try:
        if rank == 0:
            comm.post((torch.zeros(10),), None, None, False, [(torch.Size([10]), torch.float32)])
            comm.post((torch.zeros(100000),), None, None, False, None)  # the gradient receive never waited for
        else:
            comm.post(None, None, None, recv_activation=True, recv_grad_meta=None)
            comm.wait_activation()
            comm.post(None, None, None, recv_activation=True, recv_grad_meta=None)
    except Exception as err:  # noqa: BLE001  (what the stage would raise)
        return str(err)
    return None


def test_a_link_change_with_a_receive_pending_is_an_error_not_a_hang(tmp_path) -> None:
    stage0, stage1 = run_ranks(out_of_step, 2, tmp_path, deadline_s=120)
    assert stage0 is not None and "a gradient receive is still pending while the shared-memory link changes" in stage0
    assert stage1 is not None and "stage 1 (global rank 1): gave up" in stage1  # its neighbour stopped: no hang


def neighbours_on_hosts(rank: int, world: int, hosts: list[str]) -> tuple[bool, bool, int | None, int]:
    """Which neighbours ``same_host_neighbours`` finds on this rank's host, with ``hosts[r]`` as rank r's host,
    the next stage's pid it returns, and this rank's pid."""
    import os

    from fdg_schedule.exchange import shm_transport

    shm_transport.host_id = lambda: hosts[rank]  # type: ignore[assignment]  (each rank its own process)
    found = shm_transport.same_host_neighbours(rank - 1 if rank else None, rank + 1 if rank < world - 1 else None)
    return (*found, os.getpid())


def test_only_neighbours_on_the_same_host_get_a_shared_memory_link(tmp_path) -> None:
    # K = 3 over two hosts: stages 0 and 1 share one, stage 2 is on the other (it keeps the process group)
    found = run_ranks(neighbours_on_hosts, 3, tmp_path, ["a", "a", "b"], deadline_s=120)
    assert [f[:2] for f in found] == [(False, True), (True, False), (False, False)]
    # Note [who may connect]: stage 0's link will accept stage 1's process only; no link, no pid
    assert [f[2] for f in found] == [found[1][3], None, None]


def test_auto_transport_is_shared_memory_only_on_linux_on_the_blocking_path() -> None:
    """Note [the fastest transport by default]: "auto" picks the link where it can run, the group elsewhere."""
    from fdg_schedule.exchange.process_group import Path
    from fdg_schedule.exchange.transports import resolve_transport

    assert resolve_transport("auto", Path.BLOCKING, "linux") == "shm"
    assert resolve_transport("auto", Path.STAGED, "linux") == "process_group"  # a GPU stage with gloo
    assert resolve_transport("auto", Path.STREAM, "linux") == "process_group"  # NCCL
    assert resolve_transport("auto", Path.BLOCKING, "darwin") == "process_group"
    for named in ("shm", "process_group"):  # a named transport is kept (an impossible one is refused elsewhere)
        assert resolve_transport(named, Path.BLOCKING, "linux") == named
        assert resolve_transport(named, Path.STREAM, "darwin") == named
