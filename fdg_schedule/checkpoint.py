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

import functools
import glob
import os
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.utils import logger

from fdg_schedule import ticks
from fdg_schedule.delayed import Held

if TYPE_CHECKING:
    from fdg_schedule.engine import FDGPipelineEngine

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


def identity(engine: FDGPipelineEngine) -> dict[str, Any]:
    """What must match for in-flight work to continue: layout and modes."""
    return {
        "stages": engine.num_stages,
        "data_parallel": engine.dp_world_size,
        "weights": engine.fdg_config.weights,
        "activations": engine.fdg_config.activations,
    }


def capture(engine: FDGPipelineEngine) -> dict[str, Any]:
    """This rank's in-flight FDG state, between ``train_batch()`` calls."""
    in_flight = {
        buffer_id: {
            "inputs": _detached(engine.pipe_buffers["inputs"][buffer_id]),
            "rng_state": held.rng_state,
            "weights": held.weights,
            "saved": None if held.saved is None else [t.detach() for t in held.saved],
            "sent_meta": engine._sent_meta.get(buffer_id),
        }
        for buffer_id, held in engine._delayed.held.items()
    }
    return {
        "format": FORMAT,
        **identity(engine),
        "segment_tick": engine.segment_tick,
        "in_flight": in_flight,
        "received": engine._exchange.received(),
        "labels_in_flight": list(engine.labels_in_flight),
        "micro_batches_read": engine.micro_batches_read,
        "rng": rng_state(),
    }


def restore(engine: FDGPipelineEngine, load_dir: str, tag: str) -> None:
    """Undo :func:`capture` in a new process, or drop the in-flight work with a log line saying why."""
    engine._reset_pipeline()
    path = state_path(load_dir, tag, engine.stage_id, engine.grid.data_parallel_id)
    state = torch.load(path, weights_only=False) if os.path.exists(path) else None
    if state is None:
        reason: str | None = "it holds no FDG state for this stage (a 1F1B checkpoint or another layout)"
    else:
        reason = why_not_resumable(state, identity(engine))
    if reason is not None:
        if engine.global_rank == 0:
            first = state_path(load_dir, tag, 0, 0)
            dropped = len(torch.load(first, weights_only=False)["in_flight"]) if os.path.exists(first) else 0
            logger.warning(
                f"fdg_schedule: dropped {dropped} in-flight micro-batches from checkpoint {tag} ({reason}); "
                "the pipeline fills again from the next train_batch()"
            )
        return
    assert state is not None
    engine.segment_tick = state["segment_tick"]
    engine._reserve_pipe_buffers(ticks.num_buffers(engine.num_stages, engine.stage_id))
    needs_grad = not engine.is_first_stage() or engine._reentrant_activation_checkpointing()
    for buffer_id, record in sorted(state["in_flight"].items()):
        inputs = _leaves(record["inputs"], needs_grad)
        engine.pipe_buffers["inputs"][buffer_id] = inputs
        engine._sent_meta[buffer_id] = record["sent_meta"]
        held = Held(weights=record["weights"], rng_state=record["rng_state"], saved=record["saved"])
        engine.pipe_buffers["outputs"][buffer_id] = engine._delayed.rebuild(
            buffer_id, held, functools.partial(engine._stage_forward, inputs)
        )
    engine._exchange.restore_received(state["received"])
    engine.labels_in_flight.extend(state["labels_in_flight"])
    engine.micro_batches_read = state["micro_batches_read"]
    if engine.training_data is not None and (engine.is_first_stage() or engine.is_last_stage()):
        # The engine's own loader: continue after the micro-batches read before the save.
        engine._build_data_iter(engine.training_data)
        for _ in range(engine.micro_batches_read):
            engine._next_batch()
    set_rng_state(state["rng"])


def _detached(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach()
    return tuple(_detached(t) for t in x) if isinstance(x, (tuple, list)) else x


def _leaves(x: Any, requires_grad: bool) -> Any:
    if torch.is_tensor(x):
        return x.detach().requires_grad_(requires_grad and x.is_floating_point())
    return tuple(_leaves(t, requires_grad) for t in x)
