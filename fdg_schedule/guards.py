"""Checks on what flows through a stage during a tick: input dtypes, finite losses and gradient norms.

Each check that needs a value on the host (``bool(tensor)``, a device synchronisation) is made
here, so that they can be deferred or batched in one place. ``pipeline.fdg.nonfinite`` says what a
non-finite loss or gradient does: stop with an error naming the stage and tick, or skip the step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fdg_schedule.errors import FDGRuntimeError
from fdg_schedule.tensors import floating


def finite(t: Tensor) -> bool:
    """True when every element of ``t`` is finite (a host synchronisation)."""
    return bool(torch.isfinite(t).all())


def check_inputs(inputs: Any, micro_batch: int, bf16: bool, where: str) -> None:
    """Under bf16 the first stage's floating inputs must already be ``torch.bfloat16``, as DeepSpeed expects."""
    wrong = [t.dtype for t in floating(inputs) if t.dtype != torch.bfloat16] if bf16 else []
    if wrong:
        raise FDGRuntimeError(
            f"{where}: micro-batch {micro_batch} has floating inputs of dtype {wrong[0]} but bf16.enabled is "
            "true; convert the inputs to torch.bfloat16 in the data pipeline"
        )


def non_finite(what: str, where: str, tick: int, micro_batch: int | None = None) -> FDGRuntimeError:
    """The error for a non-finite ``what`` (loss, gradient) under ``pipeline.fdg.nonfinite="error"``."""
    of = "" if micro_batch is None else f" of micro-batch {micro_batch} (of this pipeline segment)"
    return FDGRuntimeError(
        f'{where}: non-finite {what}{of} at tick {tick}; lower the learning rate or set pipeline.fdg.nonfinite="skip" '
        "to skip such optimizer steps"
    )
