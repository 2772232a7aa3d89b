"""Small helpers over what travels through a pipeline: a tensor or a tuple of tensors (and labels of any kind)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

HOST = torch.device("cpu")  # host memory (gloo moves bytes from there; control words live there)


def as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def flat(x: Any) -> list[Tensor]:
    """Every tensor in ``x``, in order, through nested tuples and lists (other items are skipped)."""
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in flat(item)]
    return []


def map_tensors(x: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``x`` with ``fn`` applied to every tensor, through nested tuples and lists (lists become tuples)."""
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return tuple(map_tensors(item, fn) for item in x)
    return x


def floating(x: Any) -> list[Tensor]:
    """The floating-point tensors of ``x``: what gradients flow through and activations carry."""
    return [t for t in as_tuple(x) if torch.is_tensor(t) and t.is_floating_point()]


def input_grads(inputs: Any) -> tuple[Tensor, ...]:
    """The gradient of each floating input (zeros where autograd left none)."""
    return tuple(
        t.grad if t.grad is not None else torch.zeros_like(t) for t in as_tuple(inputs) if t.is_floating_point()
    )


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or tensors in tuples and lists) on ``device``, copied without a host synchronisation
    (``non_blocking``; from pinned host memory the copy is asynchronous, Note [no host sync in a tick])."""
    if torch.is_tensor(x):
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return tuple(to_device(t, device) for t in x)
    return x


def describe(x: Any) -> str:
    """Dtypes and shapes, for error messages: ``(torch.float32 (4, 8), torch.int64 (4,))``."""
    if torch.is_tensor(x):
        return f"{x.dtype} {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(describe(t) for t in x) + ")"
    return type(x).__name__


def nbytes(x: Any) -> int:
    if x is None:
        return 0
    return sum(t.numel() * t.element_size() for t in as_tuple(x) if torch.is_tensor(t))


def detached(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach()
    return tuple(detached(t) for t in x) if isinstance(x, (tuple, list)) else x


def leaves(x: Any, requires_grad: bool) -> Any:
    """``x`` as autograd leaves; floating ones require gradients when ``requires_grad``."""
    return map_tensors(x, lambda t: t.detach().requires_grad_(requires_grad and t.is_floating_point()))


def cloned(x: Any) -> Any:
    """A copy of every tensor in ``x`` (a layer may write into its input; the original stays untouched)."""
    return map_tensors(x, lambda t: t.clone())


def on_cpu(x: Any) -> Any:
    """``x`` (tensors in tuples, lists and dicts) with every tensor on the CPU, e.g. RNG states loaded onto a device."""
    if torch.is_tensor(x):
        return x.cpu()
    if isinstance(x, dict):
        return {k: on_cpu(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple, e.g. rng.RngState
        return type(x)(*(on_cpu(t) for t in x))
    if isinstance(x, (tuple, list)):
        return type(x)(on_cpu(t) for t in x)
    return x
