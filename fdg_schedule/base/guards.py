"""Checks on what flows through a stage during a tick, kept on the device and read on the host at set points.

Note [no host sync in a tick]: on an accelerator every read of a device value on the host
(``.item()``, ``bool(tensor)``, ``.tolist()``, ``.cpu()``) waits for every kernel queued before it:
the stage's queue runs dry, which is the stall FDG exists to remove. So a tick never reads one.
Losses stay tensors; a check that a loss or gradient norm is finite is queued as a device flag
(:meth:`NonFiniteWatch.record`) with the stage, tick and micro-batch it belongs to, and the flags
are read in one host transfer (:meth:`NonFiniteWatch.check`) at the end of every ``train_batch()``
/ ``drain()`` call, or every ``pipeline.fdg.check_every`` ticks when that is set. The error then
names the tick the first non-finite value was made in, as if it had been read at once; the ticks
that ran in between trained on it, which is why the run stops. Two reads remain, both outside the
guarantee or on host memory: ``pipeline.fdg.nonfinite="skip"`` must know before each optimizer
step whether to skip it (one read per step, as DeepSpeed's loss scaler does), and the exchange's
control word and shape header travel in host memory (:func:`read_host`, Note [control words on
the host] in :mod:`fdg_schedule.exchange.comm`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.tensors import floating


def finite(t: Tensor) -> bool:
    """True when every element of ``t`` is finite (a host read: only where a step must be decided now)."""
    return bool(torch.isfinite(t).all())


def read_host(t: Tensor) -> list[int]:
    """The integers of a tensor that lives in host memory (a control word, a header): never a device sync.

    Refuses a tensor on an accelerator, so a device value cannot slip through this door unnoticed.
    """
    if not t.is_cpu:
        raise FDGRuntimeError(f"read_host() is for tensors in host memory, got one on {t.device}")
    return [int(v) for v in t.numpy()]


class NonFiniteError(FDGRuntimeError):
    """A non-finite loss or gradient under ``nonfinite="error"``; ``what`` says which."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


@dataclasses.dataclass(frozen=True)
class _Flag:
    what: str  # "loss" | "gradient"
    tick: int
    micro_batch: int | None
    ok: Tensor  # 0-dim bool on the device: every element was finite


class NonFiniteWatch:
    """Device flags of the finiteness checks a stage queued since the last host read (Note [no host sync in a tick])."""

    def __init__(self) -> None:
        self._flags: list[_Flag] = []

    def record(self, what: str, value: Tensor, tick: int, micro_batch: int | None = None) -> None:
        """Queue the check that ``value`` is finite; no host read."""
        self._flags.append(_Flag(what, tick, micro_batch, torch.isfinite(value.detach()).all()))

    def allows(self, policy: str, what: str, value: Tensor, tick: int) -> bool:
        """``pipeline.fdg.nonfinite`` before a step on ``value`` (a norm): "error" queues the check and allows
        the step (the run stops at the next read); "skip" reads it now and allows only a finite one."""
        if policy == "error":
            self.record(what, value, tick)
            return True
        return finite(value)

    def pending(self) -> int:
        return len(self._flags)

    def check(self, where: str) -> None:
        """Read every queued flag in one host transfer; raise :func:`non_finite` for the first that failed."""
        if not self._flags:
            return
        flags, self._flags = self._flags, []
        ok = torch.stack([f.ok for f in flags]).tolist()  # the one host read (Note [no host sync in a tick])
        for flag, fine in zip(flags, ok):
            if not fine:
                raise non_finite(flag.what, where, flag.tick, flag.micro_batch)

    def clear(self) -> None:
        self._flags = []


def training_dtype(engine: Any) -> torch.dtype | None:
    """The dtype a DeepSpeed engine's first-stage inputs must have: bf16's or fp16's, None in fp32."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    return torch.float16 if engine.fp16_enabled() else None


def check_inputs(inputs: Any, micro_batch: int, dtype: torch.dtype | None, where: str) -> None:
    """Under bf16 or fp16 (``dtype``) the first stage's floating inputs must already have that dtype, as DeepSpeed
    expects."""
    wrong = [t.dtype for t in floating(inputs) if t.dtype != dtype] if dtype is not None else []
    if wrong:
        key = "bf16" if dtype == torch.bfloat16 else "fp16"
        raise FDGRuntimeError(
            f"{where}: micro-batch {micro_batch} has floating inputs of dtype {wrong[0]} but {key}.enabled is "
            f"true; convert the inputs to {dtype} in the data pipeline"
        )


def non_finite(what: str, where: str, tick: int, micro_batch: int | None = None) -> NonFiniteError:
    """The error for a non-finite ``what`` (loss, gradient) under ``pipeline.fdg.nonfinite="error"``."""
    of = "" if micro_batch is None else f" of micro-batch {micro_batch} (of this pipeline segment)"
    return NonFiniteError(
        f'{where}: non-finite {what}{of} at tick {tick}; lower the learning rate or set pipeline.fdg.nonfinite="skip" '
        "to skip such optimizer steps",
        what,
    )
