"""FDG's in-flight state inside DeepSpeed checkpoints: what each rank saves beside DeepSpeed's files.

DeepSpeed saves weights (per layer), optimizer, LR scheduler and counters per stage. FDG adds, per
stage and data-parallel rank, ``<save_dir>/<tag>/fdg_stage{k:02d}_dp{r:03d}.pt``: the micro-batches
in flight (stage input, RNG state, saved activations or weight snapshot; see
:mod:`fdg_schedule.delayed`), the messages received for the next tick (activation, gradient and
the loss carried upstream), the labels the last stage holds for micro-batches still on their way,
the segment tick, the data position and this rank's RNG state. A run that saves at tick T and
resumes from the checkpoint computes, from tick T on, bit for bit what it would have computed
without stopping -- given its data iterators restart at micro-batch T, as in stock DeepSpeed.

Writes are atomic (temporary file, then rename), and ``latest`` is rewritten only after every rank
has finished writing, so an interrupted save never leaves ``latest`` pointing at a partial checkpoint.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

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


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def why_not_resumable(state: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why a saved FDG state cannot continue in this job (None if it can)."""
    if state.get("format") != FORMAT:
        return f"checkpoint FDG state format {state.get('format')!r}, this version reads {FORMAT}"
    for key, value in expected.items():
        if state.get(key) != value:
            return f"checkpoint has {key}={state.get(key)!r}, this job {key}={value!r}"
    return None
