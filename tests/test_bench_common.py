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
    # throughput.py's model_profile / engine_version and throughput_measure.py's process set-up are shared, but
    # those files were being changed when issue 65 moved the other helpers: they move to common/ next
    "benchmarks.throughput.plan_calibration": {"benchmarks.throughput.throughput"},
    "benchmarks.throughput.transport_cost": {"benchmarks.throughput.throughput"},
    "benchmarks.throughput.correction_cost": {"benchmarks.throughput.throughput"},
    "benchmarks.studies.tick_anatomy": {"benchmarks.throughput.throughput", "benchmarks.throughput.throughput_measure"},
    # issue 64's screen runs on the auto test's development tasks with the Muon queue's optimizer, as they were
    # measured (its runs are compared with theirs); issue 63's runner builds Muon as that queue did
    "benchmarks.convergence.candidates_screen": {"benchmarks.convergence.auto_test", "benchmarks.convergence.muon_lm"},
    "benchmarks.convergence.time_to_loss": {"benchmarks.convergence.muon_lm"},
    # issue 64's cost measurement runs its tasks as issue 63's runner runs a task (its optimizers, clipping and
    # evaluation), so the v2 queue's cost is that runner's
    "benchmarks.convergence.auto_v2_cost": {"benchmarks.convergence.time_to_loss"},
    # a common module reads a script's definitions (to move down into common/ next: the script's queue runs a
    # frozen commit, so the move changes no run): the bench model `ttl_lm` is the time-to-loss LM's config, so the
    # K = 2 ratio times that very model
    "benchmarks.common.bench_models": {"benchmarks.convergence.time_to_loss"},
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
