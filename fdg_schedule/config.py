"""The ``pipeline.fdg`` config block: a frozen dataclass read from the DeepSpeed JSON, validated once.

The public keys::

    "pipeline": {
      "schedule": "fdg",              # "fdg" | "1f1b"; absent = "1f1b" (stock DeepSpeed)
      "fdg": {
        "grad_shrink": 0.5,           # beta in (0, 1]; default 1.0
        "weights": "current",         # "current" | "stashed"
        "activations": "stored",      # "stored" | "recomputed"
        "accumulate": 1,              # backward passes per optimizer step, >= 1
        "nonfinite": "error",         # "error" | "skip": a non-finite loss or gradient on a stage
        "timeout": 60,                # seconds a stage waits for a neighbour before failing
        "check_every": 0,             # ticks between host reads of the non-finite flags; 0 = once per call
        "trace": null                 # {"start_tick": 0, "ticks": 64, "dir": "fdg_trace"}: a timeline
      }
    }

:func:`check_deepspeed_config` also rejects DeepSpeed settings FDG cannot honour, so that every
rank raises the same error inside ``deepspeed.initialize`` before any rank waits on another.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SCHEDULES = ("1f1b", "fdg")
WEIGHTS = ("current", "stashed")
ACTIVATIONS = ("stored", "recomputed")
NONFINITE = ("error", "skip")
TRACE_KEYS = {"start_tick": 0, "ticks": 64, "dir": "fdg_trace"}


class FDGConfigError(ValueError):
    """A ``pipeline`` / ``pipeline.fdg`` setting FDG cannot run with; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class FDGConfig:
    """How the FDG schedule trains. Defaults are the paper's algorithm without gradient shrinking."""

    grad_shrink: float = 1.0
    """beta: the gradient entering each non-last stage is multiplied by it, so stage k's gradient
    carries ``grad_shrink ** (K-1-k)``. In (0, 1]."""

    weights: str = "current"
    """Weights the delayed backward differentiates through: ``"current"`` (values at backward time,
    what the authors' code computed) or ``"stashed"`` (the weights the forward used: the exact
    delayed gradient; costs one copy of the stage's weights per micro-batch in flight)."""

    activations: str = "stored"
    """``"stored"`` keeps the forward's autograd graph until the delayed backward; ``"recomputed"``
    keeps only the stage input and RNG state and reruns the forward at backward time."""

    accumulate: int = 1
    """Backward passes per optimizer step on every stage (1 = the paper; >1 = accumulated
    decoupled learning, gradients averaged over the passes)."""

    nonfinite: str = "error"
    """A non-finite loss or gradient on a stage: ``"error"`` stops with an error naming the stage and
    tick; ``"skip"`` drops that stage's optimizer step (counted in ``engine.fdg_stats["skipped"]``)."""

    timeout: float = 60.0
    """Seconds a stage waits for a neighbour's message before it fails with an error naming the
    neighbour (a rank that died or stopped sending)."""

    check_every: int = 0
    """Ticks between host reads of the non-finite flags (Note [no host sync in a tick] in
    :mod:`fdg_schedule.guards`): 0 reads them once, at the end of each ``train_batch()`` / ``drain()``
    call; N >= 1 also every N ticks inside a call (an earlier stop, one host synchronisation each)."""

    trace: Mapping[str, Any] | None = None
    """Opt-in timeline of per-stage events: ``{"start_tick": 0, "ticks": 64, "dir": "fdg_trace"}``
    (any key may be omitted); None records nothing."""

    def __post_init__(self) -> None:
        _check_number("grad_shrink", self.grad_shrink, float)
        if not 0.0 < self.grad_shrink <= 1.0 or math.isnan(self.grad_shrink):
            raise FDGConfigError(
                f"grad_shrink must be in (0, 1], got {self.grad_shrink!r} (pipeline.fdg.grad_shrink in "
                "ds_config); 1.0 disables gradient shrinking"
            )
        _check_choice("weights", self.weights, WEIGHTS)
        _check_choice("activations", self.activations, ACTIVATIONS)
        _check_number("accumulate", self.accumulate, int)
        if self.accumulate < 1:
            raise FDGConfigError(
                f"accumulate must be an integer >= 1, got {self.accumulate!r} "
                "(pipeline.fdg.accumulate in ds_config); 1 steps after every backward pass"
            )
        _check_choice("nonfinite", self.nonfinite, NONFINITE)
        _check_number("timeout", self.timeout, float)
        if not self.timeout > 0:
            raise FDGConfigError(
                f"timeout must be > 0 seconds, got {self.timeout!r} (pipeline.fdg.timeout in ds_config)"
            )
        _check_number("check_every", self.check_every, int)
        if self.check_every < 0:
            raise FDGConfigError(
                f"check_every must be an integer >= 0, got {self.check_every!r} (pipeline.fdg.check_every in "
                "ds_config); 0 reads the non-finite flags once per train_batch() call"
            )
        if self.trace is not None:
            object.__setattr__(self, "trace", _check_trace(self.trace))

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None) -> FDGConfig:
        """Build from the ``pipeline.fdg`` dict, rejecting unknown keys."""
        block = {} if block is None else block
        if not isinstance(block, Mapping):
            raise FDGConfigError(f"pipeline.fdg must be a JSON object, got {type(block).__name__} {block!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise FDGConfigError(f"unknown key(s) {unknown} in pipeline.fdg of ds_config; known keys: {known}")
        return cls(**block)


def schedule_name(pipeline: Mapping[str, Any] | None) -> str:
    """The schedule a ``pipeline`` block asks for: ``"fdg"`` or ``"1f1b"`` (the default)."""
    name = (pipeline or {}).get("schedule", "1f1b")
    if not isinstance(name, str) or name.lower() not in SCHEDULES:
        raise FDGConfigError(
            f"pipeline.schedule must be one of {list(SCHEDULES)}, got {name!r} (ds_config); "
            "omit it for DeepSpeed's own 1F1B schedule"
        )
    return name.lower()


def parse(ds_config: Mapping[str, Any]) -> FDGConfig | None:
    """The FDG settings of a whole DeepSpeed config dict, or None when it does not ask for FDG.

    Raises :class:`FDGConfigError` for a bad ``pipeline`` block or a DeepSpeed setting FDG cannot
    run with (see :func:`check_deepspeed_config`).
    """
    pipeline = ds_config.get("pipeline") or {}
    if schedule_name(pipeline) != "fdg":
        if "fdg" in pipeline:
            raise FDGConfigError(
                'pipeline.fdg is set but pipeline.schedule is not "fdg"; add "schedule": "fdg" '
                "to the pipeline block, or remove pipeline.fdg to train with 1F1B"
            )
        return None
    fdg = FDGConfig.from_dict(pipeline.get("fdg"))
    check_deepspeed_config(ds_config)
    return fdg


def check_deepspeed_config(ds_config: Mapping[str, Any]) -> None:
    """Reject DeepSpeed settings that would need a cross-stage synchronisation every tick."""
    fp16 = ds_config.get("fp16") or {}
    if fp16.get("enabled", False):
        raise FDGConfigError(
            'fp16.enabled=true is not supported with pipeline.schedule="fdg": the loss scale would '
            'have to agree across stages every tick; use bf16 ("bf16": {"enabled": true}) or fp32'
        )
    if (ds_config.get("amp") or {}).get("enabled", False):
        raise FDGConfigError('amp.enabled=true is not supported with pipeline.schedule="fdg"; use bf16 or fp32')
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1):
        raise FDGConfigError(
            f'zero_optimization.stage={stage!r} is not supported with pipeline.schedule="fdg" '
            "(DeepSpeed pipelines allow ZeRO 0 or 1); set zero_optimization.stage to 1 to shard "
            "optimizer state"
        )
    if "gradient_accumulation_dtype" in (ds_config.get("data_types") or {}):
        dtype = ds_config["data_types"]["gradient_accumulation_dtype"]
        if dtype not in ("fp32", "float32", "torch.float32"):
            raise FDGConfigError(
                f"data_types.gradient_accumulation_dtype={dtype!r} is not supported with FDG; "
                "remove it (fp32 accumulation)"
            )


def _check_trace(trace: Any) -> dict[str, Any]:
    if not isinstance(trace, Mapping):
        raise FDGConfigError(f"trace must be a JSON object or null, got {trace!r} (pipeline.fdg.trace in ds_config)")
    unknown = sorted(set(trace) - set(TRACE_KEYS))
    if unknown:
        raise FDGConfigError(f"unknown key(s) {unknown} in pipeline.fdg.trace; known keys: {sorted(TRACE_KEYS)}")
    merged = {**TRACE_KEYS, **trace}
    for key in ("start_tick", "ticks"):
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "ticks" else 0):
            raise FDGConfigError(
                f"trace.{key} must be an integer >= {1 if key == 'ticks' else 0}, got {value!r} "
                f"(pipeline.fdg.trace.{key} in ds_config)"
            )
    if not isinstance(merged["dir"], str):
        raise FDGConfigError(f"trace.dir must be a path string, got {merged['dir']!r} (pipeline.fdg.trace.dir)")
    return merged


def _check_number(key: str, value: Any, kind: type) -> None:
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok:
        raise FDGConfigError(
            f"{key} must be {'a number' if kind is float else 'an integer'}, got "
            f"{type(value).__name__} {value!r} (pipeline.fdg.{key} in ds_config)"
        )


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FDGConfigError(f"{key} must be one of {list(choices)}, got {value!r} (pipeline.fdg.{key} in ds_config)")
