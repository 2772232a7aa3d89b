"""A micro-batch from the data iterator, copied to the stage's device without a host sync.

DeepSpeed's ``PipelineEngine._exec_load_micro_batch`` (0.19.8) copies the first stage's inputs and
the last stage's labels with ``.to(device)``: from host memory that copy waits for every kernel
queued before it, once per tick on the first and on the last stage (Note [no host sync in a tick]
in :mod:`fdg_schedule.base.guards`). This is the same load with ``non_blocking=True``: from pinned host
memory (a ``DataLoader(pin_memory=True)``) the copy is asynchronous, and from pageable memory torch
adds no synchronisation of its own (the driver stages the bytes). Everything else is DeepSpeed's:
which stage reads what, the inputs' clone, ``requires_grad`` under reentrant activation
checkpointing, the batch-input timer.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.pipe.engine import BATCH_INPUT_TIMER

from fdg_schedule.base.tensors import to_device


def load_micro_batch(engine: Any) -> tuple[Any, Any]:
    """``engine._exec_load_micro_batch`` with every copy to the device ``non_blocking``: the first stage's inputs
    and the last stage's labels (None where the stage reads none), returned rather than put in a pipe buffer."""
    timed = engine.wall_clock_breakdown()
    if timed:
        engine.timers(BATCH_INPUT_TIMER).start()
    batch = engine._next_batch()
    inputs: Any = None
    labels: Any = None
    if engine.is_first_stage():
        grad = engine._reentrant_activation_checkpointing()
        if torch.is_tensor(batch[0]):
            inputs = _input(batch[0], engine.device, grad)
        else:
            assert isinstance(batch[0], (tuple, list))
            inputs = tuple(_input(x, engine.device, grad) for x in batch[0])
    if engine.is_last_stage():
        labels = to_device(batch[1], engine.device)
    if timed:
        engine.timers(BATCH_INPUT_TIMER).stop()
    return inputs, labels


def _input(x: Any, device: torch.device, requires_grad: bool) -> torch.Tensor:
    """A tensor of the stage's own, as DeepSpeed's clone makes it: a copy to the device is one (and a host
    clone first would drop the pinning that makes that copy asynchronous)."""
    assert torch.is_tensor(x)
    loaded = x.detach().clone() if x.device == device else x.to(device, non_blocking=True).detach()
    if requires_grad:
        loaded.requires_grad = loaded.is_floating_point()
    return loaded
