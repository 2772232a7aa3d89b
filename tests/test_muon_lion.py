"""DeepSpeed's "Muon" and "Lion" under FDG (issue 44): checkpoints resume bit for bit (Muon's momentum buffers and
its Adam half's moments, Lion's moment; ZeRO-1 with Muon), and FDG <-> 1F1B checkpoints keep the optimizer state.
The engine equals the reference with both: tests/test_engine.py (``_ds_optimizers``)."""

from __future__ import annotations

from typing import Any

import engine_workers
import pytest
import torch
from dist_harness import run_ranks_calls
from test_checkpoint import _check_bit_identical
from test_tied import _same_optimizer_state

pytestmark = pytest.mark.distributed

BASE = {"stages": 2, "n": 48, "gas": 3, "calls_before": 1, "calls_after": 2, "grad_shrink": 0.5}
RESUMES = [
    {**BASE, "ds_optimizer": "Muon", "weights": "stashed"},
    {**BASE, "ds_optimizer": "Muon", "zero": 1},
    {**BASE, "ds_optimizer": "Lion", "activations": "recomputed"},
]
SWAP = {"stages": 2, "n": 32, "gas": 2, "ds_optimizer": "Muon", "drain_save": True}
WAYS = (("fdg", "1f1b"), ("1f1b", "fdg"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two launches: the resumes straight through and the swaps' saves, then the resumes and the loads."""
    tmp = tmp_path_factory.mktemp("muon_lion")
    root, dirs = str(tmp / "ckpt"), {way: str(tmp / f"{way[0]}-to-{way[1]}") for way in WAYS}
    first = [(engine_workers.resume, (RESUMES, root, "straight"))]
    first += [(engine_workers.swap, ({**SWAP, "schedule": way[0]}, dirs[way], "save")) for way in WAYS]
    straight, *saved = run_ranks_calls(2, tmp, first, deadline_s=400)
    second = [(engine_workers.resume, (RESUMES, root, "resumed"))]
    second += [(engine_workers.swap, ({**SWAP, "schedule": way[1]}, dirs[way], "load")) for way in WAYS]
    resumed, *loaded = run_ranks_calls(2, tmp, second, deadline_s=400)
    return {"resumes": (straight, resumed), "swaps": dict(zip(WAYS, zip(saved, loaded)))}


def test_muon_and_lion_resume_bit_for_bit(runs) -> None:
    _check_bit_identical(*runs["resumes"], RESUMES)


def test_fdg_and_1f1b_checkpoints_with_muon_keep_the_optimizer_state(runs) -> None:
    """Saved drained by FDG (or by 1F1B) and loaded by the other schedule: the weights, and every parameter's Muon
    momentum buffer or Adam moments with its group's settings, exactly; then it trains on."""
    for (saved_with, loaded_with), (saved, loaded) in runs["swaps"].items():
        what = f"{saved_with} -> {loaded_with}"
        for s, lo in zip(saved, loaded):
            assert lo["error"] is None, f"{what}: {lo['error']}"
            assert lo["optimizer"] == "MuonWithAuxAdam", what
            assert all(torch.equal(s["state"][k], lo["state"][k]) for k in s["state"]), what
            kinds = {key for entry in s["optim"].values() for key in entry["state"]}
            assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds, (what, kinds)  # both halves have state
            _same_optimizer_state(s["optim"], lo["optim"], what)
        # it trains on (an FDG job refills its pipeline: stage 0 takes its first step two ticks after the load)
        assert any(not torch.equal(lo["after"][k], lo["state"][k]) for lo in loaded for k in lo["state"]), what


# Micro-batches larger than every matrix: full-rank gradients. Muon's Newton-Schulz iteration multiplies a
# gradient's small singular values by up to 3.4445 ** 5 (about 480), so in a rank-deficient gradient (a 6-wide
# input, 4 samples) it turns the rounding noise of the null space into differences of 1e-4 between two exact
# implementations; with full rank the engine equals the reference to 1e-6.
MICRO = 16


def _matrix_layers() -> list[Any]:
    """A model of matrices only (bias-free Linear layers), seeded: what torch.optim.Muon takes."""
    from torch import nn

    def linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
        layer = nn.Linear(n_in, n_out, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed)) / n_in**0.5)
        return layer

    return [linear(6, 8, 1), torch.tanh, linear(8, 8, 2), torch.tanh, linear(8, 8, 3), torch.tanh, linear(8, 3, 4)]


def torch_muon_client(rank: int, world: int) -> dict[str, Any]:
    """FDG, K = 2, with torch.optim.Muon given to deepspeed.initialize: each stage's weights after two calls."""
    import deepspeed
    import toy
    from deepspeed.pipe import PipelineModule

    import fdg_schedule  # noqa: F401

    model = PipelineModule(layers=_matrix_layers(), num_stages=2, loss_fn=toy.loss_fn, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 3, "steps_per_print": 10**9,
              "pipeline": {"schedule": "fdg", "fdg": {"grad_shrink": 0.5, "weights": "stashed"}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters(),
        optimizer=lambda params: torch.optim.Muon(params, lr=0.02, momentum=0.9),
    )  # fmt: skip
    data = iter(toy.micro_batches(6, MICRO))
    for _ in range(2):
        engine.train_batch(data)
    return {"parts": list(model.parts), "optimizer": type(engine.optimizer).__name__,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}  # fmt: skip


def test_torch_muon_as_a_client_optimizer_equals_the_reference(tmp_path) -> None:
    """torch.optim.Muon (every stage parameter a matrix) trains under FDG as the reference says."""
    import toy

    from fdg_schedule import FDGConfig, fdg_reference

    [results] = run_ranks_calls(2, tmp_path, [(torch_muon_client, ())], deadline_s=120)
    layers = _matrix_layers()
    parts = results[0]["parts"]
    stages = [toy.Chain(layers[a:b], a) for a, b in zip(parts[:-1], parts[1:])]
    opts = [torch.optim.Muon(s.parameters(), lr=0.02, momentum=0.9) for s in stages]
    fdg_reference(stages, opts, toy.micro_batches(6, MICRO), toy.loss_fn, FDGConfig(grad_shrink=0.5, weights="stashed"))
    for r in results:
        assert r["optimizer"] == "Muon"
        want = {k: v for s in stages for k, v in s.state_dict().items() if k in r["state"]}
        assert want.keys() == r["state"].keys()
        for key, value in r["state"].items():
            torch.testing.assert_close(value, want[key], rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_torch_muon_on_a_stage_with_anything_but_matrices_names_them_and_the_fix() -> None:
    """torch.optim.Muon given as a client callable, on a stage with a bias and a norm: the error names them and
    DeepSpeed's "Muon" config; other errors and other optimizers pass through unchanged."""
    from fdg_schedule.base import optim
    from fdg_schedule.base.config import FDGConfigError

    stage = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    build = optim.explain_client_optimizer(lambda ps: torch.optim.Muon(ps, lr=0.02), stage)
    with pytest.raises(FDGConfigError) as error:
        build(stage.parameters())
    message = str(error.value)
    assert "1.weight (4,)" in message and "1.bias (4,)" in message and "2.bias (2,)" in message
    assert "0.weight" not in message and "2.weight" not in message
    assert '"optimizer": {"type": "Muon"}' in message
    assert isinstance(error.value.__cause__, ValueError)
    groups = [{"params": list(stage[0].parameters())}, {"params": list(stage[2].parameters())}]
    with pytest.raises(FDGConfigError, match=r"2\.bias \(2,\)"):
        build(groups)
    matrices = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    assert isinstance(build(matrices.parameters()), torch.optim.Muon)
    sgd = optim.explain_client_optimizer(lambda ps: torch.optim.SGD(ps, lr=-1.0), stage)
    with pytest.raises(ValueError, match="Invalid learning rate") as other:
        sgd(stage.parameters())
    assert not isinstance(other.value, FDGConfigError)
    instance = torch.optim.SGD(stage.parameters(), lr=0.1)
    assert optim.explain_client_optimizer(instance, stage) is instance
    assert optim.explain_client_optimizer(None, stage) is None
