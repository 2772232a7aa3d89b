"""Per-stage W&B runs for an FDG job: every rank logs what its stage did in each call, in one group.

Turned on by DeepSpeed's own block, ``"wandb": {"enabled": true, "project": ..., "group": ...,
"team": ...}``. DeepSpeed keeps logging ``Train/Samples/train_loss`` and ``lr`` from global rank 0
into its run; in addition every rank opens a run named ``stage{k}-dp{r}`` in the same group and
logs once per ``train_batch()`` / ``drain()`` (keys in :data:`METRICS`). Nothing here talks to
another rank after start-up: the group name is agreed once, at engine construction.

Not logged in (no ``WANDB_API_KEY``, no netrc entry) and ``WANDB_MODE`` unset → offline, with the
``wandb sync`` command printed once on global rank 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import netrc
import os
import secrets
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.schedule import ReduceGrads

from fdg_schedule.observability.view import MicroBatchNumbers, StageView
from fdg_schedule.sched import ticks
from fdg_schedule.sched.schedule import FDGBackward, Kind, LocalOptimizerStep

# Seconds per tick, averaged over the call: what each kind of instruction took (StageView.stats).
_KINDS = [kind.value for kind in Kind]

METRICS = {
    "fdg/tick": "ticks this stage has run (x axis of every fdg/ chart; equals global_steps)",
    "fdg/samples": "samples trained on (DeepSpeed's global_samples)",
    "fdg/tick_s": "seconds per tick, averaged over the call",
    "fdg/compute_s": "forward + backward + optimizer step seconds per tick",
    "fdg/wait_s": "seconds per tick waiting for a neighbour's activation or gradient",
    "fdg/wait_fraction": "wait_s / tick_s",
    **{f"fdg/{kind}_s": f"{kind} seconds per tick" for kind in _KINDS if kind != "wait"},
    "fdg/grad_norm": "L2 norm of the stage's gradient at its last optimizer step in the call",
    "fdg/lr": "learning rate after the call",
    "fdg/delay": "staleness: ticks between this stage's forward and backward of a micro-batch",
    "fdg/staleness": "||w_fwd - w_bwd|| / ||w_bwd|| of the latest measured micro-batch (pipeline.fdg.staleness_every)",
    "fdg/lr_factor": "the delay-aware learning rate's factor at the call's last tick (pipeline.fdg.delay_lr_ticks)",
    "fdg/held_bytes": "bytes held for delayed backward passes after the call",
    "fdg/in_flight": "micro-batches forwarded but not yet back-propagated",
    "fdg/steps": "optimizer steps taken so far",
    "fdg/skipped": "optimizer steps skipped so far (non-finite loss or gradient; fp16: overflows)",
    "fdg/loss_scale": "fp16: the loss scale of the stage's last step's gradients (last stage: of its last loss)",
    "fdg/loss": "mean loss of the micro-batches back-propagated in the call (what train_batch() returned)",
    "fdg/loss_last": "loss of the newest micro-batch back-propagated in the call",
    "fdg/loss_micro_batch": "run-wide index of that micro-batch (0 = the first that entered stage 0)",
    "fdg/memory_allocated": "bytes allocated on the stage's device now (DeepSpeed's accelerator API; RSS on CPU)",
    "fdg/max_memory_allocated": "peak bytes allocated on the stage's device so far (the same; peak RSS on CPU)",
}

_hint_printed = False


def wandb_block(ds_config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """DeepSpeed's ``wandb`` block when it is enabled, else None."""
    block = ds_config.get("wandb") or {}
    return block if block.get("enabled", False) else None


def prepare(ds_config: Mapping[str, Any]) -> str:
    """Pick the W&B mode and the group every rank's run joins; returns the group (idempotent).

    Group: ``wandb.group`` in ds_config, else ``WANDB_RUN_GROUP``, else ``fdg-<time>-<random>``
    made on global rank 0 and broadcast once over the world (every rank calls this while it builds
    its engine). The group is exported as ``WANDB_RUN_GROUP`` so that a W&B run started later in
    the process (DeepSpeed's own, on rank 0) lands in it too.
    """
    block = wandb_block(ds_config) or {}
    _default_offline()
    group = block.get("group") or os.environ.get("WANDB_RUN_GROUP") or _shared_group_name()
    os.environ["WANDB_RUN_GROUP"] = group
    return group


def _default_offline() -> None:
    global _hint_printed
    if os.environ.get("WANDB_MODE") or _logged_in():
        return
    os.environ["WANDB_MODE"] = "offline"
    if _global_rank() == 0 and not _hint_printed:
        _hint_printed = True
        where = Path(os.environ.get("WANDB_DIR") or ".") / "wandb"
        print(
            f"fdg_schedule: not logged in to W&B, logging offline under {where}; upload later with\n"
            f"  wandb sync {where}/offline-run-*\n"
            "(set WANDB_MODE=online after `wandb login`, or WANDB_MODE=disabled to turn W&B off)",
            flush=True,
        )


def _logged_in() -> bool:
    """An API key in the environment or a netrc entry for the W&B host (how `wandb login` stores it)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _shared_group_name() -> str:
    name = f"fdg-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [name]
        torch.distributed.broadcast_object_list(box, src=0)  # init time: once, every rank
        name = box[0]
    return name


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def run_config(view: StageView, ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """What goes into each stage's W&B run config: the FDG settings and the stage's place."""
    ids = view.ids
    return {
        "fdg": {k: v for k, v in dataclasses.asdict(view.config).items() if not k.startswith("_")},
        "stages": ids.num_stages,
        "stage_id": ids.stage_id,
        "dp_id": ids.dp_id,
        "dp_world_size": ids.dp_world_size,
        "global_rank": ids.global_rank,
        "delay": ticks.delay(ids.num_stages, ids.stage_id),
        "train_micro_batch_size_per_gpu": view.micro_batch_size,
        "gradient_accumulation_steps": view.gradient_accumulation_steps,
        "ds_config": dict(ds_config),
    }


class StageTracker:
    """An observer that logs one W&B history row per call for this rank's stage.

    The gradient norm is taken right after ``ReduceGrads`` (the step zeroes the gradients) and
    losses are kept as tensors until the call ends, so the ticks pay no device synchronisation.
    """

    def __init__(self, view: StageView, ds_config: Mapping[str, Any]) -> None:
        import wandb

        block = wandb_block(ds_config) or {}
        group = prepare(ds_config)
        self.run = wandb.init(
            project=block.get("project") or "deepspeed",
            entity=block.get("team"),
            group=group,
            name=f"stage{view.ids.stage_id}-dp{view.ids.dp_id}",
            job_type=f"stage{view.ids.stage_id}",
            config=run_config(view, ds_config),
            reinit="create_new",  # DeepSpeed's own rank-0 run stays wandb.run
        )
        self.run.define_metric("fdg/tick")
        self.run.define_metric("fdg/*", step_metric="fdg/tick")
        self.delay = ticks.delay(view.ids.num_stages, view.ids.stage_id)
        self.numbers = MicroBatchNumbers()
        self._stats = dict(view.stats)
        self._grad_norm: torch.Tensor | None = None
        self._last_loss: tuple[int, torch.Tensor] | None = None
        self._closed = False
        atexit.register(self.close)

    def on_instruction(self, view: StageView, cmd: Any, start: float, end: float) -> None:
        self.numbers.watch(cmd)
        if isinstance(cmd, ReduceGrads):  # the step zeroes the gradients: their norm now (unscaled, fp16)
            self._grad_norm = view.grad_norm()
        elif isinstance(cmd, LocalOptimizerStep) and self._grad_norm is None:
            # ZeRO keeps reduced gradients in its own partitions; its step computed the norm.
            norm = view.optimizer_grad_norm
            self._grad_norm = None if norm is None else torch.as_tensor(norm, dtype=torch.float32)
        elif isinstance(cmd, FDGBackward) and view.last_loss is not None:
            self._last_loss = (self.numbers(cmd.micro_batch), view.last_loss)

    def on_call_end(self, view: StageView, seconds: float) -> None:
        self.numbers.end_call()
        if self._closed:
            return
        self.run.log(self.row(view, seconds))
        self._grad_norm = None

    def row(self, view: StageView, seconds: float) -> dict[str, Any]:
        """The history row of the call that just ended (also updates the per-call baselines)."""
        stats, before = view.stats, self._stats
        ran = max(stats["ticks"] - before["ticks"], 1)
        per_tick = {kind: (stats[f"{kind}_s"] - before[f"{kind}_s"]) / ran for kind in _KINDS}
        self._stats = dict(stats)
        tick_s = seconds / ran
        row: dict[str, Any] = {
            "fdg/tick": view.global_steps,
            "fdg/samples": view.global_samples,
            "fdg/tick_s": tick_s,
            "fdg/compute_s": per_tick["forward"] + per_tick["backward"] + per_tick["step"],
            "fdg/wait_fraction": per_tick["wait"] / tick_s if tick_s > 0 else 0.0,
            **{f"fdg/{kind}_s": value for kind, value in per_tick.items()},
            "fdg/lr": view.lr,
            "fdg/delay": self.delay,
            "fdg/held_bytes": view.held_bytes,
            "fdg/in_flight": view.in_flight,
            "fdg/steps": int(stats["steps"]),
            "fdg/skipped": int(stats.get("skipped", 0)),
            "fdg/memory_allocated": get_accelerator().memory_allocated(),
            "fdg/max_memory_allocated": get_accelerator().max_memory_allocated(),
        }
        assert view.loss is not None, "a call's end comes after its loss"
        on_device = {"fdg/loss": view.loss}
        if view.loss_scale is not None:  # fp16 (Note [loss scale per stage] in fdg_schedule.precision.loss_scale)
            row["fdg/loss_scale"] = view.loss_scale
        staleness = stats.get("staleness", math.nan)
        if not math.isnan(staleness):  # measured every pipeline.fdg.staleness_every ticks
            row["fdg/staleness"] = staleness
        if view.lr_factor is not None:
            row["fdg/lr_factor"] = view.lr_factor
        if self._grad_norm is not None:
            on_device["fdg/grad_norm"] = self._grad_norm
        if self._last_loss is not None:
            micro_batch, on_device["fdg/loss_last"] = self._last_loss
            row["fdg/loss_micro_batch"] = micro_batch
            self._last_loss = None
        # One host read for the call's device values (Note [no host sync in a tick] in fdg_schedule.base.guards).
        values = torch.stack([t.detach().float().reshape(()) for t in on_device.values()]).tolist()
        row.update((key, value) for key, value in zip(on_device, values) if not math.isnan(value) or key != "fdg/loss")
        return row

    def close(self) -> None:
        """Finish the run (also at interpreter exit); later calls are not logged."""
        if not self._closed:
            self._closed = True
            self.run.finish()


def read_offline_run(run_dir: Path) -> dict[str, Any]:
    """Name, group, config and history rows of an offline W&B run (its ``offline-run-*`` folder).

    Reads the run's ``run-*.wandb`` file without W&B's service or a network: what a stage logged is
    readable on the machine that trained (``benchmarks/studies/staleness_metric.py``, the tests), before any
    ``wandb sync``.

    The file is W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of records, each with
    a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a ``Record`` proto.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(run_dir.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {run_dir}: pass a W&B offline-run-* folder")
    data = files[0].read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{files[0]} does not start with W&B's ':W&B' header; is it a W&B run log?")
    payloads: list[bytes] = []
    pending, pos, block = b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the block end
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            payloads.append(pending)
    out: dict[str, Any] = {"config": {}, "history": []}
    for payload in payloads:
        record = pb.Record()  # type: ignore[attr-defined]  # generated protobuf module, no stubs
        record.ParseFromString(payload)
        which = record.WhichOneof("record_type")
        if which == "run":
            out.update(name=record.run.display_name, group=record.run.run_group)
            items = record.run.config.update
        elif which == "config":
            items = record.config.update
        elif which == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            out["history"].append(row)
            continue
        else:
            continue
        for item in items:
            out["config"][item.key] = json.loads(item.value_json)
    return out
