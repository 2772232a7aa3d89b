"""A single-process statement of the FDG update: the judge the distributed engine is tested against.

It runs K stage modules in one process, tick by tick, exactly as the paper describes and
:mod:`fdg_schedule.ticks` draws: every stage only sees what its neighbours sent at the previous
tick. It shares no code with the engine's delayed-backward machinery, so the two agree only if
both implement the same math.

    losses = fdg_reference(stages, optimizers, micro_batches, loss_fn, grad_shrink=0.5)

Note [current weights]: with ``weights="current"`` and ``activations="stored"`` the backward uses
the stored activations but reads every saved weight at its value at backward time. Autograd
refuses that (the optimizer step bumps the weights' version counters, later forwards bump the
batch-norm running statistics'), so stored forwards run under saved-tensor hooks that hand the
very same tensors back, which skips the version check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fdg_schedule import ticks
from fdg_schedule.config import FDGConfig

Activation = Tensor | tuple[Tensor, ...]


@dataclasses.dataclass
class _InFlight:
    """What a stage keeps for a micro-batch between its forward and its delayed backward."""

    inputs: tuple[Tensor, ...]
    outputs: Activation | None  # the graph (activations="stored")
    weights: dict[str, Tensor] | None  # leaves the forward used (weights="stashed")
    rng_state: Tensor | None  # for the recomputed forward


def fdg_reference(
    stages: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    micro_batches: Sequence[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], Tensor],
    config: FDGConfig | None = None,
    drain: bool = False,
    schedulers: Sequence[Any] = (),
    clip_grad_norm: float = 0.0,
    after_tick: Callable[[int], None] | None = None,
) -> list[float]:
    """Train ``stages`` with FDG on ``micro_batches`` (``(inputs, labels)`` pairs), one per tick.

    Args:
        drain: after the last micro-batch entered, run ``2(K-1)`` more ticks so every micro-batch
            is back-propagated (and a partial accumulation is stepped).
        schedulers: stepped once every ``accumulate`` ticks, fill and drain ticks included.
        clip_grad_norm: stage-local gradient clipping before each step (0 = off).
        after_tick: called with the tick number at the end of each tick.

    Returns:
        The loss of each micro-batch the last stage computed, in order.
    """
    config = config or FDGConfig()
    K, n = len(stages), len(micro_batches)
    in_flight: list[dict[int, _InFlight]] = [{} for _ in stages]
    activation_msg: dict[int, tuple[int, tuple[Tensor, ...]]] = {}  # stage -> (micro-batch, tensors)
    grad_msg: dict[int, tuple[int, tuple[Tensor, ...]]] = {}
    losses: list[float] = []
    for tick in range(n + (ticks.drain_ticks(K) if drain else 0)):
        next_activation, next_grad = {}, {}
        for k, stage in enumerate(stages):
            last = k == K - 1
            bwd = ticks.backward_micro_batch(tick, K, k, n)
            if not last and bwd is not None:
                received_bwd, grads = grad_msg[k]
                assert received_bwd == bwd
                shrunk = tuple(config.grad_shrink * g for g in grads)
                input_grads = _delayed_backward(stage, in_flight[k].pop(bwd), shrunk, config)
                if k > 0:
                    next_grad[k - 1] = (bwd, input_grads)
                _maybe_step(stage, optimizers[k], bwd, config, n if drain else None, clip_grad_norm)
            fwd = ticks.forward_micro_batch(tick, k, n)
            if fwd is None:
                continue
            if k == 0:
                inputs = _as_tuple(micro_batches[fwd][0])
            else:
                received_fwd, inputs = activation_msg[k]
                assert received_fwd == fwd
            if last:
                x = _leaves(inputs, requires_grad=k > 0)
                loss = loss_fn(_run(stage, x, None), micro_batches[fwd][1])
                (loss / config.accumulate).backward()
                losses.append(loss.item())
                if k > 0:
                    next_grad[k - 1] = (fwd, _grads_of(x))
                _maybe_step(stage, optimizers[k], fwd, config, n if drain else None, clip_grad_norm)
            else:
                record = _forward(stage, inputs, config, requires_grad=k > 0)
                in_flight[k][fwd] = record
                next_activation[k + 1] = (fwd, _detached(_forward_outputs(stage, record, config)))
        activation_msg, grad_msg = next_activation, next_grad
        if ticks.scheduler_steps_after(tick + 1, config.accumulate):  # Note [learning rate per optimizer step]
            for scheduler in schedulers:
                scheduler.step()
        if after_tick is not None:
            after_tick(tick)
    return losses


def _forward(stage: nn.Module, inputs: tuple[Tensor, ...], config: FDGConfig, requires_grad: bool) -> _InFlight:
    x = _leaves(inputs, requires_grad)
    weights = None
    if config.weights == "stashed":
        weights = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in stage.named_parameters()}
    if config.activations == "recomputed":
        rng_state = torch.get_rng_state()
        with torch.no_grad():
            outputs = _run(stage, x, weights)
        return _InFlight(x, outputs, weights, rng_state)
    # Note [current weights]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        outputs = _run(stage, x, weights)
    return _InFlight(x, outputs, weights, None)


def _forward_outputs(stage: nn.Module, record: _InFlight, config: FDGConfig) -> Activation:
    assert record.outputs is not None
    outputs = record.outputs
    if config.activations == "recomputed":
        record.outputs = None  # only the inputs (and RNG state) wait for the backward
    return outputs


def _delayed_backward(
    stage: nn.Module, record: _InFlight, grads: tuple[Tensor, ...], config: FDGConfig
) -> tuple[Tensor, ...]:
    with contextlib.ExitStack() as recompute:
        outputs = record.outputs
        if config.activations == "recomputed":
            recompute.enter_context(_replayed_rng(record.rng_state))
            recompute.enter_context(_buffers_kept(stage))
            outputs = _run(stage, record.inputs, record.weights)
        assert outputs is not None
        floating = [t for t in _as_tuple(outputs) if t.is_floating_point()]
        torch.autograd.backward(floating, grads)
    if record.weights is not None:  # the gradient was taken at the stashed weights
        for name, p in stage.named_parameters():
            g = record.weights[name].grad
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
    return _grads_of(record.inputs)


def _maybe_step(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batch: int,
    config: FDGConfig,
    drain_limit: int | None,
    clip_grad_norm: float,
) -> None:
    last = None if drain_limit is None else drain_limit - 1
    if not ticks.steps_after_backward(micro_batch, config.accumulate, last):
        return
    if clip_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(stage.parameters(), clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad()


def _run(stage: nn.Module, x: tuple[Tensor, ...], weights: dict[str, Tensor] | None) -> Activation:
    # A DeepSpeed layer takes one argument: a tensor, or a tuple of them.
    if weights is None:
        return _unwrap(stage(_unwrap(x)))
    return _unwrap(functional_call(stage, weights, (_unwrap(x),)))


@contextlib.contextmanager
def _replayed_rng(state: Tensor | None) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        if state is not None:
            torch.set_rng_state(state)
        yield


@contextlib.contextmanager
def _buffers_kept(stage: nn.Module) -> Iterator[None]:
    """Batch-norm running statistics are updated by the first forward only."""
    saved = [b.clone() for b in stage.buffers()]
    yield
    with torch.no_grad():
        for b, s in zip(stage.buffers(), saved):
            b.copy_(s)


def _as_tuple(x: Any) -> tuple[Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _unwrap(x: Any) -> Activation:
    if isinstance(x, (tuple, list)):
        return x[0] if len(x) == 1 else tuple(x)
    return x


def _leaves(inputs: tuple[Tensor, ...], requires_grad: bool) -> tuple[Tensor, ...]:
    return tuple(t.detach().requires_grad_(requires_grad and t.is_floating_point()) for t in inputs)


def _detached(x: Activation) -> tuple[Tensor, ...]:
    return tuple(t.detach() for t in _as_tuple(x))


def _grads_of(x: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in x if t.is_floating_point())
