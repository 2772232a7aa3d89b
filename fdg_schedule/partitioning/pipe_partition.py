"""``PipelineModule(partition_method=...)`` values that split by measured time: "balanced:<profile>", "parts:".

DeepSpeed 0.19.8 knows ``"parameters"``, ``"uniform"`` and ``"type:<regex>"`` and raises
NotImplementedError for any other value (``PipelineModule._partition_layers``). :func:`install`
(run by ``import fdg_schedule``) wraps that method: the values below are handled here, and every
other value goes to DeepSpeed's own code, untouched (same boundaries, same printout).

    "balanced:<profile.json>"                      the split with the least predicted bottleneck
    "balanced:<profile.json>?activations=recomputed&memory_mib=8000"
                                                   ... for another objective (keys below)
    "parts:0,7,18"                                 exactly these boundaries (DeepSpeed's ``parts`` form)

Keys after ``?``, ``&``-separated (all optional; the defaults balance FDG with stored activations,
which is also 1F1B's split): ``schedule`` (``fdg`` | ``1f1b``), ``activations``, ``weights``,
``accumulate``, ``micro_batches`` (1F1B's ``gradient_accumulation_steps``), ``memory_mib`` (the
limit per stage), ``delay_weight`` (alpha: the most delayed stages get fewer layers, Note [the delay-weighted
split] in :mod:`fdg_schedule.partitioning.partition`). :func:`balanced_method` writes them from a DeepSpeed
config (all but ``delay_weight``). The profile is a
:class:`~fdg_schedule.partitioning.profile.ModelProfile` file (:func:`~fdg_schedule.partitioning.profile.cached_profile`
makes one); its layer names must match the module's layers.

Global rank 0 logs the boundaries and each stage's predicted time and memory, and what DeepSpeed's
``"parameters"`` split would predict; the chosen :class:`~fdg_schedule.partitioning.partition.Partition` is
kept as ``module.partition_plan`` for :mod:`fdg_schedule.tools.stage_times` to compare with measured times.
"""

from __future__ import annotations

import functools
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fdg_schedule.partitioning.partition import (
    Objective,
    Partition,
    balanced_partition,
    evaluate_partition,
    parameter_split,
)
from fdg_schedule.partitioning.profile import ModelProfile, cached_profile, layer_name, optimizer_from_ds_config

BALANCED = "balanced"
PARTS = "parts:"
_KEYS = ("schedule", "activations", "weights", "accumulate", "micro_batches", "memory_mib", "delay_weight")
_lock = threading.Lock()

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.module import PipelineModule

# Note [imported before deepspeed]: this module imports DeepSpeed inside its functions only. Importing
# DeepSpeed runs fdg_schedule's import hook (install.guard), which calls install() below; had this module
# imported DeepSpeed at its top, a program whose first import is this module (or partition / profile,
# which it imports) would reach install() while this module is still half-imported (AttributeError).


def install() -> None:
    """Teach ``PipelineModule`` the ``"balanced:"`` and ``"parts:"`` methods (idempotent)."""
    from deepspeed.runtime.pipe.module import PipelineModule

    with _lock:
        current = PipelineModule._partition_layers
        if getattr(current, "_fdg_original", None) is not None:
            return

        @functools.wraps(current)
        def _partition_layers(self: PipelineModule, method: str = "uniform") -> None:
            if isinstance(method, str) and is_ours(method):
                _apply(self, method)
            else:
                current(self, method=method)

        _partition_layers._fdg_original = current  # type: ignore[attr-defined]
        PipelineModule._partition_layers = _partition_layers


def uninstall() -> None:
    """Give ``PipelineModule`` back DeepSpeed's own ``_partition_layers``."""
    from deepspeed.runtime.pipe.module import PipelineModule

    with _lock:
        original = getattr(PipelineModule._partition_layers, "_fdg_original", None)
        if original is not None:
            PipelineModule._partition_layers = original


def is_ours(method: str) -> bool:
    lowered = method.lower()
    return lowered == BALANCED or lowered.startswith(BALANCED + ":") or lowered.startswith(PARTS)


def balanced_method(
    profile: str | Path, ds_config: Mapping[str, Any] | None = None, memory_limit_mib: float | None = None
) -> str:
    """The ``partition_method`` string that balances ``profile`` for the schedule and modes of ``ds_config``.

    Checks that the profile was measured with the config's micro-batch size (when the config names it).
    """
    objective = Objective.from_ds_config(ds_config) if ds_config is not None else Objective()
    micro = (ds_config or {}).get("train_micro_batch_size_per_gpu")
    if micro is not None:
        measured = ModelProfile.load(profile).micro_batch
        if measured != int(micro):
            raise ValueError(
                f"the layer profile {profile} was measured with micro-batches of {measured} samples but "
                f"train_micro_batch_size_per_gpu is {micro}; profile again with a micro-batch of {micro}"
            )
    query: dict[str, Any] = {}
    defaults = Objective()
    for key in ("schedule", "activations", "weights", "accumulate"):
        if getattr(objective, key) != getattr(defaults, key):
            query[key] = getattr(objective, key)
    if objective.schedule == "1f1b":
        query["micro_batches"] = objective.micro_batches
    if memory_limit_mib is not None:
        query["memory_mib"] = memory_limit_mib
    return f"{BALANCED}:{profile}" + (f"?{urllib.parse.urlencode(query)}" if query else "")


def profile_and_balance(
    layers: Sequence[Any],
    inputs: Any,
    labels: Any,
    loss_fn: Any,
    ds_config: Mapping[str, Any],
    cache_dir: str | Path,
    memory_limit_mib: float | None = None,
    interleave: bool = True,
) -> str:
    """Profile ``layers`` on one micro-batch (once: cached in ``cache_dir``) and return the ``"balanced:"``
    method for ``ds_config``'s schedule. Every rank calls it; global rank 0 measures (see ``cached_profile``).

    The step is timed with the config's optimizer type; weights and inputs in bf16 when the config says so.
    ``interleave=False`` profiles one layer at a time (a model whose copy does not fit the device twice).
    """
    import torch

    bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
    _, path = cached_profile(
        layers,
        inputs,
        cache_dir,
        labels=labels,
        loss_fn=loss_fn,
        optimizer=optimizer_from_ds_config(dict(ds_config)),
        dtype=torch.bfloat16 if bf16 else None,
        interleave=interleave,
    )
    return balanced_method(path, ds_config, memory_limit_mib)


def parse_balanced(method: str) -> tuple[Path, Objective]:
    """The profile path and objective of ``"balanced:<profile.json>[?key=value&...]"``."""
    body = method[len(BALANCED) + 1 :] if method.lower().startswith(BALANCED + ":") else ""
    path, _, query = body.partition("?")
    if not path:
        raise ValueError(
            f"partition_method {method!r} needs a layer profile: 'balanced:<profile.json>'; make one with "
            "fdg_schedule.partitioning.profile.cached_profile(layers, sample_inputs, cache_dir) "
            "(see docs/performance.md)"
        )
    fields: dict[str, Any] = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in _KEYS:
            raise ValueError(f"partition_method {method!r}: unknown key {key!r}; known keys: {list(_KEYS)}")
        try:
            if key == "memory_mib":
                fields["memory_limit"] = int(float(value) * 2**20)
            elif key in ("accumulate", "micro_batches"):
                fields[key] = int(value)
            elif key == "delay_weight":
                fields[key] = float(value)
            else:
                fields[key] = value
        except ValueError:
            raise ValueError(f"partition_method {method!r}: {key} must be a number, got {value!r}") from None
    try:
        return Path(path), Objective(**fields)
    except ValueError as error:
        raise ValueError(f"partition_method {method!r}: {error}") from None


def parse_parts(method: str, stages: int, layers: int) -> list[int]:
    """Boundaries from ``"parts:0,5,12"``, checked against the stage and layer counts."""
    try:
        parts = [int(p) for p in method.split(":", 1)[1].split(",")]
    except ValueError:
        raise ValueError(f"partition_method {method!r} must be 'parts:' then comma-separated integers") from None
    if len(parts) != stages + 1 or parts[0] != 0 or parts[-1] != layers:
        raise ValueError(
            f"partition_method {method!r} must list {stages + 1} boundaries from 0 to {layers} "
            f"({stages} stages, {layers} layers)"
        )
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise ValueError(f"partition_method {method!r}: every stage needs at least one layer (strictly increasing)")
    return parts


def plan_for(method: str, layers: Sequence[Any], stages: int) -> tuple[list[int], Partition | None, str]:
    """What ``method`` makes of ``layers`` on ``stages`` stages: boundaries, the balanced plan, and a report.

    The same on every rank (it reads only the method and the profile file).
    """
    if method.lower().startswith(PARTS):
        parts = parse_parts(method, stages, len(layers))
        return parts, None, f"partition_method {method!r}: boundaries {parts}"
    path, objective = parse_balanced(method)
    profile = ModelProfile.load(path)
    check_layers(profile, layers, str(path))
    plan = balanced_partition(profile, stages, objective, own_parameters(layers, objective))
    lines = [
        f"balanced partition of {len(layers)} layers into {stages} stages for {objective.describe()}, from {path} "
        f"(micro-batch {profile.micro_batch}, {profile.device}, {profile.dtype}): parts {plan.parts}",
        *plan.describe(profile.names),
    ]
    stock = parameter_split(profile, stages)
    if stock is not None and stock != plan.parts:
        other = evaluate_partition(profile, stock, objective)
        lines.append(
            f'partition_method "parameters" would give parts {stock}, slowest stage {other.bottleneck_s * 1e3:.2f} ms '
            f"against {plan.bottleneck_s * 1e3:.2f} ms here ({other.bottleneck_s / plan.bottleneck_s:.2f}x)"
        )
    return plan.parts, plan, "\n".join(lines)


def own_parameters(layers: Sequence[Any], objective: Objective) -> list[bool] | None:
    """Per layer, whether it gives an FDG stage parameters of its own (a ``LayerSpec`` that is not tied, or a
    module with parameters), when the model has tied layers and the split is for FDG; else None (no constraint).

    FDG steps tied layers with an optimizer of their own, so a stage holding only tied layers is refused
    at ``deepspeed.initialize`` (fdg_schedule.exchange.tied.stages_of_only_tied_layers): the split avoids it.
    """
    from deepspeed.pipe import TiedLayerSpec

    from fdg_schedule.exchange.tied import has_own_parameters

    if objective.schedule != "fdg" or not any(isinstance(layer, TiedLayerSpec) for layer in layers):
        return None
    return [has_own_parameters(layer) for layer in layers]


def check_layers(profile: ModelProfile, layers: Sequence[Any], source: str) -> None:
    """The profile must describe these layers (same count and names), else the split means nothing."""
    names = [layer_name(layer) for layer in layers]
    if names == profile.names:
        return
    if len(names) != len(profile.names):
        detail = f"it has {len(profile.names)} layers, the PipelineModule {len(names)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(names, profile.names)) if a != b)
        detail = f"layer {i} is {profile.names[i]!r} there and {names[i]!r} here"
    raise ValueError(
        f"the layer profile {source} does not describe this model: {detail}; profile this PipelineModule's "
        "layers (fdg_schedule.partitioning.profile.cached_profile) or pass the right file"
    )


def _apply(module: PipelineModule, method: str) -> None:
    """DeepSpeed's ``_partition_layers`` for our methods: set ``parts``, log, keep this stage's layers."""
    parts, plan, report = plan_for(method, module._layer_specs, module.num_stages)
    module.parts = parts
    module.partition_plan = plan
    if module.global_rank == 0:
        print(report, flush=True)  # as DeepSpeed prints its own partition (its logger shows warnings only)
    stage_id = module._topo.get_coord(module.global_rank).pipe
    module._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])
