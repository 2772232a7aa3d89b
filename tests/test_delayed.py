"""DelayedBackward on its own: in each mode, a backward run after an optimizer step differentiates what it should.

One process, a small stage; the expected gradients are computed independently (a copy of the
stage at the forward's weights, or by hand for the mixed "current"/"stored" case).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from fdg_schedule.base.config import FDGConfig
from fdg_schedule.corrections.delayed import DelayedBackward, Held


def _forward(delayed: DelayedBackward, run: Callable[[], Any]) -> tuple[Any, Held | None]:
    """The stage forward ``run()`` inside :meth:`DelayedBackward.forwarding`, as the engine runs it."""
    with delayed.forwarding() as forward:
        forward.outputs = run()
    return forward.outputs, forward.held


@contextlib.contextmanager
def _backward(delayed: DelayedBackward, held: Held, outputs: Any, run: Callable[[], Any]) -> Iterator[Any]:
    """The outputs to back-propagate through inside :meth:`DelayedBackward.backward`: ``run()`` again or ``outputs``."""
    with delayed.backward(held) as rerun:
        yield run() if rerun else outputs


def _rebuild(delayed: DelayedBackward, held: Held, run: Callable[[], Any]) -> Any:
    with delayed.rebuilding(held) as rerun:
        outputs = run() if rerun else None
    return outputs


def _stage(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Dropout(dropout), nn.Tanh(), nn.Linear(5, 3))


def _step(module: nn.Module) -> None:
    """What an optimizer step does to the weights between the forward and the delayed backward."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.ones_like(p))


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


def _delayed(module: nn.Module, weights: str, activations: str, x: torch.Tensor, g: torch.Tensor) -> list:
    delayed = DelayedBackward(module, FDGConfig(weights=weights, activations=activations), delayed=True)
    outputs, held = _forward(delayed, lambda: module(x))
    assert held is not None
    _step(module)
    with _backward(delayed, held, outputs, lambda: module(x)) as out:
        torch.autograd.backward(out, g)
    return _grads(module, x)


@pytest.mark.parametrize("activations", ["stored", "recomputed"])
def test_stashed_weights_give_the_gradient_at_the_forwards_weights(activations: str) -> None:
    x, g = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)
    module = _stage(dropout=0.3)
    before = copy.deepcopy(module)
    rng = torch.get_rng_state()
    got = _delayed(module, "stashed", activations, x, g)
    x_ref = x.detach().requires_grad_(True)
    torch.set_rng_state(rng)  # the same dropout mask
    before(x_ref).backward(g)
    for a, b in zip(got, _grads(before, x_ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    after = _stage(dropout=0.3)
    _step(after)  # the weights are the stepped ones again after the backward
    for p, q in zip(module.parameters(), after.parameters()):
        assert torch.equal(p, q)


def test_current_weights_recomputed_is_the_gradient_of_a_forward_at_the_new_weights() -> None:
    x, g = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)
    module = _stage(dropout=0.3)
    rng = torch.get_rng_state()
    got = _delayed(module, "current", "recomputed", x, g)
    stepped = _stage(dropout=0.3)
    _step(stepped)
    x_ref = x.detach().requires_grad_(True)
    torch.set_rng_state(rng)
    stepped(x_ref).backward(g)
    for a, b in zip(got, _grads(stepped, x_ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_current_weights_stored_reads_the_new_weights_with_the_old_activations() -> None:
    """Note [saved weights read live]: y = W2 tanh(W1 x + b1) + b2 with h = tanh(...) from the forward."""
    x, g = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)
    module = _stage()
    w1, b1 = module[0].weight.detach().clone(), module[0].bias.detach().clone()
    h = torch.tanh(x.detach() @ w1.T + b1)  # the forward's activation
    got = _delayed(module, "current", "stored", x, g)
    w1_now, w2_now = module[0].weight.detach(), module[3].weight.detach()
    dz = (g @ w2_now) * (1 - h * h)
    expected = [dz.T @ x.detach(), dz.sum(0), g.T @ h, g.sum(0), dz @ w1_now]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weights", ["current", "stashed"])
def test_a_rebuilt_stored_forward_back_propagates_bit_for_bit(weights: str) -> None:
    """Note [rebuilding a stored graph]: the held record, copied as a checkpoint would, rebuilds the graph."""
    x, g = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)
    module = _stage(dropout=0.3)
    delayed = DelayedBackward(module, FDGConfig(weights=weights, activations="stored"), delayed=True)
    outputs, held = _forward(delayed, lambda: module(x))
    assert held is not None and held.saved
    _step(module)
    saved = Held(
        weights=None if held.weights is None else [w.clone() for w in held.weights],
        rng_state=held.rng_state,
        saved=[t.detach().clone() for t in held.saved],
    )
    rebuilt = _rebuild(delayed, saved, lambda: module(x))
    with _backward(delayed, saved, rebuilt, lambda: module(x)) as out:
        torch.autograd.backward(out, g)
    from_rebuilt = _grads(module, x)
    module.zero_grad()
    x.grad = None
    with _backward(delayed, held, outputs, lambda: module(x)) as out:
        torch.autograd.backward(out, g)
    for a, b in zip(from_rebuilt, _grads(module, x)):
        assert torch.equal(a, b)


def test_what_is_held_per_mode() -> None:
    x = torch.randn(2, 4)
    module = _stage()
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    held = {}
    for w in ("current", "stashed"):
        for a in ("stored", "recomputed"):
            delayed = DelayedBackward(module, FDGConfig(weights=w, activations=a), delayed=True)
            held[w, a] = _forward(delayed, lambda: module(x))[1]
    assert held["current", "recomputed"].nbytes() == 0  # only the input (kept by the engine) and RNG state
    assert held["stashed", "recomputed"].nbytes() == weights
    assert held["current", "stored"].nbytes() > 0 and held["current", "stored"].weights is None
    assert held["stashed", "stored"].nbytes() == held["current", "stored"].nbytes() + weights
    last = DelayedBackward(module, FDGConfig(weights="stashed"), delayed=False)  # delay 0: plain autograd
    assert _forward(last, lambda: module(x))[1] is None


@pytest.mark.parametrize("weights", ["current", "stashed"])
def test_a_graph_dropped_without_its_backward_is_freed_without_the_cycle_collector(weights: str) -> None:
    # DeepSpeed's "disable_python_gc": true turns the cycle collector off; a stored forward whose
    # backward never runs (an exception, a reset) must then be freed by reference counting alone.
    from deepspeed.runtime.python_gc import python_gc_manager

    module = _stage()
    delayed = DelayedBackward(module, FDGConfig(weights=weights), delayed=True)
    generation = python_gc_manager.acquire()
    try:
        x = torch.randn(64, 4, requires_grad=True)
        outputs, held = _forward(delayed, lambda: torch.sigmoid(module(x)))  # sigmoid saves its own output
        freed: list[str] = []
        weakref.finalize(outputs, freed.append, "outputs")
        del outputs, held
        assert freed == ["outputs"], "the dropped stored forward's graph waits for the cycle collector"
    finally:
        python_gc_manager.release(generation)


def test_a_recomputed_forward_runs_as_the_first_forward_did() -> None:
    """Note [the recomputed forward runs as the first did]: both forwards record gradients (PyTorch picks an
    attention kernel, and with it the dropout masks, partly from that); the first forward's graph is not kept."""
    grad_enabled = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            grad_enabled.append(torch.is_grad_enabled() and x.requires_grad)
            return x

    module = nn.Sequential(Probe(), nn.Linear(4, 3))
    delayed = DelayedBackward(module, FDGConfig(activations="recomputed"), delayed=True)
    x = torch.randn(2, 4, requires_grad=True)
    outputs, held = _forward(delayed, lambda: module(x))
    assert held is not None and outputs.grad_fn is None  # the graph went with the first forward
    with _backward(delayed, held, outputs, lambda: module(x)) as out:
        out.sum().backward()
    assert grad_enabled == [True, True]


def test_a_stored_forwards_activations_are_freed_during_its_backward() -> None:
    """Note [saved activations freed during the backward]: once autograd has used an activation, nothing
    keeps it, though the held record lives until the backward returns."""
    module = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh())
    delayed = DelayedBackward(module, FDGConfig(), delayed=True)
    x = torch.randn(2, 4, requires_grad=True)
    outputs, held = _forward(delayed, lambda: module(x))
    assert held is not None and held.saved
    activations = [weakref.ref(t) for t in held.saved if t.untyped_storage().data_ptr() != x.data_ptr()]
    assert activations
    with _backward(delayed, held, outputs, lambda: module(x)) as out:
        torch.autograd.backward(out, torch.ones(2, 3))
        assert all(a() is None for a in activations)  # freed inside the backward, `held` still alive
    assert held.nbytes() == 0
