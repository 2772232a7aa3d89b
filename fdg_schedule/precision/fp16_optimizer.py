"""DeepSpeed's fp16 optimizers under FDG's loss scale: they step at the scale FDG sets and never change it themselves.

DeepSpeed wraps the optimizer of an fp16 job in ``FP16_Optimizer`` (FusedAdam), ``FP16_UnfusedOptimizer``
(any other) or, under ZeRO-1, ``DeepSpeedZeroOptimizer``: fp16 weights, fp32 master copies, the overflow
check, unscaling and clipping in the step. FDG keeps all of that and takes the scale away from them
(Note [loss scale per stage] in :mod:`fdg_schedule.precision.loss_scale`): each wrapper is made static and, before
every step, gets the scale that step's gradients were made with. Their cross-stage reductions are made
stage-local by :func:`fdg_schedule.base.optim.decouple_from_other_stages`.

Note [who scales the loss]: FDG multiplies the last stage's loss by the scale itself, in fp32, for every
wrapper. DeepSpeed 0.19.8's ``engine.backward`` applies ``FP16_Optimizer``'s scale only under ZeRO (its
non-ZeRO fp16 step then divides unscaled gradients by the scale, deepspeedai/DeepSpeed#8393), and under
ZeRO it multiplies the loss in the loss's own dtype, fp16, where 2.0 * 2**16 is already inf; so here the
ZeRO wrapper's scaler scales nothing (:class:`_UnscaledLoss`) and only its step divides by the scale.

Note [the scale in DeepSpeed's files]: 1F1B keeps one scaler state, equal on every stage. FDG writes into
DeepSpeed's optimizer file the scale of the stage's last step (equal on every stage after a drain) with
DeepSpeed's dynamic setting and a fresh window and hysteresis; its own per-stage state goes into FDG's file.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from fdg_schedule.precision.loss_scale import ScaleConfig


class _UnscaledLoss(LossScaler):
    """The ZeRO wrapper's scaler under FDG: its ``cur_scale`` is what the step divides by; it scales no loss
    (Note [who scales the loss])."""

    def scale_loss(self, loss: Any) -> Any:
        return loss


def is_zero(optimizer: Any) -> bool:
    return isinstance(optimizer, DeepSpeedZeroOptimizer)


def take_over(optimizer: Any, scale: float) -> None:
    """From now on the wrapper steps at the scales FDG sets (:func:`set_scale`) and never changes them."""
    if is_zero(optimizer):
        optimizer.loss_scaler = _UnscaledLoss(scale)
        optimizer.dynamic_loss_scale = False
    else:
        optimizer.loss_scale_config.dynamic_loss_scale = False
        optimizer.loss_scale_config.cur_scale = scale


def set_scale(optimizer: Any, scale: float) -> None:
    """The scale the wrapper's next step divides the gradients by."""
    if is_zero(optimizer):
        optimizer.loss_scaler.cur_scale = scale
    else:
        optimizer.loss_scale_config.cur_scale = scale


@contextlib.contextmanager
def overflow_found(optimizer: Any) -> Iterator[None]:
    """Inside, the wrapper's overflow check finds an overflow (on every data-parallel replica alike: the caller
    decides from a flag the replicas share), so its step takes DeepSpeed's own skip path (gradients dropped, the
    step counted as skipped)."""
    if is_zero(optimizer):
        target, name = optimizer, "has_overflow"
    elif isinstance(optimizer, FP16_UnfusedOptimizer):
        target, name = optimizer.overflow_checker, "check"
    else:  # FP16_Optimizer
        target, name = optimizer.overflow_checker, "has_overflow"
    setattr(target, name, lambda *args, **kwargs: True)
    try:
        yield
    finally:
        delattr(target, name)


def unscale_norm(optimizer: Any, scale: float) -> None:
    """After a step at ``scale``: the unfused optimizer's ``_global_grad_norm`` is of the scaled gradients (its fused
    and ZeRO siblings divide by the scale); divide it, so ``get_global_grad_norm()`` is the gradient's norm."""
    if isinstance(optimizer, FP16_UnfusedOptimizer) and math.isfinite(optimizer._global_grad_norm):
        optimizer._global_grad_norm = optimizer._global_grad_norm / scale


def loaded_state(optimizer: Any) -> dict[str, Any]:
    """What DeepSpeed's load put into the wrapper's scaler (a 1F1B or an FDG file), in
    :class:`~fdg_schedule.precision.loss_scale.LossScale`'s field names (absent counters are left out)."""
    if is_zero(optimizer):
        scaler = optimizer.loss_scaler
        names = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        return {name: getattr(scaler, name) for name in names if hasattr(scaler, name)}
    config = optimizer.loss_scale_config
    state = {"cur_scale": config.cur_scale, "cur_iter": config.cur_iter}
    if config.dynamic_loss_scale:
        state["last_overflow_iter"] = config.last_overflow_iter
    return state


@contextlib.contextmanager
def deepspeed_view(optimizer: Any, config: ScaleConfig, scale: float) -> Iterator[None]:
    """Note [the scale in DeepSpeed's files]: while DeepSpeed saves, the wrapper holds DeepSpeed's own scaler
    state at ``scale`` (window and hysteresis fresh); FDG's control comes back afterwards."""
    if is_zero(optimizer):
        fdg_scaler = optimizer.loss_scaler
        if config.dynamic:
            optimizer.loss_scaler = DynamicLossScaler(
                init_scale=scale, scale_window=config.loss_scale_window, min_scale=config.min_loss_scale,
                delayed_shift=config.hysteresis, consecutive_hysteresis=config.consecutive_hysteresis,
            )  # fmt: skip
        else:
            optimizer.loss_scaler = LossScaler(scale)
        optimizer.dynamic_loss_scale = config.dynamic
        try:
            yield
        finally:
            optimizer.loss_scaler, optimizer.dynamic_loss_scale = fdg_scaler, False
        return
    held = optimizer.loss_scale_config
    kept = (held.dynamic_loss_scale, held.cur_scale, held.cur_iter, held.last_overflow_iter)
    held.dynamic_loss_scale, held.cur_scale, held.cur_iter = config.dynamic, scale, 0
    held.last_overflow_iter = -1 if config.dynamic else held.last_overflow_iter
    try:
        yield
    finally:
        held.dynamic_loss_scale, held.cur_scale, held.cur_iter, held.last_overflow_iter = kept
