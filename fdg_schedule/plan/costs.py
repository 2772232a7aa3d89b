"""What the planner knows about a model: per-layer times and sizes, read from a profile, a trace or an estimate.

The layer fields are those of the profiler's JSON (``fdg_schedule.partitioning.profile``, format
``fdg_schedule.profile/1``), per micro-batch of ``micro_batch`` samples:

    forward_s      forward with autograd recording (stored activations, 1F1B, GPipe, ...)
    backward_s     backward of the layer (input and weight gradients)
    recompute_s    the forward without autograd a recomputing FDG stage runs when the micro-batch
                   arrives (the rerun with autograd at backward time costs ``forward_s``)
    step_s         optimizer step on the layer's parameters
    param_bytes    the layer's parameters
    activation_bytes  its output (what crosses a stage boundary cut after this layer)
    saved_bytes    what autograd keeps for its backward (parameters excluded)

Note [planner profile loader]: :func:`load_profile` reads the format ``fdg_schedule.partitioning.profile`` writes,
with dataclasses of the same field names. They are still two copies: ``fdg_schedule.partitioning.profile`` imports
torch at module level and holds integer byte counts, the planner is torch-free and takes fractional
FLOP-based estimates. The follow-up is one torch-free format module that both import.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fdg_schedule.sched.kinds import Kind

PROFILE_FORMAT = "fdg_schedule.profile/1"
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float64": 8}


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one layer costs per micro-batch (seconds and bytes)."""

    name: str
    forward_s: float
    backward_s: float
    recompute_s: float
    step_s: float
    param_bytes: float
    activation_bytes: float
    saved_bytes: float

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "name":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"layer {self.name!r}: {field.name} must be a finite number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """Per-layer costs of one model at one micro-batch size, device and dtype."""

    layers: tuple[LayerCost, ...]
    micro_batch: int
    """Samples per micro-batch the costs are for."""
    device: str
    """Where they were measured or for which device they were estimated (``"cpu"``, ``"H100"``...)."""
    dtype: str
    """Floating dtype of weights and activations (``"float32"``, ``"bfloat16"``)."""
    input_bytes: float = 0
    """Bytes of one micro-batch's input to layer 0 (what a recomputing stage 0 holds per micro-batch)."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Where the numbers come from (file, trace, estimate assumptions)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model profile needs at least one layer, got none")
        if not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the profile's dtype (4 if unknown)."""
        return DTYPE_BYTES.get(self.dtype.removeprefix("torch."), 4)

    def input_bytes_of(self, layer: int) -> float:
        """Bytes a stage starting at ``layer`` receives per micro-batch."""
        return self.input_bytes if layer == 0 else self.layers[layer - 1].activation_bytes

    def scaled(self, time_factor: float) -> ModelProfile:
        """The same model with every time multiplied by ``time_factor`` (a calibration)."""
        scale = ("forward_s", "backward_s", "recompute_s", "step_s")
        layers = tuple(
            dataclasses.replace(layer, **{k: getattr(layer, k) * time_factor for k in scale}) for layer in self.layers
        )
        return dataclasses.replace(self, layers=layers, meta={**self.meta, "time_factor": time_factor})


def profile_from_dict(data: Any, source: str = "profile") -> ModelProfile:
    """A profile from the profiler's JSON object; a missing or bad field is an error naming ``source``."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a profile must be a JSON object, got {type(data).__name__}")
    fmt = data.get("format", PROFILE_FORMAT)
    if fmt != PROFILE_FORMAT:
        raise ValueError(f"{source}: format {fmt!r} is not {PROFILE_FORMAT!r}; re-profile with this version")
    missing = [key for key in ("layers", "micro_batch", "device", "dtype") if key not in data]
    if missing:
        raise ValueError(f"{source}: missing key(s) {missing}; a profile has layers, micro_batch, device, dtype")
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise ValueError(f"{source}: 'layers' must be a non-empty list, got {data['layers']!r:.80}")
    fields = [f.name for f in dataclasses.fields(LayerCost)]
    layers = []
    for i, layer in enumerate(data["layers"]):
        absent = [key for key in fields if key not in layer]
        if absent:
            raise ValueError(f"{source}: layer {i} lacks {absent} (each layer needs {fields})")
        try:
            layers.append(LayerCost(**{k: layer[k] for k in fields}))
        except ValueError as error:
            raise ValueError(f"{source}: layer {i}: {error}") from None
    micro_batch = data["micro_batch"]
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
        raise ValueError(f"{source}: micro_batch must be an integer >= 1, got {micro_batch!r}")
    return ModelProfile(
        layers=tuple(layers),
        micro_batch=micro_batch,
        device=str(data["device"]),
        dtype=str(data["dtype"]),
        input_bytes=float(data.get("input_bytes", 0)),
        meta={**dict(data.get("meta", {})), "source": source},
    )


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile JSON written by the profiler (or by ``python -m fdg_schedule.plan --save-profile``)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"no profile at {path}; pass the JSON the layer profiler wrote") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a JSON layer profile ({error})") from None
    return profile_from_dict(data, source=str(path))


def profile_to_dict(profile: ModelProfile) -> dict[str, Any]:
    """The profiler's JSON form of ``profile``."""
    return {
        "format": PROFILE_FORMAT,
        "micro_batch": profile.micro_batch,
        "device": profile.device,
        "dtype": profile.dtype,
        "input_bytes": profile.input_bytes,
        "meta": profile.meta,
        "layers": [dataclasses.asdict(layer) for layer in profile.layers],
    }


def profile_from_trace(
    trace: dict[str, Any],
    activation_bytes: Sequence[float] = (),
    param_bytes: Sequence[float] = (),
    micro_batch: int = 1,
    source: str = "trace",
) -> ModelProfile:
    """One "layer" per traced stage, timed by the medians of its forward, backward and step events.

    A trace (``pipeline.fdg.trace``, merged by ``python -m fdg_schedule.observability.timeline merge``) has times
    but no sizes: ``activation_bytes[k]`` (stage k's output) and ``param_bytes[k]`` default to 0.
    The planner can then re-time that split under other schedules and clusters, but not re-split it.
    """
    ranks = trace.get("otherData", {}).get("ranks")
    if not ranks:
        raise ValueError(f"{source}: no 'otherData.ranks'; merge the per-rank parts with "
                         "`python -m fdg_schedule.observability.timeline merge <dir>` first")  # fmt: skip
    stage_of = {int(rank): int(meta["stage_id"]) for rank, meta in ranks.items()}
    stages = max(stage_of.values()) + 1
    timed = (Kind.FORWARD.value, Kind.BACKWARD.value, Kind.STEP.value)  # the trace's "cat" is the instruction's kind
    kinds: dict[tuple[int, str], list[float]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in timed:
            continue
        key = (stage_of[int(event["pid"])], event["cat"])
        kinds.setdefault(key, []).append(event["dur"] * 1e-6)
    layers = []
    for k in range(stages):
        missing = [kind for kind in timed[:2] if (k, kind) not in kinds]
        if missing:
            raise ValueError(f"{source}: stage {k} has no {missing} events; trace a window of steady ticks")
        median = {kind: statistics.median(kinds.get((k, kind), [0.0])) for kind in timed}
        layers.append(
            LayerCost(
                name=f"stage{k}",
                forward_s=median[Kind.FORWARD.value],
                backward_s=median[Kind.BACKWARD.value],
                recompute_s=median[Kind.FORWARD.value],
                step_s=median[Kind.STEP.value],
                param_bytes=param_bytes[k] if k < len(param_bytes) else 0,
                activation_bytes=activation_bytes[k] if k < len(activation_bytes) else 0,
                saved_bytes=0,
            )
        )
    schedule = trace["otherData"].get("schedule")
    return ModelProfile(
        layers=tuple(layers),
        micro_batch=micro_batch,
        device="trace",
        dtype="float32",
        meta={"source": source, "traced_schedule": schedule, "stages": stages},
    )
