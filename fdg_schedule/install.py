"""How ``deepspeed.initialize`` comes to build an :class:`FDGPipelineEngine`.

DeepSpeed has no engine registry: ``initialize`` looks up the name ``PipelineEngine`` in the
``deepspeed`` package when it is given a ``PipelineModule``. :func:`install` rebinds that name to
:class:`SelectPipelineEngine`, which validates the config on every rank (before any rank waits
on another) and builds the FDG engine when ``pipeline.schedule`` is ``"fdg"`` and DeepSpeed's own
``PipelineEngine``, untouched, otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import deepspeed
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule, TiedLayerSpec

from fdg_schedule import config as fdg_config
from fdg_schedule import observe
from fdg_schedule.config import FDGConfigError
from fdg_schedule.engine import FDGPipelineEngine

_lock = threading.RLock()


def build_pipeline_engine(*args: Any, **kwargs: Any) -> PipelineEngine:
    """Build the engine the config asks for (the arguments are ``PipelineEngine``'s)."""
    config_class = kwargs.get("config_class")
    ds_config = getattr(config_class, "_param_dict", None)
    if ds_config is None:
        raise FDGConfigError("fdg_schedule needs deepspeed.initialize to pass config_class (DeepSpeed >= 0.19)")
    fdg = fdg_config.parse(ds_config)
    if fdg is None:
        return PipelineEngine(*args, **kwargs)
    _check_module(kwargs.get("model"))
    observe.before_engine(ds_config)  # W&B offline unless logged in, one group for all stages
    return FDGPipelineEngine(*args, fdg_config=fdg, **kwargs)


def _check_module(model: Any) -> None:
    if not isinstance(model, PipelineModule):
        return
    if model._grid.get_slice_parallel_world_size() > 1:
        raise FDGConfigError(
            f"tensor (slice) model parallelism of size {model._grid.get_slice_parallel_world_size()} is not "
            'supported with pipeline.schedule="fdg"; use a PipeDataParallelTopology (pipeline x data '
            'parallel only) or train with pipeline.schedule="1f1b"'
        )
    parts = list(model.parts)
    empty = [stage for stage, (a, b) in enumerate(zip(parts[:-1], parts[1:])) if a == b]
    if empty:
        raise FDGConfigError(
            f"pipeline stages {empty} would hold no layers (partition {parts}): {len(parts) - 1} stages but "
            f"{parts[-1]} layers; use at most {parts[-1]} stages (the number of ranks / data-parallel size) or "
            "split the model into more layers"
        )
    specs = getattr(model, "_layer_specs", [])
    for key in {spec.key for spec in specs if isinstance(spec, TiedLayerSpec)}:
        stages = sorted(
            {model.stage_owner(i) for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and s.key == key}
        )
        if len(stages) > 1:
            raise FDGConfigError(
                f"tied layer {key!r} spans pipeline stages {stages}: FDG cannot keep tied weights equal "
                "without a cross-stage sync every tick; use separate (untied) layers, or keep every "
                'TiedLayerSpec with this key on one stage, or train with pipeline.schedule="1f1b"'
            )


class _SelectingMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> PipelineEngine:
        return build_pipeline_engine(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, PipelineEngine)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, PipelineEngine)


class SelectPipelineEngine(metaclass=_SelectingMeta):
    """Stands in for ``deepspeed.PipelineEngine``: ``isinstance`` checks against it still hold."""


def install() -> None:
    """Route ``deepspeed.initialize`` through :func:`build_pipeline_engine` (idempotent)."""
    with _lock:
        deepspeed.PipelineEngine = SelectPipelineEngine


def uninstall() -> None:
    """Give ``deepspeed.initialize`` back DeepSpeed's own ``PipelineEngine``."""
    with _lock:
        deepspeed.PipelineEngine = PipelineEngine


def installed() -> bool:
    return deepspeed.PipelineEngine is SelectPipelineEngine


@contextlib.contextmanager
def _installed_for_call() -> Iterator[None]:
    with _lock:
        was = installed()
        install()
        try:
            yield
        finally:
            if not was:
                uninstall()


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize`` that honours ``pipeline.schedule`` without a global side effect.

    Same arguments and return value as ``deepspeed.initialize``; ``deepspeed.PipelineEngine`` is
    rebound only for the duration of the call.
    """
    with _installed_for_call():
        return deepspeed.initialize(*args, **kwargs)
