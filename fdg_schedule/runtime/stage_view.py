"""The read-only view an FDG engine hands its observers, built per call from the engine and its ``StageState``.

Note [observers see a view] in :mod:`fdg_schedule.observability.view`: this is the one place that reads the
stage for them. Building one copies a few numbers (the counters' dict, a sum over the held micro-batches); the
engine builds none when it has no observer.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor

from fdg_schedule.observability.view import StageIds, StageView


def instruction_ran(engine: Any, cmd: Any, start: float, end: float) -> None:
    """Tell ``engine``'s observers, each with a view built now; build none when it has no observer."""
    if engine.observers:
        current = view(engine)
        for observer in engine.observers:
            observer.on_instruction(current, cmd, start, end)


def call_ended(engine: Any, seconds: float) -> None:
    """Tell ``engine``'s observers that a ``train_batch()`` / ``drain()`` call ended, with a view built now."""
    if engine.observers:
        current = view(engine)
        for observer in engine.observers:
            observer.on_call_end(current, seconds)


def view(engine: Any) -> StageView:
    """What ``engine`` (an ``FDGPipelineEngine``) shows its observers now."""
    state, config = engine.fdg_state, engine.fdg_config
    stats = engine.fdg_stats
    losses = state.call_losses
    params, scaling = engine._params, state.scaling
    return StageView(
        ids=StageIds.of(engine),
        config=config,
        micro_batch_size=engine.train_micro_batch_size_per_gpu(),
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
        stats=types.MappingProxyType(dict(stats)),
        loss=getattr(engine, "agg_train_loss", None),
        last_loss=losses[-1] if losses else None,
        loss_scale=stats.get("loss_scale"),
        lr=engine.get_lr()[0],
        lr_factor=state.corrections.lr_factor(state.tick - 1) if config.delay_lr_ticks else None,
        held_bytes=state.held_bytes(),
        in_flight=state.in_flight(),
        optimizer_grad_norm=getattr(engine.optimizer, "_global_grad_norm", None),
        grad_norm=lambda: scaling.unscaled(grad_norm(params)),  # fp16: the gradients carry the loss scale
    )


def grad_norm(params: Any) -> Tensor | None:
    """The 2-norm of the gradients ``params`` hold (on the device, no host read); None where none holds one."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
