"""A bench model's layer profile: each layer's measured times and sizes on one thread, with the benchmark's optimizer
and micro-batch (what the throughput benchmarks balance their splits on)."""

from __future__ import annotations

import torch

from benchmarks.common import optimizers
from benchmarks.common.bench_models import fixed_data, loss_fn, model_layers
from fdg_schedule.partitioning.profile import ModelProfile, profile_layers


def model_profile(model: str, optimizer: str = "sgd") -> ModelProfile:
    """``model``'s profile with ``optimizer``'s step (:mod:`benchmarks.common.optimizers`; sgd: the benchmark's
    SGD with momentum). Muon's step is timed on each layer's parameters tagged as DeepSpeed tags the whole model."""
    torch.set_num_threads(1)
    x, y = fixed_data(model, 1)[0]
    layers = model_layers(model)
    factory = optimizers.LayerMuon(layers) if optimizers.check(optimizer) == "muon" else None
    return profile_layers(layers, x, y, loss_fn(model), optimizer=factory or optimizers.parameter_factory(optimizer),
                          device="cpu")  # fmt: skip
