"""ScheduleFDG's arguments, checked on every rank before any rank waits on another.

The FDG keys are those of ``pipeline.fdg`` in the DeepSpeed path (:class:`~fdg_schedule.base.config.FDGConfig`,
one statement of what they mean), passed as keyword arguments; errors name the argument instead of the
DeepSpeed config key. Keys that only the DeepSpeed engine implements are refused with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fdg_schedule.base.config import FDGConfig, FDGConfigError

# pipeline.fdg keys the DeepSpeed engine has and ScheduleFDG has not, and why (the error says it).
ENGINE_ONLY = {
    "staleness_every": "the staleness metric is measured by the DeepSpeed engine only",
    "nonfinite": "non-finite values are not checked per step (check the losses step() returns)",
    "transport": "messages go through the stage's process group",
    "check_every": "no non-finite flags are kept",
    "trace": "the timeline is written by the DeepSpeed engine only",
}


def fdg_config(keys: Mapping[str, Any]) -> FDGConfig:
    """The FDG settings from ScheduleFDG's keyword arguments (``pipeline.fdg`` keys), or FDGConfigError."""
    refused = sorted(set(keys) & set(ENGINE_ONLY))
    if refused:
        why = "; ".join(f"{key}: {ENGINE_ONLY[key]}" for key in refused)
        raise FDGConfigError(f"ScheduleFDG does not take {refused} ({why}); remove them")
    try:
        return FDGConfig.from_dict(dict(keys))
    except (FDGConfigError, TypeError) as err:
        raise FDGConfigError(_as_arguments(str(err))) from None


def _as_arguments(message: str) -> str:
    """A ``pipeline.fdg`` error in ScheduleFDG's words: ``(ScheduleFDG(grad_shrink=...))`` for the config key."""
    message = re.sub(r"\(pipeline\.fdg\.(\w+) in ds_config\)", r"(ScheduleFDG(\1=...))", message)
    for config_words, argument_words in (
        ("in pipeline.fdg of ds_config", "in ScheduleFDG's arguments"),
        ("(pipeline.fdg in ds_config)", "(ScheduleFDG's arguments)"),
        ("pipeline.fdg sets", "the arguments set"),
        (" (ds_config)", ""),
        ("pipeline.fdg.", ""),
    ):
        message = message.replace(config_words, argument_words)
    return f"ScheduleFDG: {message}"


def check_stage(stage: Any, n_microbatches: Any) -> None:
    """One PipelineStage per rank, a plain module, and a positive number of micro-batches per step()."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if not isinstance(stage, _PipelineStageBase):
        raise TypeError(
            f"ScheduleFDG needs a torch.distributed.pipelining PipelineStage, got {type(stage).__name__}; build one "
            "with PipelineStage(module, stage_index, num_stages, device, group=...)"
        )
    if stage.group_size != stage.num_stages:
        raise ValueError(
            f"ScheduleFDG runs one stage per rank: the stage's group has {stage.group_size} ranks for "
            f"{stage.num_stages} stages (interleaved and V schedules put several stages on a rank); give the "
            "pipeline group one rank per stage"
        )
    if isinstance(stage.submod, nn.parallel.DistributedDataParallel) or _is_fsdp(stage.submod):
        raise ValueError(
            f"ScheduleFDG reduces a stage's gradients itself, once per optimizer step: the stage module is a "
            f"{type(stage.submod).__name__}; pass the plain module and ScheduleFDG(dp_group=...) for data parallelism"
        )
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def check_optimizer(stage_module: nn.Module, optimizer: Any, where: str) -> None:
    """The optimizer steps this stage's trainable parameters, all of them and nothing else."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: ScheduleFDG needs the stage's optimizer (a torch.optim.Optimizer over the stage module's "
            f"parameters), got {type(optimizer).__name__}: the schedule steps it at every tick"
        )
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = dict(stage_module.named_parameters())
    missing = [name for name, p in named.items() if p.requires_grad and id(p) not in stepped]
    foreign = len(stepped - {id(p) for p in named.values()})
    if missing or foreign:
        raise ValueError(
            f"{where}: the optimizer must step exactly the stage module's trainable parameters: "
            f"{missing or 'none'} are missing, {foreign} parameter(s) are not the stage's; build it from "
            "stage.submod.parameters()"
        )


def check_number(name: str, value: Any, minimum: float, strict: bool) -> float:
    """A finite number ``>= minimum`` (``> minimum`` when ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)
