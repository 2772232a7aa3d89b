"""The optimizer side of a stage under FDG: each stage steps alone, with stage-local norms and clipping.

DeepSpeed's optimizer wrappers reduce gradient norms, clipping and overflow checks over the
model-parallel group, which for a pipeline spans every stage: one collective across stages per step.
Under FDG no stage waits for another's step, so those reductions are made stage-local here. (A
per-step change to the update, such as a learning-rate factor, belongs next to these.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from torch import nn


def decouple_from_other_stages(optimizer: Any) -> None:
    """Make a DeepSpeed optimizer wrapper's norms and overflow checks stage-local (no cross-stage all-reduce)."""
    if isinstance(optimizer, BF16_Optimizer):
        optimizer.mpu = None
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.model_parallel_group = None
        optimizer.model_parallel_rank = 0


def clip_stage_local(parameters: Iterable[nn.Parameter], clip: float) -> torch.Tensor:
    """Clip the gradients to norm ``clip`` (0: no clipping) by this stage's own norm; returns the norm.

    For plain torch optimizers: DeepSpeed's ``clip_fp32_gradients`` would all-reduce the norm across stages.
    The norm stays on the device (Note [no host sync in a tick] in :mod:`fdg_schedule.guards`).
    """
    params = list(parameters)
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm
