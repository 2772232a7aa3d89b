"""FDG's in-flight state inside DeepSpeed checkpoints: the file each rank saves beside DeepSpeed's, and its checks.

DeepSpeed saves weights (per layer), optimizer, LR scheduler and counters per stage. FDG adds, per
stage and data-parallel rank, ``<save_dir>/<tag>/fdg_stage{k:02d}_dp{r:03d}.pt``: what
:meth:`fdg_schedule.runtime.stage_state.StageState.capture` returns (the micro-batches in flight, the
messages received for the next tick, the labels the last stage holds, the segment tick, the data
position, this rank's RNG state, the tick count and the weight-prediction delta), with the layout
and modes it was saved under. A run that saves
at tick T and resumes from the checkpoint computes, from tick T on, bit for bit what it would have
computed without stopping -- given its data iterators restart at micro-batch T, as in stock DeepSpeed.

Writes are atomic (temporary file, then rename), and ``latest`` is rewritten only after every rank
has finished writing, so an interrupted save never leaves ``latest`` pointing at a partial checkpoint.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import logger
from torch import Tensor

from fdg_schedule.base.config import FDGConfig, FDGConfigError

FORMAT = 1


def state_path(save_dir: str, tag: str, stage_id: int, dp_id: int) -> str:
    return os.path.join(save_dir, str(tag), f"fdg_stage{stage_id:02d}_dp{dp_id:03d}.pt")


def atomic_save(obj: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically (call once every rank has written its files)."""
    tmp = os.path.join(save_dir, f"latest.tmp{os.getpid()}")
    with open(tmp, "w") as fd:
        fd.write(str(tag))
    os.replace(tmp, os.path.join(save_dir, "latest"))


def publish(save_dir: str, tag: str, global_rank: int) -> None:
    """Every rank: once all have written every file, global rank 0 points ``latest`` at ``tag``."""
    dist.barrier()
    if global_rank == 0:
        write_latest(save_dir, tag)
    dist.barrier()


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fd:
        return fd.read().strip()


def saved_stages(load_dir: str, tag: str) -> int | None:
    """Number of pipeline stages a DeepSpeed pipeline checkpoint was saved with (FDG or 1F1B)."""
    files = glob.glob(os.path.join(load_dir, tag, "mp_rank_*_model_states.pt"))
    return len(files) or None


def other_stages(load_dir: str, tag: str | None, stages: int, per_stage_state: bool) -> bool:
    """True when the checkpoint has another number of stages (then only its weights load).

    Raises :class:`FDGConfigError` when ``per_stage_state`` (optimizer or LR-scheduler state) is requested.
    """
    saved = None if tag is None else saved_stages(load_dir, tag)
    if saved is None or saved == stages:
        return False
    if per_stage_state:
        raise FDGConfigError(
            f"checkpoint {os.path.join(load_dir, str(tag))} has {saved} pipeline stages, this job "
            f"{stages}: optimizer and LR-scheduler state are per stage and cannot be re-partitioned; "
            "call load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False) to load "
            "the weights (re-partitioned by layer)"
        )
    return True


def identity(stages: int, data_parallel: int, config: FDGConfig) -> dict[str, Any]:
    """What must match for in-flight work to continue: layout and modes."""
    return {
        "stages": stages,
        "data_parallel": data_parallel,
        "weights": config.weights,
        "activations": config.activations,
    }


def why_not_resumable(state: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why a saved FDG state cannot continue in this job (None if it can)."""
    if state.get("format") != FORMAT:
        return f"checkpoint FDG state format {state.get('format')!r}, this version reads {FORMAT}"
    for key, value in expected.items():
        if state.get(key) != value:
            return f"checkpoint has {key}={state.get(key)!r}, this job {key}={value!r}"
    return None


def save(path: str, expected: dict[str, Any], captured: dict[str, Any]) -> None:
    """Write a stage's captured state with the layout and modes it belongs to."""
    atomic_save({"format": FORMAT, **expected, **captured}, path)


def placement(device: torch.device) -> Callable[[Any, str], Any]:
    """Note [host tensors stay on the host]: ``torch.load``'s ``map_location`` for this stage's state.

    A tensor saved from host memory loads into host memory, one saved on any device onto ``device``.
    What a stage keeps on the host lives there on purpose and is read there without a device sync:
    the exchange's control word (``read_host`` refuses anything else), torch optimizers' ``step``
    counters (a tied optimizer's, read with ``.item()`` every tied step) and the RNG states; mapped
    onto the GPU they would cost a host sync at every read, or fail. The restore moves what
    computes on the device (a stage's in-flight inputs and held tensors) there itself, so a
    checkpoint saved on the host resumes on a device too.
    """

    def place(storage: Any, location: str) -> Any:
        return storage if location == "cpu" else storage.to(device=device)

    return place


def load(
    load_dir: str, tag: str, stage_id: int, dp_id: int, expected: dict[str, Any], log: bool, device: torch.device
) -> dict | None:
    """This rank's saved state if it can continue in this job, else None: what was saved on a device on
    ``device``, what was saved in host memory there (Note [host tensors stay on the host], :func:`placement`).

    ``log``: say how many in-flight micro-batches are dropped (this rank's; stage 0 holds the most).
    """
    path = state_path(load_dir, tag, stage_id, dp_id)
    state = torch.load(path, map_location=placement(device), weights_only=False) if os.path.exists(path) else None
    if state is None:
        reason: str | None = "it holds no FDG state for this stage (a 1F1B checkpoint or another layout)"
    else:
        reason = why_not_resumable(state, expected)
    if reason is None:
        return state
    if log:
        dropped = 0 if state is None else len(state.get("in_flight", ()))
        logger.warning(
            f"fdg_schedule: dropped {dropped} in-flight micro-batches from checkpoint {tag} ({reason}); "
            "the pipeline fills again from the next train_batch(); the tick count and, with the same "
            "number of stages, the weight-prediction delta go on"
        )
    return None


def carried(load_dir: str, tag: str, stage_id: int, stages: int) -> tuple[int, list[Tensor] | None]:
    """What goes on from an FDG checkpoint whose in-flight work cannot (Note [what a layout change keeps]).

    Returns the tick count it was saved at (0 for a checkpoint without FDG state, e.g. 1F1B) and, when
    it has this job's number of stages, this stage's weight-prediction delta (None otherwise).

    Note [what a layout change keeps]: the tick counts training, not the pipeline's layout, so the
    corrections' t goes on in any FDG job (every stage saved the same tick). Delta is a moving
    average of stage k's own steps: it carries over when stage k holds the same parameters (the
    same number of stages; other modes or data parallelism do not matter), else it starts at zero.
    """
    own = state_path(load_dir, tag, stage_id, 0)
    first = state_path(load_dir, tag, 0, 0)
    path = own if os.path.exists(own) else first
    if not os.path.exists(path):
        return 0, None
    # host memory: only the tick and delta are read, and another stage's tensors may name another device
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    delta = state.get("delta") if path == own and state.get("stages") == stages else None
    return int(state.get("tick", 0)), delta
