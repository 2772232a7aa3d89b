"""benchmarks/convergence/muon_lm.py, issue 44's Muon evidence: the arms, the optimizer it builds per stage, its
statistics."""

from __future__ import annotations

import pytest
import torch

from benchmarks.convergence import muon_lm
from fdg_schedule.zoo import hf_lm


def test_arms_name_stages_optimizer_and_corrections() -> None:
    assert muon_lm.arm_setup("bp_muon") == (1, "muon", None)
    assert muon_lm.arm_setup("bp_lr0.04") == (1, "muon", None)
    assert muon_lm.arm_setup("muon_k4") == (4, "muon", "auto")
    assert muon_lm.arm_setup("adamw_k2_none") == (2, "adamw", "none")


def test_muon_puts_the_blocks_matrices_on_muon_and_the_rest_on_adam() -> None:
    config = hf_lm.build_config("gpt2", "tiny", 256, 64, 0, tie_word_embeddings=False)
    stage = torch.nn.Sequential(*hf_lm.pipeline_layers(hf_lm.build_model(config)))
    opt = muon_lm.muon(stage, 0.04)
    groups = {g["use_muon"]: g for g in opt.param_groups}
    names = {id(p): n for n, p in stage.named_parameters()}
    on_muon = {names[id(p)] for p in groups[True]["params"]}
    assert on_muon == {n for n, p in stage.named_parameters() if ".block." in n and p.ndim == 2}
    assert {names[id(p)] for p in groups[False]["params"]} == set(names.values()) - on_muon
    assert (groups[True]["lr"], groups[True]["momentum"]) == (0.04, 0.95)
    assert (groups[False]["lr"], groups[False]["betas"]) == (1e-3, [0.9, 0.95])


def test_paired_differences_are_relative_and_skip_other_machines() -> None:
    a = {100: {"test": 4.4, "machine": "m"}, 101: {"test": 4.2, "machine": "m"}, 102: {"test": 9.0, "machine": "x"}}
    b = {100: {"test": 4.0, "machine": "m"}, 101: {"test": 4.0, "machine": "m"}, 102: {"test": 4.0, "machine": "m"}}
    stats = muon_lm.paired(a, b)
    assert stats["n"] == 2
    assert stats["differences"] == pytest.approx([10.0, 5.0])
    assert stats["mean"] == pytest.approx(7.5)
    assert stats["upper_95"] == pytest.approx(7.5 + 6.313752 * (5 / 2**0.5) / 2**0.5, abs=1e-4)
