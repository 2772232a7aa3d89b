"""fdg_schedule.tools.launch: K local gloo ranks from Python, results in rank order, failures that reach the caller."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

import pytest
from launch_workers import fails_on_rank_1, hangs, sum_of_ranks

from fdg_schedule.tools.launch import RankFailed, free_port, run

pytestmark = pytest.mark.distributed


def test_results_come_back_in_rank_order_without_importing_the_package(tmp_path) -> None:
    results = run(sum_of_ranks, 3, 2.0, deadline_s=120, workdir=tmp_path, timeout_s=300)
    assert [r["rank"] for r in results] == [0, 1, 2]
    # Note [the launcher's process group]: the rendezvous' 120 s is not every operation's timeout
    assert all(r["op_timeout_s"] == 300 and r["bound_device"] is None for r in results)
    assert all(r["world"] == 3 and r["total"].item() == 6.0 for r in results)
    # Note [a rank's own processes]: not the spawn / forkserver method the rank itself was started with
    assert {r["start_method"] for r in results} == {multiprocessing.get_all_start_methods()[0]}
    assert all(r["loaded"] == 28.0 for r in results)
    # Note [preloaded ranks]: a forked rank freezes what it inherited, so full collections skip torch and DeepSpeed
    if os.environ.get("FDG_LAUNCH_PRELOAD"):  # conftest.py sets it
        assert all(r["frozen"] > 10_000 for r in results), [r["frozen"] for r in results]
    # Note [a rank does not import the package]: a worker that does not import it gets stock DeepSpeed.
    # Importing DeepSpeed loads only the start-up hook's guard (fdg_schedule.runtime.install), never the engine.
    assert not any("fdg_schedule.runtime.engine" in r["fdg_schedule_modules"] for r in results)


def test_a_rank_that_raises_fails_the_run_with_its_traceback(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 raised:(.|\n)*ValueError: boom on rank 1"):
        run(fails_on_rank_1, 2, deadline_s=120, workdir=tmp_path)
    assert time.monotonic() - start < 60  # rank 0 was not waited for


def test_a_rank_that_misses_the_deadline_is_named(tmp_path) -> None:
    with pytest.raises(RankFailed, match=r"ranks \[0\] did not finish within 10 s"):
        run(hangs, 1, deadline_s=10, workdir=tmp_path)


def test_only_an_nccl_rank_binds_its_device() -> None:
    """Note [the launcher's process group]: gloo ranks sharing one GPU must not bind it (torch would then split
    every new group, which gloo cannot); an NCCL rank binds its own GPU (its communicator made at once)."""
    import torch

    from fdg_schedule.tools.launch import bound_device

    assert bound_device("gloo", 0) == {}
    assert bound_device("nccl", 3) == {"device_id": torch.device("cuda", 3)}


def test_free_port_can_be_bound() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
