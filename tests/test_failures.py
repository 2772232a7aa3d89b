"""Failures never hang: a rank that dies, raises or stops sending, and non-finite values (real ranks)."""

from __future__ import annotations

from typing import Any

import engine_workers
import pytest
import torch
import toy
from deepspeed.runtime.lr_schedules import WarmupLR
from dist_harness import run_ranks, run_ranks_calls

from fdg_schedule import FDGConfig, fdg_reference
from fdg_schedule.sched import ticks

pytestmark = pytest.mark.distributed
# The neighbours' messages through the process group (gloo), then through shared memory (a link whose socket
# closes when its process ends: Note [shared-memory transport])
TRANSPORTS = pytest.mark.parametrize("transport", ["process_group", "shm"])


@TRANSPORTS
def test_a_rank_killed_mid_run_makes_the_other_exit_with_an_error(tmp_path, transport: str) -> None:
    case = {"trigger": 5, "how": "die", "timeout": 20, "transport": transport}
    stage0, _ = run_ranks(engine_workers.failure, 2, tmp_path, case, deadline_s=120, expect_exit={1: 3})
    # Whether the death shows first on the gradient receive or on a send depends on timing.
    assert (
        stage0["error"].startswith("stage 0 (global rank 0): gave up") and "stage 1 (global rank 1)" in stage0["error"]
    )
    assert stage0["seconds"] < 20 + 10


@TRANSPORTS
def test_a_rank_that_stops_sending_is_reported_within_the_timeout(tmp_path, transport: str) -> None:
    # Stage 1 sleeps longer than the timeout plus the bound below: stage 0 passes only by giving up while it sleeps.
    case = {"trigger": 5, "how": "hang", "timeout": 4, "hang_s": 4 + 10 + 2, "transport": transport}
    stage0, stage1 = run_ranks(engine_workers.failure, 2, tmp_path, case, deadline_s=120)
    assert (
        stage0["error"].startswith("stage 0 (global rank 0): gave up") and "stage 1 (global rank 1)" in stage0["error"]
    )
    assert "(timeout 4 s)" in stage0["error"]
    assert 4 <= stage0["seconds"] < 4 + 10
    assert "stage 1 (global rank 1): gave up" in stage1["error"]  # and stage 1 does not hang either


@TRANSPORTS
def test_a_rank_that_raises_brings_the_other_down(tmp_path, transport: str) -> None:
    case = {"trigger": 5, "how": "raise", "timeout": 10, "transport": transport}
    stage0, stage1 = run_ranks(engine_workers.failure, 2, tmp_path, case, deadline_s=120)
    assert "boom in a layer of stage 1" in stage1["error"]
    assert "stage 1 (global rank 1)" in stage0["error"] and stage0["seconds"] < 10 + 10


def test_non_finite_loss_stops_with_the_stage_and_tick(tmp_path) -> None:
    case = {"trigger": 5, "how": "inf", "timeout": 10}
    stage0, stage1 = run_ranks(engine_workers.failure, 2, tmp_path, case, deadline_s=120)
    assert "stage 1 (global rank 1): non-finite loss of micro-batch 4" in stage1["error"]
    assert "at tick 5" in stage1["error"] and 'pipeline.fdg.nonfinite="skip"' in stage1["error"]
    assert stage0["error"] is not None  # its neighbour stopped: it does not hang


DATA_END = [(2, 10, 1), (3, 7, 1), (1, 7, 2), (2, 7, 2), (3, 7, 2), (3, 8, 3)]  # (stages, limit, accumulate)


def _data_end_case(stages: int, limit: int, accumulate: int) -> dict:
    return {"stages": stages, "n": 16, "gas": 3, "limit": limit, "grad_shrink": 0.5, "weights": "stashed",
            "accumulate": accumulate, "lr": 0.1, "warmup": 4}  # fmt: skip


SKIPPED = {"trigger": 5, "how": "inf", "nonfinite": "skip", "calls": 6}  # stage 1's losses inf from micro-batch 4


@pytest.fixture(scope="module")
def ended_cleanly(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, list]:
    """The runs that end without an error on every rank (Note [one launch, several calls] in dist_harness.py),
    one launch per number of stages: every DATA_END case, keyed (stages, limit, accumulate), and with K = 2
    the SKIPPED failure case, keyed "skipped"; each with the results in rank order."""
    out: dict[Any, list] = {}
    for stages in sorted({k for k, _, _ in DATA_END}):
        params: list[Any] = [p for p in DATA_END if p[0] == stages]
        calls = [(engine_workers.data_end, (_data_end_case(*p),)) for p in params]
        if stages == 2:
            params.append("skipped")
            calls.append((engine_workers.failure, (SKIPPED,)))
        tmp = tmp_path_factory.mktemp(f"ended_k{stages}")
        out.update(zip(params, run_ranks_calls(stages, tmp, calls, deadline_s=240)))
    return out


def test_non_finite_steps_are_skipped_and_counted(ended_cleanly) -> None:
    stage0, stage1 = ended_cleanly["skipped"]
    for r in (stage0, stage1):
        assert r["error"] is None and r["finite"]
        assert r["skipped"] > 0 and r["skipped_steps"] == r["skipped"]  # DeepSpeed's counter too
    assert stage1["steps"] == 4  # micro-batches 0..3 stepped, 4.. non-finite


@pytest.mark.parametrize("stages,limit,accumulate", DATA_END)
def test_data_running_out_drains_and_ends_every_rank(ended_cleanly, stages: int, limit: int, accumulate: int) -> None:
    """The iterator ends mid-call: every rank drains, raises DataExhausted, and the weights are
    the reference's after ``limit`` micro-batches and a drain. K = 1 with a partial accumulation at
    the end and a warm-up: its last step uses the reference's learning rate."""
    case = _data_end_case(stages, limit, accumulate)
    results = ended_cleanly[(stages, limit, accumulate)]
    for r in results:
        # every rank raises in the call holding the tick stage 0 back-propagates the last micro-batch
        assert r["in_flight"] == 0 and r["calls"] == (limit - 1 + ticks.drain_ticks(stages)) // 3
        # the same on every stage; K = 1 learns the end one tick after its last micro-batch
        assert r["global_steps"] == limit + ticks.drain_ticks(stages) + (stages == 1)
        assert r["global_samples"] == limit * 4
    stages_ref = toy.reference_stages(results[0]["parts"])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages_ref]
    scheds = [WarmupLR(o, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4) for o in opts]
    data = toy.micro_batches(case["n"], 4)[:limit]
    config = FDGConfig(grad_shrink=0.5, weights="stashed", accumulate=accumulate)
    fdg_reference(stages_ref, opts, data, toy.loss_fn, config, drain=True, schedulers=scheds)
    engine_state = {k: v for r in results for k, v in r["state"].items()}
    for s in stages_ref:
        for key, value in s.state_dict().items():
            torch.testing.assert_close(engine_state[key], value, rtol=1e-6, atol=1e-6)


def test_a_non_finite_loss_on_one_replica_ends_every_rank_naming_it(tmp_path) -> None:
    """K=2 x 2 replicas; global rank 3 (stage 1 of replica 1) meets an inf loss (Note [replicas end together])."""
    case = {"trigger": 3, "how": "inf", "ranks": [3], "timeout": 5, "calls": 8}
    results = run_ranks(engine_workers.failure, 4, tmp_path, case, deadline_s=150)
    assert "stage 1 (global rank 3, data-parallel replica 1): non-finite loss" in results[3]["error"]
    # its peer in stage 1 (which the all-reduce gave a non-finite gradient) is told where it came from
    told = "data-parallel replica 1 of stage 1 (global rank 3) stopped in the same call: non-finite loss"
    assert results[2]["error"].startswith("stage 1 (global rank 2, data-parallel replica 0)")
    assert told in results[2]["error"]
    for r in results:
        assert r["error"] is not None and r["seconds"] < 5 + 10, r


def test_uneven_data_across_replicas_ends_every_rank(tmp_path) -> None:
    """Replica 0 reads 10 micro-batches, replica 1 40: no rank trains on, none hangs past the timeout."""
    case = {"trigger": 10**6, "how": "none", "timeout": 5, "calls": 30, "lengths": {0: 10, 1: 40}}
    results = run_ranks(engine_workers.failure, 4, tmp_path, case, deadline_s=150)
    for r in results:
        assert r["error"] is not None and not r["error"].startswith("DataExhausted"), r
        assert "data-parallel" in r["error"] and r["seconds"] < 5 + 15, r
    # stage 0's replicas meet at the end of the call in which replica 0's data ended
    uneven = "read data of different lengths (replica 0: after 10 micro-batches, replica 1: not ended)"
    for stage0 in results[:2]:
        assert uneven in stage0["error"]


def test_only_a_data_parallel_group_waited_on_the_host_gets_the_fdg_timeout(one_rank_group, monkeypatch) -> None:
    """Note [replicas end together]: under NCCL torch's watchdog would end the process at the group's timeout,
    counted from when the all-reduce was queued, before the end-of-call check names the replica; the group keeps
    its own. gloo waits on the host: pipeline.fdg.timeout bounds it and the error names the group."""
    import torch.distributed as dist

    from fdg_schedule.checkpointing.replicas import Replicas

    class Grid:  # stage 1's replicas, global ranks 2 and 3 of K = 2 x DP 2
        dp_group, dp_groups, data_parallel_id, global_rank = [2, 3], [[0, 1], [2, 3]], 0, 2

        def get_data_parallel_group(self) -> str:
            return "data-parallel group"

    bounded = []
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: "gloo group")
    monkeypatch.setattr(dist, "set_timeout", lambda timeout, group: bounded.append((group, timeout.total_seconds())))
    for backend, device in [("gloo", "cpu"), ("gloo", "cuda"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda")]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        bounded.clear()
        Replicas(Grid(), 1, 45.0, "stage 1 (global rank 2)", torch.device(device))
        stream = backend != "gloo"
        assert bounded == ([] if stream else [("data-parallel group", 45.0)]), (backend, device)
