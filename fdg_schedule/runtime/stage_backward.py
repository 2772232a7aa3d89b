"""One stage's backward pass inside DeepSpeed: autograd from the stage outputs, DeepSpeed's bf16 and timer glue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.tensors import describe
from fdg_schedule.observability.report import stop_backward_timers


def stage_backward(engine: Any, outputs: list[Tensor], grads: tuple[Tensor, ...], where: Callable[[], str]) -> None:
    """The stage's delayed backward: ``outputs`` against the gradients the next stage sent, through DeepSpeed's
    bf16 gradient buffers and backward timers as its pipeline backward does; a clear error for an output the
    gradient cannot flow through (``where()`` names the stage; called only then). Then the gradients' message goes
    back to its link where it was lent."""
    if len(outputs) != len(grads):
        raise FDGRuntimeError(f"{where()}: {len(outputs)} floating output tensors but {len(grads)} gradients")
    no_grad = [i for i, t in enumerate(outputs) if not t.requires_grad]
    if no_grad:
        i = no_grad[0]
        raise FDGRuntimeError(
            f"{where()}: floating output {i} of the stage ({describe(outputs[i])}) does not require grad, "
            "so the gradient the next stage sends back cannot flow through it (no trainable parameter of the "
            "stage, and no input that requires grad, leads to it: frozen or parameter-free layers); put a layer "
            "with trainable parameters on this stage (e.g. PipelineModule(partition_method='parameters')), or "
            "pass the tensor on as an integer tensor"
        )
    bf16 = isinstance(engine.optimizer, BF16_Optimizer)
    if bf16:  # as DeepSpeed's pipeline backward: we do not go through optimizer.backward()
        engine.optimizer.clear_lp_grads()
    engine._running_engine_backward = True
    try:
        torch.autograd.backward(outputs, grads)
    finally:
        engine._running_engine_backward = False
        stop_backward_timers(engine)
    engine._exchange.release_grad()  # Note [a lent message] (fdg_schedule.exchange.shm_link): the gradients were read
    if bf16 and not engine._config.bfloat16_config.immediate_grad_update:
        engine.optimizer.update_hp_grads(clear_lp_grads=False)
