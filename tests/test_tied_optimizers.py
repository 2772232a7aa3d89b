"""Tied copies stay bit-identical under every optimizer DeepSpeed builds from its config, and client ones
(Note [tied layers across stages] in fdg_schedule/exchange/tied.py; Note [FusedAdam's step on the CPU] in
fdg_schedule/base/optim.py).

The job is the Megatron-style one of issue 41: an ``nn.Embedding`` subclass tied to the head
(``x @ weight.t()``), five Linear + Tanh pairs between, split ``"uniform"``. Every test compares the copies
of every owner and data-parallel replica with ``torch.equal`` after each ``train_batch()`` call and the drain.
"""

from __future__ import annotations

from typing import Any

import pytest
import tied_optimizer_workers as workers
import torch
from dist_harness import run_ranks_each

from fdg_schedule.base import optim
from fdg_schedule.exchange import tied

pytestmark = pytest.mark.distributed

# Every optimizer DeepSpeed builds from its config on this machine, and torch optimizers given to it. ("Lion"
# builds FusedLion, which has no CPU kernel in DeepSpeed 0.19.8; with the optimizer offloaded, DeepSpeedCPULion.)
OPTIMIZERS: list[dict[str, Any]] = [
    {"optimizer": "SGD"},
    {"optimizer": "Adam"},
    {"optimizer": "AdamW", "params": {"weight_decay": 0.1}},
    {"optimizer": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}},
    {"optimizer": "Adam", "params": {"torch_adam": True}},
    {"optimizer": "AdamW", "params": {"torch_adam": True, "weight_decay": 0.1}},
    {"optimizer": "Muon"},  # the tied copy "tied_modules.emb.weight" is a matrix: Muon's half
    {"optimizer": "Muon", "key": "embed"},  # "embed" in its name: Adam's half
    {"optimizer": "client_adam"},
    {"optimizer": "client_adamw"},
    {"optimizer": "client_sgd"},
]
VARIANTS = {"plain": {}, "accumulate 2": {"accumulate": 2}, "bf16": {"bf16": True}, "ZeRO-1": {"zero": 1}}


def _name(case: dict[str, Any]) -> str:
    return f"{case['optimizer']}{case.get('params', '')}{'/' + case['key'] if 'key' in case else ''}"


def _cases(stages: int, variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    # DeepSpeed's BF16_Optimizer refuses Muon in a pipeline ("BF16 Muon currently requires ... dense DP"): 1F1B too.
    return [
        {**opt, **extra, "stages": stages, "variant": v}
        for v, extra in variants.items()
        for opt in OPTIMIZERS
        if not (extra.get("bf16") and opt["optimizer"] == "Muon")
    ]


OFFLOADED = [
    {"optimizer": o, "stages": 3, "zero": 1, "offload": True, "variant": "ZeRO-1 offload"} for o in ("Lion", "Adam")
]
THREE_STAGES = _cases(3, VARIANTS) + OFFLOADED
FOUR_RANKS = _cases(4, {"K = 4": {}}) + _cases(2, {"DP 2 x PP 2": {}, "DP 2 x PP 2, ZeRO-1": {"zero": 1}})


def check_copies_equal(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    """Every owner's and replica's copy is torch.equal after every call; the copies moved."""
    failures = []
    for case, per_rank in zip(cases, results):
        owners = [r for r in per_rank if r["copies"][0]]
        assert len(owners) == 2 * len(per_rank) // case["stages"], (case, len(owners))
        for call in range(len(owners[0]["copies"])):
            for name, first in owners[0]["copies"][call].items():
                for r in owners[1:]:
                    if not torch.equal(first, r["copies"][call][name]):
                        diff = (first.float() - r["copies"][call][name].float()).abs().max().item()
                        failures.append(f"{case['variant']} {_name(case)} call {call} stage {r['stage_id']}: {diff}")
        start, end = owners[0]["copies"][0], owners[0]["copies"][-1]
        assert any(not torch.equal(start[n], end[n]) for n in start), f"{case}: the tied weight never moved"
    assert not failures, "tied copies differ:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def three_stages(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    [results] = run_ranks_each(workers.train, 3, tmp_path_factory.mktemp("k3"), [(THREE_STAGES,)], deadline_s=600)
    return list(zip(*results))  # per case, per rank


def test_copies_bit_identical_at_three_stages_for_every_optimizer(three_stages) -> None:
    check_copies_equal(three_stages, THREE_STAGES)


def test_copies_bit_identical_at_four_stages_and_data_parallel(tmp_path) -> None:
    [results] = run_ranks_each(workers.train, 4, tmp_path, [(FOUR_RANKS,)], deadline_s=600)
    check_copies_equal(list(zip(*results)), FOUR_RANKS)


def test_an_optimizer_fdg_cannot_rebuild_is_refused_on_every_rank(tmp_path) -> None:
    """A client optimizer whose constructor needs more than its defaults: every rank raises the same error at
    initialize, the middle stage (which holds no copy) too, well before the 60 s a neighbour would wait."""
    case = {"optimizer": "client_rigid", "stages": 3}
    [errors] = run_ranks_each(workers.refused, 3, tmp_path, [(case,)], deadline_s=50)
    assert all("tied layers across stages need an optimizer of the stage's class" in e for e in errors), errors
    assert all("Rigid(params, **defaults) failed" in e and "untie the layers" in e for e in errors), errors


# -- the pieces, without a process group --------------------------------------------------------------------


def _fused_adam_run(steps: int, interleaved: bool, pure: bool) -> torch.Tensor:
    """A FusedAdam's weights after ``steps`` steps; ``interleaved``: another FusedAdam in the process steps
    right before each, one step ahead (as a stage optimizer and a tied optimizer do under FDG)."""
    from deepspeed.ops.adam import FusedAdam

    g = torch.Generator().manual_seed(0)
    w, other = torch.nn.Parameter(torch.randn(64, generator=g)), torch.nn.Parameter(torch.randn(64, generator=g))
    a, b = FusedAdam([w], lr=0.01), FusedAdam([other], lr=0.01)
    if pure:
        optim.pure_steps(a), optim.pure_steps(b)
    if interleaved:  # b's step count is one ahead of a's
        other.grad = torch.ones(64)
        b.step()
    for _ in range(steps):
        if interleaved:
            other.grad = torch.ones(64)
            b.step()
        w.grad = torch.sin(w.detach() * 3)
        a.step()
    return w.detach().clone()


def test_fused_adam_steps_depend_on_other_optimizers_unless_pure() -> None:
    """Note [FusedAdam's step on the CPU]: DeepSpeed's CPU kernel gives a FusedAdam other weights when another
    FusedAdam stepped in between (the reason the tied copies drifted), and the same weights after pure_steps."""
    assert not torch.equal(_fused_adam_run(40, False, False), _fused_adam_run(40, True, False)), (
        "DeepSpeed's CPU FusedAdam no longer depends on the call history: pure_steps may be unneeded"
    )
    assert torch.equal(_fused_adam_run(40, False, True), _fused_adam_run(40, True, True))


def _step_twice(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> torch.Tensor:
    for i in range(2):
        p.grad = torch.cos(p.detach() * (i + 2))
        opt.step()
    return p.detach().clone()


@pytest.mark.parametrize(
    "build",
    [
        lambda ps: __import__("deepspeed").ops.adam.FusedAdam(ps, lr=0.01, adam_w_mode=False, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, nesterov=True),
    ],
    ids=["FusedAdam L2", "torch AdamW", "SGD nesterov"],
)
def test_tied_optimizer_steps_as_the_stage_optimizer(build) -> None:
    """tied.build_optimizer gives an optimizer whose step on a copy is the stage optimizer's step on it: the
    settings DeepSpeed keeps outside ``defaults`` (FusedAdam's adam_w_mode) come along, and torch's AdamW is
    built although its ``defaults`` hold a key its constructor does not take."""
    g = torch.Generator().manual_seed(0)
    own, copy = torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(5, 3, generator=g))
    twin = torch.nn.Parameter(copy.detach().clone())
    stage = build([{"params": [own]}, {"params": [copy], "weight_decay": 0.2}])
    tied_copy = tied.build_optimizer(stage, [twin], tied.hyperparameters(stage.param_groups[1]), "test")
    optim.pure_steps(stage)
    for i in range(2):
        own.grad, copy.grad = torch.zeros(5, 3), torch.cos(copy.detach() * (i + 2))
        stage.step()
    assert torch.equal(_step_twice(tied_copy, twin), copy.detach())
