"""The neighbour exchange on its own: tuple activations of mixed dtypes, gradients and the loss (2 ranks)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.distributed


def exchange(rank: int, world: int) -> dict:
    from fdg_schedule.comm import NeighbourExchange

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
    from fdg_schedule import grid
    from fdg_schedule.comm import NeighbourExchange
    from fdg_schedule.errors import FDGRuntimeError
    from fdg_schedule.schedule import FDGTrainSchedule

    schedule = FDGTrainSchedule(4, 2, 1)  # stage 1 of K = 2, at tick 1
    comm = NeighbourExchange(None, None, torch.device("cpu"), False, stage_id=1, timeout_s=5,
                             plan=lambda: grid.around(schedule, 1))  # fmt: skip
    with pytest.raises(FDGRuntimeError, match="no activation receive was posted") as failed:
        comm.wait_activation()
    assert "> A0 L1 F0 B0 R S X[sg,ra] T+ <" in str(failed.value)  # stage 1's cell at tick 1, marked
