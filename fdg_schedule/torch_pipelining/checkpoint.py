"""Checkpoints of a ScheduleFDG job with torch.distributed.checkpoint (DCP), the micro-batches in flight included.

    save_checkpoint(schedule, "ckpt/step-1000")      # on every rank, between step() calls; no drain needed
    load_checkpoint(schedule, "ckpt/step-1000")      # on every rank, into a new schedule, before its first step()

Both are collective over the default process group (DCP's). The stage module and optimizer go in as DCP
state dicts (``get_model_state_dict`` / ``get_optimizer_state_dict``, so each tensor is a DCP tensor under
``stage<k>.model.<name>``; the replicas of a stage hold equal ones and DCP writes them once); what FDG adds is
one opaque entry per rank, ``fdg.rank<r>``.

Note [in-flight state in a checkpoint]: between two ``step()`` calls a stage holds, for each micro-batch
it forwarded and has not yet back-propagated, its input (the slot's receive buffer, or the first stage's
inputs), the RNG state its forward started from, the tensors autograd saved (a stored graph) and the
stashed weights; the messages posted for the next tick (the activation it forwards next, the gradient it
back-propagates next: the save waits for them, the neighbours sent them at the end of the same tick);
the gradients accumulated since its last optimizer step; the prediction's delta, the tick counters, the
last stage's targets of micro-batches still on their way, the LR scheduler and the host RNG. A graph
cannot be saved: on resume the stage's first ``step()`` (once torch's stage has set up its buffers) refills
the receive buffers and runs each stored forward again with autograd handed the saved tensors
(:meth:`~fdg_schedule.corrections.delayed.DelayedBackward.rebuilding`, Note [rebuilding a stored graph]), so
the delayed backward is bit for bit the one the uninterrupted run computes (tested).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fdg_schedule.torch_pipelining.schedule import ScheduleFDG


def _keys(schedule: ScheduleFDG) -> tuple[str, str]:
    return f"stage{schedule._stage.stage_index}", f"fdg.rank{dist.get_rank()}"


def _stage_state(schedule: ScheduleFDG, optimizer_state: bool) -> dict[str, Any]:
    """The stage module's (and, once it has state, the optimizer's) DCP state dict.

    Note [an optimizer without state]: ``get_optimizer_state_dict`` fills an optimizer that has no state yet
    by stepping it once at lr 0 (Adam's step count becomes 1), which would change the training that goes on
    after a save. A stage that has not stepped yet (a deep stage early in the first segment) saves no
    optimizer entry, only its param groups' hyperparameters (a scheduler may have moved the lr already)."""
    module = schedule._stage.submod
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(module, schedule.optimizer)
    return state


def save_checkpoint(schedule: ScheduleFDG, path: str | Path) -> None:
    """Save this rank's stage, optimizer and in-flight state into the DCP checkpoint at ``path`` (collective)."""
    stage_key, fdg_key = _keys(schedule)
    fdg_state = schedule.fdg_state()
    fdg_state["optimizer_state"] = bool(schedule.optimizer.state)
    # without state the hyperparameters (a scheduler's lr) still count (Note [an optimizer without state])
    fdg_state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in schedule.optimizer.param_groups]
    blob = io.BytesIO()
    torch.save(fdg_state, blob)
    blob.seek(0)
    dcp.save({stage_key: _stage_state(schedule, fdg_state["optimizer_state"]), fdg_key: blob}, checkpoint_id=str(path))


def load_checkpoint(schedule: ScheduleFDG, path: str | Path) -> None:
    """Load what :func:`save_checkpoint` saved at ``path`` into a new schedule of the same job (collective)."""
    stage_key, fdg_key = _keys(schedule)
    module, optimizer = schedule._stage.submod, schedule.optimizer
    try:
        blob: dict[str, Any] = {fdg_key: io.BytesIO()}
        dcp.load(blob, checkpoint_id=str(path))
        blob[fdg_key].seek(0)
        fdg_state = torch.load(blob[fdg_key], weights_only=False)
        state = {stage_key: _stage_state(schedule, fdg_state["optimizer_state"])}
        dcp.load(state, checkpoint_id=str(path))
    except Exception as err:
        raise ValueError(
            f"{schedule.name}: cannot load the checkpoint at {path} into this job ({err}); resume with the "
            "pipeline that saved it (its stages, replicas and modules)"
        ) from err
    set_model_state_dict(module, state[stage_key]["model"])
    if fdg_state["optimizer_state"]:
        set_optimizer_state_dict(module, optimizer, state[stage_key]["optimizer"])
    else:
        for group, saved in zip(optimizer.param_groups, fdg_state["param_groups"], strict=True):
            group.update(saved)
    schedule.load_fdg_state(fdg_state)
