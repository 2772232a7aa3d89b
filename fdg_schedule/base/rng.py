"""The random-number state a forward starts from -- host and accelerator -- through DeepSpeed's accelerator API.

A recomputed forward (``activations="recomputed"``), a rebuilt stored graph and a resumed run must
draw the same dropout masks as the first forward. Masks of tensors on the stage's device come from
the accelerator's generator, masks of host tensors from torch's host generator, so both are saved
and replayed. ``deepspeed.accelerator.get_accelerator()`` names the device generator for every
accelerator DeepSpeed supports (CUDA, ROCm, XPU, HPU, NPU, MPS, ...); on the CPU accelerator it is
the host generator itself and is saved once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from deepspeed.accelerator import get_accelerator
from torch import Tensor

from fdg_schedule.base.tensors import HOST


class RngState(NamedTuple):
    host: Tensor
    device: Tensor | None  # None on the CPU accelerator (its generator is the host one)


def _device_generator() -> bool:
    accelerator = get_accelerator()
    return accelerator.device_name().split(":")[0] != HOST.type and accelerator.is_available()


def capture() -> RngState:
    """The host and accelerator generator states now."""
    device = get_accelerator().get_rng_state() if _device_generator() else None
    return RngState(torch.get_rng_state(), device)


def restore(state: RngState | tuple[Tensor, Tensor | None]) -> None:
    """Set the host and accelerator generators to ``state``."""
    host, device = state
    torch.set_rng_state(host)
    if device is not None and _device_generator():
        get_accelerator().set_rng_state(device)


@contextlib.contextmanager
def replayed(state: RngState | tuple[Tensor, Tensor | None]) -> Iterator[None]:
    """Run the block from ``state``, then put the generators back where they were (a fork)."""
    before = capture()
    restore(state)
    try:
        yield
    finally:
        restore(before)
