"""The optimizer side of a stage under FDG: each stage steps alone, with stage-local norms and clipping.

DeepSpeed's optimizer wrappers reduce gradient norms, clipping and overflow checks over the
model-parallel group, which for a pipeline spans every stage: one collective across stages per step.
Under FDG no stage waits for another's step, so those reductions are made stage-local here. (A
per-step change to the update, such as a learning-rate factor, belongs next to these.)

Note [gradient reduce with one data-parallel rank]: FDG steps every tick, so DeepSpeed's gradient
all-reduce (``ReduceGrads``) runs every tick where 1F1B runs it once per batch. With one
data-parallel rank it changes nothing yet costs a flatten of every gradient, a one-rank collective
and a copy back (≈ 1-2 % of a ResNet-32 stage's tick on CPU, more for wide layers). Its only effect
on the numbers is that a trainable parameter without a gradient gets a zero one (which a momentum
optimizer then steps). :func:`reduce_is_identity` says when that is all it does -- plain (non-ZeRO,
non-bf16-wrapper) optimizers, dense gradients, no MoE, no gradient pre-division, communication in the
gradients' own dtype -- and :func:`fill_missing_grads` then does just that. Anything else runs
DeepSpeed's reduce unchanged.
Note [a partial accumulation in a checkpoint]: with ``accumulate`` > 1 a stage is usually part-way
through an accumulation between ``train_batch()`` calls. The gradients summed so far live in the
parameters' ``.grad`` (fp32 and ZeRO-1; ZeRO's ``grad_accum`` when it accumulates in another dtype)
and, under bf16, in the wrapper's fp32 gradient buffers. :func:`capture_accumulated` copies all of
them for the checkpoint and :func:`restore_accumulated` puts them back, so the resumed stage steps
on exactly the backward passes the uninterrupted one does.

Note [FusedAdam's step on the CPU]: DeepSpeed builds ``FusedAdam`` for an ``"Adam"`` / ``"AdamW"``
config (and for Muon's Adam half). Its CPU kernel keeps beta1**t and beta2**t in one object per
process and mode, shared by every FusedAdam instance: a call at step t multiplies the kept powers by
beta once when the previous call (of any instance) was at t - 1, and computes ``pow(beta, t)`` otherwise.
Its result then depends on the order of the process's calls, not only on the optimizer's own state.
Under FDG a stage's optimizer and the tied optimizers of its copies (Note [tied layers across stages])
step in an order that differs from stage to stage, so two owners stepped one copy with differently
rounded bias corrections and the copies drifted apart; a resumed process (whose first call takes
``pow``) did not continue a run bit for bit. :func:`pure_steps` makes every call take ``pow(beta, t)``:
right before it, one call on an empty tensor at step t + 2 moves the kept step where neither "t - 1"
nor "t" matches. The CUDA kernel computes the powers from t in every call and is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from torch import Tensor, nn

from fdg_schedule.base.config import FDGConfigError


def decouple_from_other_stages(optimizer: Any, basic: Any = None) -> None:
    """Make a DeepSpeed optimizer wrapper's norms and overflow checks stage-local (no cross-stage all-reduce),
    and the steps of the optimizer it wraps, ``basic``, a function of its own state (:func:`pure_steps`)."""
    if isinstance(optimizer, BF16_Optimizer):
        optimizer.mpu = None
    if isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):  # fp16 without ZeRO
        # its overflow check all-reduces over the model-parallel group, or without one over the world when the
        # engine reduces gradients itself (a pipeline's): the stage's gradients are already reduced over its replicas
        optimizer.mpu = optimizer.overflow_checker.mpu = optimizer.overflow_checker.deepspeed = None
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.model_parallel_group = None
        optimizer.model_parallel_rank = 0
    if basic is not None:
        pure_steps(basic)


def explain_client_optimizer(client: Any, model: nn.Module | None) -> Any:
    """``deepspeed.initialize``'s ``optimizer=`` argument, with a client callable that builds ``torch.optim.Muon`` on
    a stage holding anything but matrices made to fail naming those parameters and the fix (torch's own error
    names only a shape). DeepSpeed calls the callable with the stage's parameters; anything else passes through."""
    if not callable(client):  # an optimizer instance, or None
        return client

    def build(model_parameters: Any) -> Any:
        given = list(model_parameters)
        try:
            return client(given)
        except ValueError as error:
            if "Muon only supports 2D parameters" not in str(error):
                raise
            names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
            params = [q for g in given for q in (g["params"] if isinstance(g, dict) else [g])]
            others = [f"{names.get(id(q), 'a parameter')} {tuple(q.shape)}" for q in params if q.ndim != 2]
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            raise FDGConfigError(
                f"rank {rank}: torch.optim.Muon takes matrices only, and this stage also holds "
                f"{', '.join(others[:4])}{' and more' if len(others) > 4 else ''}. Use DeepSpeed's "
                '"optimizer": {"type": "Muon"} (Muon for the matrices, Adam for the rest), or make every parameter '
                "of every stage a matrix (for example Linear layers with bias=False and no norms)"
            ) from error

    return build


def pure_steps(optimizer: Any) -> None:
    """Note [FusedAdam's step on the CPU]: every step of ``optimizer`` (and of Muon's Adam half) on CPU tensors
    computes beta**t from its own step count t, whatever other optimizers in the process stepped before."""
    from deepspeed.ops.adam import FusedAdam

    for opt in (optimizer, getattr(optimizer, "aux_optimizer", None)):
        if not isinstance(opt, FusedAdam) or getattr(opt.multi_tensor_adam, "pure", False):
            continue
        devices = {p.device.type for group in opt.param_groups for p in group["params"]}
        if devices <= {"cpu"}:
            opt.multi_tensor_adam = _powers_from_step(opt.multi_tensor_adam)


def _powers_from_step(op: Any) -> Any:
    """The CPU ``multi_tensor_adam`` op, each call preceded by one on an empty tensor at step t + 2."""
    empty = torch.empty(0)

    def call(chunk_size: int, noop: Tensor, lists: list[list[Tensor]], lr: float, beta1: float, beta2: float,
             eps: float, step: int, *rest: Any) -> Any:  # fmt: skip
        op(chunk_size, noop, [[empty], [empty], [empty], [empty]], lr, beta1, beta2, eps, step + 2, *rest)
        return op(chunk_size, noop, lists, lr, beta1, beta2, eps, step, *rest)

    call.pure = True  # type: ignore[attr-defined]
    return call


def reduce_is_identity(engine: Any) -> bool:
    """True when DeepSpeed's ``ReduceGrads`` on ``engine`` only fills missing gradients with zeros.

    Note [gradient reduce with one data-parallel rank]: every condition under which DeepSpeed's
    ``allreduce_gradients`` reduces to flatten, identity collective and copy back of the same values.
    """
    params = [p for p in engine.module.parameters() if p.requires_grad]
    return (
        engine.dp_world_size == 1
        and engine.pipeline_enable_backward_allreduce
        and not engine.using_bf16_optimizer
        and engine.zero_optimization_stage() == 0
        and not engine.has_moe_layers
        and engine.gradient_predivide_factor() == 1.0
        and getattr(engine, "_autoep_folding_spec", None) is None
        and not hasattr(engine.optimizer, "set_gradient_accumulation_boundary")
        and all(p.dtype == engine.communication_data_type for p in params)
    )


def fill_missing_grads(parameters: Iterable[nn.Parameter]) -> bool:
    """Give every trainable, non-empty parameter without a gradient a zero one, as DeepSpeed's reduce does for
    a module's ``parameters()``.

    Returns False, changing nothing, when a gradient is sparse (DeepSpeed's reduce rebuilds those: run it).
    """
    params = [p for p in parameters if p.requires_grad and p.numel()]
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        return False
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
    return True


def clear_grads(parameters: Iterable[nn.Parameter]) -> None:
    """DeepSpeed's ``zero_grad`` (every gradient set to None) on a module's parameters, listed once."""
    for p in parameters:
        p.grad = None


def clip_stage_local(parameters: Iterable[nn.Parameter], clip: float) -> Tensor:
    """Clip the gradients to norm ``clip`` (0: no clipping) by this stage's own norm; returns the norm before clipping.

    For plain torch optimizers: DeepSpeed's ``clip_fp32_gradients`` would all-reduce the norm across stages.
    The norm stays on the device (Note [no host sync in a tick] in :mod:`fdg_schedule.base.guards`).
    """
    params = list(parameters)
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def capture_accumulated(optimizer: Any, params: list[nn.Parameter]) -> dict[str, Any]:
    """The gradients accumulated since the last step (Note [a partial accumulation in a checkpoint])."""
    copy = lambda t: None if t is None else t.detach().clone()  # noqa: E731
    state: dict[str, Any] = {
        "grad": [copy(p.grad) for p in params],
        "grad_accum": [copy(getattr(p, "grad_accum", None)) for p in params],
    }
    if isinstance(optimizer, BF16_Optimizer):
        state["bf16_grads"] = [copy(flat) for flat in optimizer.fp32_groups_gradients_flat]
        state["bf16_has_grads"] = [list(flags) for flags in optimizer.fp32_groups_has_gradients]
    return state


def restore_accumulated(optimizer: Any, params: list[nn.Parameter], state: dict[str, Any], device: Any) -> None:
    """Undo :func:`capture_accumulated` in a new process, after DeepSpeed loaded the optimizer state."""
    with torch.no_grad():
        for p, grad, accum in zip(params, state["grad"], state["grad_accum"], strict=True):
            p.grad = None if grad is None else grad.to(device=device, dtype=p.dtype)
            if hasattr(p, "grad_accum"):
                p.grad_accum = None if accum is None else accum.to(device)
        if isinstance(optimizer, BF16_Optimizer):
            flats: list[Tensor] = optimizer.fp32_groups_gradients_flat
            for flat, saved in zip(flats, state["bf16_grads"], strict=True):
                flat.copy_(saved)  # in place: the wrapper's per-parameter gradients are views of it
            for flags, saved_flags in zip(optimizer.fp32_groups_has_gradients, state["bf16_has_grads"], strict=True):
                flags[:] = saved_flags
