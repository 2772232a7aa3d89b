"""StageState on its own: what it captures restores, in a new stage, to the same delayed backward passes bit for bit."""

from __future__ import annotations

import copy
import functools
import io
from typing import Any

import pytest
import torch
from torch import nn

from fdg_schedule.base.config import FDGConfig
from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.checkpointing import checkpoint
from fdg_schedule.corrections.delayed import DelayedBackward, Held
from fdg_schedule.exchange.comm import NeighbourExchange, meta_of
from fdg_schedule.runtime.stage_state import InFlight, StageState


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.3), nn.Tanh(), nn.Linear(5, 3))


def _state(module: nn.Module, config: FDGConfig) -> tuple[StageState, DelayedBackward]:
    exchange = NeighbourExchange(None, None, torch.device("cpu"), False, stage_id=0, timeout_s=5)
    return StageState(2, exchange), DelayedBackward(module, config, delayed=True)


def _forward(state: StageState, delayed: DelayedBackward, buffer_id: int, inputs: torch.Tensor) -> InFlight:
    """What the engine's FDGLoad / WaitActivation and FDGForward leave in the record of ``buffer_id``."""
    state.enter(buffer_id, inputs)
    record = state.records[buffer_id]
    with delayed.forwarding() as forward:
        forward.outputs = delayed.module(inputs)
    record.outputs, record.held = forward.outputs, forward.held
    return record


def _rebuilt(delayed: DelayedBackward, held: Held, inputs: torch.Tensor) -> Any:
    """What the engine's checkpoint half gives ``StageState.restore``: a stored forward rebuilt (None: recomputed)."""
    outputs = None
    with delayed.rebuilding(held) as rerun:
        if rerun:
            outputs = delayed.module(inputs)
    return outputs


def _backward(state: StageState, delayed: DelayedBackward, module: nn.Module, buffer_id: int) -> list[torch.Tensor]:
    record = state.records.pop(buffer_id)
    inputs, held = record.inputs, record.held
    assert held is not None
    g = torch.full((2, 3), 0.5)
    with delayed.backward(held) as rerun:
        torch.autograd.backward(module(inputs) if rerun else record.outputs, g)
    grads = [p.grad.clone() for p in module.parameters()] + [inputs.grad.clone()]
    module.zero_grad()
    return grads


@pytest.mark.parametrize(
    "weights,activations", [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]
)
def test_capture_and_restore_round_trip(one_rank_group: None, weights: str, activations: str) -> None:
    config = FDGConfig(weights=weights, activations=activations)
    module = _stage()
    state, delayed = _state(module, config)
    for buffer_id in (0, 1):  # two micro-batches in flight
        record = _forward(state, delayed, buffer_id, torch.randn(2, 4, requires_grad=True))
        record.sent_meta = meta_of([record.outputs])
    state.segment_tick, state.micro_batches_read = 2, 2
    state.segment_limit = 1  # stage 0 learned at tick 1 that the data ended (Note [end of data])
    state.labels_in_flight.append(torch.tensor([1, 2]))
    file = io.BytesIO()
    torch.save(state.capture(), file)  # as a checkpoint writes it
    rng = torch.get_rng_state()
    torch.rand(3)  # the process goes on after the save

    other = copy.deepcopy(module)  # a new process: the same weights, loaded by DeepSpeed
    restored, other_delayed = _state(other, config)
    file.seek(0)
    restored.restore(torch.load(file, weights_only=False), functools.partial(_rebuilt, other_delayed), needs_grad=True)

    assert torch.equal(torch.get_rng_state(), rng)
    assert (restored.segment_tick, restored.micro_batches_read, restored.segment_limit) == (2, 2, 1)
    assert [t.tolist() for t in restored.labels_in_flight] == [[1, 2]]
    assert sorted(restored.records) == sorted(state.records) == [0, 1]
    assert all(restored.records[b].sent_meta == state.records[b].sent_meta is not None for b in (0, 1))
    assert restored.in_flight() == state.in_flight() == 2
    assert restored.held_bytes() == state.held_bytes() > 0
    for m in (module, other):  # an optimizer step on both, between the save and the delayed backward
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.9)
    for buffer_id in (0, 1):
        for a, b in zip(
            _backward(state, delayed, module, buffer_id), _backward(restored, other_delayed, other, buffer_id)
        ):
            assert torch.equal(a, b)


def test_the_segment_ends_after_its_last_tick(one_rank_group: None) -> None:
    state, _ = _state(_stage(), FDGConfig())
    state.segment_tick = 5
    assert not state.segment_over()  # the data has not ended
    state.segment_limit = 4  # K = 2: stage 0 back-propagates micro-batch 3 at tick 5
    assert state.ticks_left() == 1 and not state.segment_over()
    state.segment_tick = 6
    state.labels_in_flight.append(torch.tensor([0]))
    assert state.segment_over()
    assert (state.segment_tick, state.segment_limit, len(state.labels_in_flight)) == (0, None, 0)


def test_reset_forgets_the_work_in_flight(one_rank_group: None) -> None:
    state, delayed = _state(_stage(), FDGConfig(weights="stashed"))
    _forward(state, delayed, 1, torch.randn(2, 4))
    state.segment_tick = 3
    assert state.in_flight() == 1
    state.reset()
    assert state.in_flight() == 0 and state.segment_tick == 0 and state.records == {}


def test_a_micro_batch_entering_a_buffer_still_in_use_is_refused(one_rank_group: None) -> None:
    state, delayed = _state(_stage(), FDGConfig())
    _forward(state, delayed, 2, torch.randn(2, 4))
    with pytest.raises(FDGRuntimeError, match="buffer 2 still holds a micro-batch in flight"):
        state.enter(2, torch.randn(2, 4))  # the schedule's buffer count would be wrong
    state.records.pop(2)  # its backward (and, off stage 0, its gradient's send) ended it
    state.enter(2, torch.randn(2, 4))


def test_a_checkpoint_keeps_host_tensors_on_the_host_and_the_work_in_flight_goes_to_the_device(
    one_rank_group: None, tmp_path
) -> None:
    """Note [host tensors stay on the host] (checkpoint.py): what a stage keeps in host memory -- the control word
    of an activation received for the next tick, a tied optimizer's step counter, the RNG state -- loads there
    (read_host refuses a device tensor; a step on the GPU costs a host sync per step); the in-flight inputs and
    held tensors go to the stage's device (here the meta device stands in for a GPU), also from a host save."""
    config = FDGConfig(weights="stashed")
    state, delayed = _state(_stage(), config)
    _forward(state, delayed, 0, torch.randn(2, 4)).sent_meta = [(torch.Size([2, 3]), torch.float32)]
    captured = state.capture()
    meta = [(torch.Size([2]), torch.float32)]  # an activation that arrived for the next tick, with its control word
    captured["received"] = {"activation": [torch.ones(2), torch.tensor([-1])], "grad": None, "sent_meta": None,
                            "recv_meta": meta}  # fmt: skip
    captured["tied"] = [{"optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}}]
    expected = checkpoint.identity(2, 1, config)
    checkpoint.save(checkpoint.state_path(str(tmp_path), "t", 0, 0), expected, captured)
    device = torch.device("meta")
    loaded = checkpoint.load(str(tmp_path), "t", 0, 0, expected, log=True, device=device)
    assert loaded is not None
    step = loaded["tied"][0]["optimizer"]["state"][0]["step"]
    assert step.device.type == "cpu" and step.item() == 3.0
    assert loaded["received"]["activation"][1].device.type == "cpu"
    loaded["tied"] = None
    restored, _ = _state(_stage(), config)
    restored.restore(loaded, lambda held, inputs: None, needs_grad=False, device=device)
    record = restored.records[0]
    held = record.held
    assert held is not None and held.weights is not None and held.saved is not None
    assert {t.device.type for t in (record.inputs, *held.weights, *held.saved)} == {"meta"}
    assert held.rng_state[0].device.type == "cpu"
    received, end = restored.exchange.wait_activation()
    assert end == -1 and torch.equal(received[0], torch.ones(2))


def test_a_resumed_tick_count_reads_another_stages_file_into_host_memory(tmp_path, monkeypatch) -> None:
    """checkpoint.carried reads stage 0's file when this stage has none: on the host, whatever device stage 0 had."""
    config = FDGConfig()
    checkpoint.save(checkpoint.state_path(str(tmp_path), "t", 0, 0), checkpoint.identity(3, 1, config), {"tick": 7})
    load, seen = torch.load, []
    monkeypatch.setattr(
        checkpoint.torch, "load", lambda *a, **kw: seen.append(kw.get("map_location")) or load(*a, **kw)
    )
    assert checkpoint.carried(str(tmp_path), "t", 2, 3) == (7, None)
    assert seen == ["cpu"]


def test_the_placement_puts_storages_saved_on_any_device_on_this_stages_device() -> None:
    class Storage:  # the storage torch.load hands the placement (CUDA cannot run here)
        def to(self, device: torch.device) -> tuple[str, torch.device]:
            return ("moved", device)

    place, storage = checkpoint.placement(torch.device("cuda", 1)), Storage()
    assert place(storage, "cuda:3") == ("moved", torch.device("cuda", 1))  # saved on another rank's GPU
    assert place(storage, "cpu") is storage
