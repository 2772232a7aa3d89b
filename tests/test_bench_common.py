"""benchmarks/common/: the helpers the benchmarks share (table cells, lock-step cost, Student's t, core binding)."""

from __future__ import annotations

import ast
import itertools
import os
import threading
from pathlib import Path

import pytest

from benchmarks.common.cores import bind_threads
from benchmarks.common.stats import lockstep_cost, spread, t_quantile


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


@pytest.mark.parametrize("df, value", [(1, 6.313752), (7, 1.894579), (23, 1.713872), (30, 1.697261)])
def test_t_quantile_matches_the_tables(df: int, value: float) -> None:
    assert t_quantile(0.95, df) == pytest.approx(value, abs=1e-5)


# A script imports another script only where listed, each with why; a helper two scripts share lives in common/.
SCRIPT_IMPORTS = {
    "benchmarks.throughput.throughput": {"benchmarks.throughput.throughput_measure"},  # one benchmark, driver + ranks
    "benchmarks.throughput.scaling": {"benchmarks.throughput.plan_calibration"},  # the page embeds calibration's table
    "benchmarks.convergence.muon_lm": {"benchmarks.convergence.auto_test"},  # runs the auto test's own protocol
    # derives the shipped token-overhead table from that study's own run lists (its evidence, not a helper)
    "benchmarks.studies.token_overheads": {"benchmarks.studies.staleness_gpt2_gaps"},
    # the calibration runs the throughput benchmark itself (``throughput.main``) on the planner's splits
    "benchmarks.throughput.plan_calibration": {"benchmarks.throughput.throughput"},
    # issue 64's screen runs on the auto test's development tasks with the Muon queue's optimizer, as they were
    # measured (its runs are compared with theirs); issue 63's runner builds Muon as that queue did
    "benchmarks.convergence.candidates_screen": {"benchmarks.convergence.auto_test", "benchmarks.convergence.muon_lm"},
    "benchmarks.convergence.time_to_loss": {"benchmarks.convergence.muon_lm"},
    # issue 64's cost measurement runs its tasks as issue 63's runner runs a task (its optimizers, clipping and
    # evaluation), so the v2 queue's cost is that runner's
    "benchmarks.convergence.auto_v2_cost": {"benchmarks.convergence.time_to_loss"},
}


def test_scripts_share_helpers_through_common_only() -> None:
    root = Path(__file__).resolve().parents[1]
    groups = ("benchmarks.throughput", "benchmarks.convergence", "benchmarks.studies")
    found: dict[str, set[str]] = {}
    for path in sorted((root / "benchmarks").glob("*/*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            scripts = {t for t in targets if t.startswith(groups) and t.count(".") == 2 and t != name}
            if scripts:
                found.setdefault(name, set()).update(scripts)
    assert found == SCRIPT_IMPORTS, "a helper that two scripts share belongs in benchmarks/common/"


def test_provenance_names_the_machine_and_the_commit() -> None:
    from benchmarks.common.provenance import commit, machine

    here = machine()
    assert set(here) == {"cpu", "vector", "torch", "deepspeed", "python"} and here["cpu"], here
    assert commit() == "" or all(c in "0123456789abcdef" for c in commit())


def test_the_benchmark_optimizers_are_the_time_to_loss_runs() -> None:
    """AdamW and Muon as benchmarks/convergence/time_to_loss.py trains with them (lr: its grid's middle), clipped as
    its LM runs; Muon built by the one builder both use; a name the benchmark does not build is refused."""
    from benchmarks.common import optimizers
    from benchmarks.convergence import muon_lm
    from benchmarks.convergence import time_to_loss as ttl

    assert {k: v for k, v in optimizers.ADAMW.items() if k != "lr"} == ttl.ADAMW
    assert optimizers.ADAMW["lr"] == ttl.GRIDS["adamw"][1] and ttl.GRIDS["muon"][1] == optimizers.MUON_LR
    assert optimizers.CLIP["adamw"] == optimizers.CLIP["muon"] == ttl.CLIP["lm"] and optimizers.CLIP["sgd"] == 0.0
    assert muon_lm.muon is optimizers.muon
    entries, client = optimizers.deepspeed_entries("muon")
    assert client is None and entries["optimizer"] == {"type": "Muon", "params": {"muon_lr": 0.02, **optimizers.MUON}}
    with pytest.raises(
        ValueError, match=r"--optimizer 'adam' is not an optimizer the benchmark builds: use one of sgd"
    ):
        optimizers.check("adam")


def test_the_profiles_muon_tags_each_layer_copy_as_deepspeed_tags_the_model() -> None:
    """The profiler steps copies of single layers, without the model's names: the embedding and the head still go on
    Muon's Adam half (their names), the blocks' matrices on Muon, as in a DeepSpeed engine of the whole model."""
    import copy

    from benchmarks.common.bench_models import model_layers
    from benchmarks.common.optimizers import LayerMuon

    layers = model_layers("gpt2_tiny")
    factory = LayerMuon(layers)
    for layer in (layers[0], layers[1], layers[-1]):  # the embedding, a block, the head
        params = list(copy.deepcopy(layer).parameters())
        opt = factory(params)
        on_muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
        names = dict(layer.named_parameters())
        expected = {n for n, p in names.items() if p.ndim >= 2 and "embed" not in n and "lm_head" not in n}
        assert {n for (n, _), p in zip(names.items(), params) if id(p) in on_muon} == expected, type(layer).__name__
    assert any(g["use_muon"] for g in factory(list(copy.deepcopy(layers[1]).parameters())).param_groups)
