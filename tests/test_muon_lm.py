"""benchmarks/convergence/muon_lm.py, issue 44's Muon evidence: the arms, the optimizer it builds per stage, its
statistics."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import provenance
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


def _write(file, record) -> None:
    import json

    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(record))


def test_bp_adamw_is_run_here_only_where_the_auto_tests_ran_on_another_processor(tmp_path, monkeypatch) -> None:
    out, auto = tmp_path / "muon", tmp_path / "auto"
    monkeypatch.setattr(provenance, "machine", lambda: "here")
    for seed in muon_lm.SEEDS:
        _write(muon_lm.path(out, "gpt2", "muon_k4", seed), {"test": 4.0, "machine": "here" if seed < 104 else "x"})
        theirs = {"test": 4.4, "machine": "x" if seed < 102 else "here"}
        _write(muon_lm.auto_test.run_path(auto, "gpt2", "bp", seed), theirs)
    planned = [t for t in muon_lm.plan(out, auto) if t[1] == muon_lm.BP_ADAMW_HERE]
    # 100, 101: theirs elsewhere, ours here; 102, 103: theirs pairs already; 104: ours ran elsewhere, cannot pair here
    assert planned == [("gpt2", muon_lm.BP_ADAMW_HERE, 100, None), ("gpt2", muon_lm.BP_ADAMW_HERE, 101, None)]
    _write(muon_lm.path(out, "gpt2", muon_lm.BP_ADAMW_HERE, 100), {"test": 5.0, "machine": "here"})
    against_ours = muon_lm.runs_of(out, auto, "gpt2", "bp_adamw", for_arm="muon_k4")
    against_theirs = muon_lm.runs_of(out, auto, "gpt2", "bp_adamw", for_arm="adamw_k4_auto")
    assert against_ours[100] == {"test": 5.0, "machine": "here"} and against_ours[101]["machine"] == "x"
    assert against_theirs[100] == {"test": 4.4, "machine": "x"}
    assert muon_lm.paired(muon_lm.runs_of(out, auto, "gpt2", "muon_k4"), against_ours)["n"] == 3  # 100, 102, 103


def test_this_queues_arms_are_rerun_here_where_bp_adamw_ran_here_and_they_elsewhere(tmp_path, monkeypatch) -> None:
    out, auto = tmp_path / "muon", tmp_path / "auto"
    monkeypatch.setattr(provenance, "machine", lambda: "here")
    for seed in muon_lm.SEEDS:  # 100-102: all elsewhere; 103, 104: BP-AdamW here, the Muon arms elsewhere
        for arm in muon_lm.ARMS:
            _write(muon_lm.path(out, "llama", arm, seed), {"test": 4.0, "machine": "x"})
        _write(
            muon_lm.auto_test.run_path(auto, "llama", "bp", seed),
            {"test": 5.0, "machine": "x" if seed < 103 else "here"},
        )
    planned = [t for t in muon_lm.plan(out, auto) if t[1].endswith("_here")]
    assert planned == [("llama", arm + "_here", seed, None) for seed in (103, 104) for arm in muon_lm.AGAINST_BP_ADAMW]
    _write(muon_lm.path(out, "llama", "muon_k4_here", 103), {"test": 4.5, "machine": "here"})
    against_bp_adamw = muon_lm.runs_of(out, auto, "llama", "muon_k4", against="bp_adamw")
    assert against_bp_adamw[103] == {"test": 4.5, "machine": "here"} and against_bp_adamw[104]["machine"] == "x"
    assert muon_lm.runs_of(out, auto, "llama", "muon_k4", against="bp_muon")[103]["test"] == 4.0
    bp_adamw = muon_lm.runs_of(out, auto, "llama", "bp_adamw", for_arm="muon_k4")
    stats = muon_lm.paired(against_bp_adamw, bp_adamw)
    assert stats["n"] == 4 and stats["differences"][-1] == pytest.approx(-10.0)  # 100-102 (x) and 103 (here)
    assert ("llama", "muon_k4_here", 103, None) not in muon_lm.plan(out, auto)
