"""benchmarks/common/: the helpers the throughput benchmarks share (table cells, the lock-step's cost, core binding)."""

from __future__ import annotations

import itertools
import os
import threading

import pytest

from benchmarks.common.cores import bind_threads
from benchmarks.common.stats import lockstep_cost, spread


def test_lockstep_cost_is_the_mean_per_iteration_maximum_over_the_slower_mean() -> None:
    assert lockstep_cost([1.0, 3.0], [3.0, 1.0]) == pytest.approx(3 / 2 - 1)  # both average 2, the max is 3
    assert lockstep_cost([2.0, 2.0], [1.0, 1.0]) == pytest.approx(0)  # steady: only the slower one counts
    with pytest.raises(ValueError):
        lockstep_cost([1.0, 2.0], [1.0])  # one time per iteration on each side


def test_spread_is_the_scaled_median_and_range() -> None:
    assert spread([0.003, 0.001, 0.002], 1e3) == "2.0 [1.0–3.0]"
    assert spread([1.0, 1.25], digits=2) == "1.12 [1.00–1.25]"  # the median of two: their mean, rounded half even


def test_bind_threads_pins_every_thread_of_the_process() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    started, stop = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def other() -> None:
        started.set()
        stop.wait()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=other)
    thread.start()
    started.wait()
    try:
        bind_threads({core})
        assert os.sched_getaffinity(0) == {core}
    finally:
        stop.set()
        thread.join()
        bind_threads(before)
    assert seen == [{core}]  # the thread that was running already is bound too


@pytest.mark.parametrize(("model", "layers", "cut", "boundary_bytes"), [
    ("plainconv", 29, 14, 32 * 32 * 32 * 32 * 4),  # issue 48's conv net: 4 MiB between its stages
    ("widemlp", 17, 8, 256 * 2048 * 4),  # a large boundary: 2 MiB
    ("smalltransformer", 7, 3, 8 * 32 * 128 * 4),  # a small one: 128 KiB
])  # fmt: skip
def test_the_new_shapes_are_layer_lists_with_their_boundaries(
    model: str, layers: int, cut: int, boundary_bytes: int
) -> None:
    """The throughput benchmark's issue-48 shapes: flat LayerSpec lists any split (and the halves) can cut, whose
    activation at a cut has the size the model's description gives."""
    import torch
    from deepspeed.pipe import LayerSpec
    from torch import nn

    from benchmarks.common.bench_models import build_layers, fixed_data, model_layers

    specs = model_layers(model)
    assert len(specs) == layers and all(isinstance(s, LayerSpec) for s in specs)
    x, y = fixed_data(model, 1)[0]
    with torch.no_grad():
        boundary = nn.Sequential(*build_layers(model)[:cut])(x)
        logits = nn.Sequential(*build_layers(model)[cut:])(boundary)
    assert boundary.numel() * boundary.element_size() == boundary_bytes
    assert logits.shape == (y.shape[0], 10)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.usefixtures("one_rank_group")
def test_the_recomputed_halves_hold_inputs_and_forward_each_micro_batch_twice(recompute: bool) -> None:
    """`halves_recomputed`, the recomputed modes' ceiling: stage 0 holds its inputs (not their graphs) and runs each
    micro-batch's forward again right before its delayed backward; the stored halves forward it once."""
    from benchmarks.common.throughput_variants import PlainHalves

    halves = PlainHalves("transformer_tiny", [0, 1, 3], recompute=recompute)  # rank 0: stage 0 of K = 2, delay 2
    inputs = [x for x, _ in itertools.islice(halves.data, 6)]
    forwards: list[int] = []
    halves.module.register_forward_hook(lambda module, args, out: forwards.append(id(args[0])))
    halves.data = itertools.cycle([(x, x) for x in inputs])  # stage 0 reads no labels
    for _ in range(5):
        halves.unit()
    backwards = max(0, 5 - halves.delay)
    assert halves.delay == 2 and len(halves.held) == 2
    if recompute:
        assert all(held is inputs[3 + i] for i, held in enumerate(halves.held))  # the inputs themselves
        # ticks 0-4 forward inputs 0-4; ticks 2-4 first forward inputs 0-2 again, on the weights of that tick
        assert forwards == [id(inputs[0]), id(inputs[1]), id(inputs[0]), id(inputs[2]), id(inputs[1]), id(inputs[3]),
                            id(inputs[2]), id(inputs[4])]  # fmt: skip
        assert len(forwards) == 5 + backwards
    else:
        assert all(held.grad_fn is not None for held in halves.held)  # the outputs with their graphs
        assert forwards == [id(x) for x in inputs[:5]]
