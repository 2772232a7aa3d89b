"""The layer-profile file both the profiler and the planner read and write: per-layer costs of a pipeline model.

Torch-free (the planner imports it with no torch installed). :mod:`fdg_schedule.partitioning.profile` measures a
:class:`ModelProfile` on a device, :mod:`fdg_schedule.plan.costs` estimates one from FLOPs or a trace;
:mod:`fdg_schedule.partitioning.partition` and the planner balance it. The file is JSON::

    {"format": "fdg_schedule.profile/1", "micro_batch": 32, "device": "cpu", "dtype": "float32",
     "input_bytes": 393216, "key": "…", "meta": {…},
     "layers": [{"name": "CifarStem", "forward_s": …, "backward_s": …, "recompute_s": …,
                 "step_s": …, "params": 448, "param_bytes": 1792, "activation_bytes": …,
                 "saved_bytes": …, "optimizer_state_bytes": …}, …]}

What one layer costs per micro-batch of ``micro_batch`` samples:

    forward_s      forward with autograd recording (stored activations, 1F1B, GPipe, ...)
    backward_s     backward of the layer (input and weight gradients)
    recompute_s    the forward without autograd a recomputing FDG stage runs when the micro-batch
                   arrives (the rerun with autograd at backward time costs ``forward_s``)
    step_s         optimizer step on the layer's parameters
    param_bytes    the layer's parameters
    activation_bytes  its output (what crosses a stage boundary cut after this layer)
    saved_bytes    what autograd keeps for its backward (parameters excluded)
    params         trainable parameters (what DeepSpeed's "parameters" method balances); may be absent
    optimizer_state_bytes  the optimizer's state after one step; may be absent

``params``, ``optimizer_state_bytes``, ``input_bytes``, ``key`` and ``meta`` may be absent (read
as 0, empty): a profile the planner wrote (``python -m fdg_schedule.plan --save-profile``, from
FLOPs) has only the other eight layer fields. Sizes are whole bytes when measured and may be
fractional when estimated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

FORMAT = "fdg_schedule.profile/1"
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float64": 8}
REQUIRED = ("layers", "micro_batch", "device", "dtype")
MISSING_HINT = (
    "make one with fdg_schedule.partitioning.profile.cached_profile(layers, sample_batch, cache_dir) "
    "(see docs/performance.md)"
)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one layer costs per micro-batch (seconds and bytes); see the module docstring."""

    name: str
    forward_s: float
    backward_s: float
    recompute_s: float
    step_s: float
    param_bytes: float
    activation_bytes: float
    saved_bytes: float
    params: int = 0  # trainable parameters (what DeepSpeed's "parameters" method balances)
    optimizer_state_bytes: float = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "name":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"layer {self.name!r}: {field.name} must be a finite number >= 0, got {value!r}")


LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerCost))
LAYER_REQUIRED = tuple(f.name for f in dataclasses.fields(LayerCost) if f.default is dataclasses.MISSING)


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """Per-layer costs of one model at one micro-batch size on one device (or estimate) and dtype."""

    layers: tuple[LayerCost, ...]
    micro_batch: int
    """Samples per micro-batch the costs are for."""
    device: str
    """Where they were measured, e.g. ``"cpu"`` or ``"cuda:0"`` (``meta["device_name"]`` names the
    hardware), or for which device they were estimated (``"H100"``...)."""
    dtype: str
    """Floating dtype of weights and inputs, e.g. ``"float32"``, ``"bfloat16"``."""
    input_bytes: float = 0
    """Bytes of one micro-batch's input to layer 0 (what a recomputing stage 0 holds per micro-batch)."""
    key: str = ""
    """The profiler's cache key (``fdg_schedule.partitioning.profile.profile_key``): same key, same model, micro-batch,
    device, dtype and optimizer; empty for an estimate."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """How it was measured (repeats, warm-up, optimizer, threads, torch version, date) or estimated."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model profile needs at least one layer, got none")
        if not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool) or self.micro_batch < 1:
            raise ValueError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r}")

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

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

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see the module docstring)."""
        return {
            "format": FORMAT,
            "micro_batch": self.micro_batch,
            "device": self.device,
            "dtype": self.dtype,
            "input_bytes": self.input_bytes,
            "key": self.key,
            "meta": self.meta,
            "layers": [dataclasses.asdict(layer) for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> ModelProfile:
        """Read the JSON form; a missing or wrong field is an error naming ``source`` and the field."""
        return from_dict(data, source)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON atomically (a reader never sees half a file); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelProfile:
        """Read a profile file (the profiler's or the planner's); errors name the file and the field."""
        return load(path)


def from_dict(data: Any, source: str = "profile") -> ModelProfile:
    """A :class:`ModelProfile` from its JSON form; a missing or wrong field is an error naming ``source``."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a profile must be a JSON object, got {type(data).__name__}")
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"{source}: format {fmt!r} is not {FORMAT!r}; re-profile with this version")
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{source}: missing key(s) {missing}; a profile has layers, micro_batch, device, dtype")
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise ValueError(f"{source}: 'layers' must be a non-empty list, got {data['layers']!r:.80}")
    layers = []
    for i, layer in enumerate(data["layers"]):
        if not isinstance(layer, dict):
            raise ValueError(f"{source}: layer {i} must be a JSON object, got {layer!r:.80}")
        absent = [key for key in LAYER_REQUIRED if key not in layer]
        if absent:
            raise ValueError(f"{source}: layer {i} lacks {absent} (each layer needs {list(LAYER_REQUIRED)})")
        try:
            layers.append(LayerCost(**{k: v for k, v in layer.items() if k in LAYER_FIELDS}))
        except ValueError as error:
            raise ValueError(f"{source}: layer {i}: {error}") from None
    micro_batch = data["micro_batch"]
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
        raise ValueError(f"{source}: micro_batch must be an integer >= 1, got {micro_batch!r}")
    input_bytes = data.get("input_bytes", 0)
    if not isinstance(input_bytes, (int, float)) or isinstance(input_bytes, bool) or input_bytes < 0:
        raise ValueError(f"{source}: input_bytes must be a number >= 0, got {input_bytes!r}")
    return ModelProfile(
        layers=tuple(layers),
        micro_batch=micro_batch,
        device=str(data["device"]),
        dtype=str(data["dtype"]),
        input_bytes=input_bytes,
        key=str(data.get("key", "")),
        meta=dict(data.get("meta", {})),
    )


def load(path: str | os.PathLike[str], missing_hint: str = MISSING_HINT) -> ModelProfile:
    """Read a profile file; ``missing_hint`` says how to make one when there is none at ``path``."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"no layer profile at {path}; {missing_hint}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a JSON layer profile ({error})") from None
    return from_dict(data, source=str(path))
