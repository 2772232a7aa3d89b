"""Tied layers (DeepSpeed's ``TiedLayerSpec``) of a layer list: built in one process, and a stage's copies.

``PipelineModule`` builds each tied key once on every stage that holds one of its specs, runs a spec
with a ``forward_fn`` as ``forward_fn(module, inputs)``, and keeps the copies' ``tied_weight_attr``
weights equal (a broadcast at start, then DeepSpeed's tied-gradient all-reduce under 1F1B).
:func:`build_local` builds a whole layer list the same way in one process (one module per key, as a
one-stage ``PipelineModule`` does): the plain model that single-process references and tests run.
:func:`tied_weights` lists a running ``PipelineModule``'s local copies of the tied weights and
:func:`holds_first` says whether this stage holds a key's first spec (the copy an export reads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

__all__ = ["TiedLayerSpec", "build_local", "holds_first", "is_tied_spec", "tied_keys", "tied_weights"]


def is_tied_spec(layer: Any) -> bool:
    """Whether ``layer`` is a ``TiedLayerSpec``."""
    return isinstance(layer, TiedLayerSpec)


def tied_keys(layers: Sequence[Any]) -> list[str]:
    """The tied keys of a layer list, in order of first appearance."""
    return list(dict.fromkeys(layer.key for layer in layers if isinstance(layer, TiedLayerSpec)))


def build_local(layers: Sequence[Any]) -> list[Callable[[Any], Any]]:
    """The callables a one-stage ``PipelineModule`` would run for ``layers``: specs built, each tied key once.

    A ``TiedLayerSpec`` with a ``forward_fn`` becomes ``partial(forward_fn, module)`` on the key's
    module; modules and functions pass through as they are (shared, not copied).
    """
    tied: dict[str, nn.Module] = {}
    built: list[Callable[[Any], Any]] = []
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in tied:
                tied[layer.key] = layer.build()
            module = tied[layer.key]
            built.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
        elif isinstance(layer, LayerSpec):
            built.append(layer.build())
        else:
            built.append(layer)
    return built


def tied_weights(module: PipelineModule) -> dict[str, torch.Tensor]:
    """This stage's copies of the tied weights, named ``<key>.<tied_weight_attr>`` (empty if it holds none)."""
    out: dict[str, torch.Tensor] = {}
    for key, tied in module.tied_modules.items():
        for attr in module.tied_weight_attrs[key]:
            out[f"{key}.{attr}"] = PipelineModule._recursive_getattr(tied, attr)
    return out


def holds_first(module: PipelineModule, key: str) -> bool:
    """Whether this stage builds tied ``key`` for its first spec (the first stage of those holding it)."""
    specs = module._layer_specs
    first = next(i for i, spec in enumerate(specs) if isinstance(spec, TiedLayerSpec) and spec.key == key)
    return bool(module.stage_owner(first) == module.stage_id)
