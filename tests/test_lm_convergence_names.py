"""benchmarks/common/lm_runs.py's run names (lm_convergence.py's grammar): tied / untied variants, what each trains."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks.common import lm_runs
from fdg_schedule.base import config as fdg_config


def benchmark() -> ModuleType:
    return lm_runs


@pytest.mark.parametrize(
    ("name", "tie", "baseline", "seed"),
    [
        ("bp", "", "bp", 1234),
        ("fdg_k2_b0.5", "", "bp", 1234),
        ("bp_tied", "tied", "bp_tied", 1234),
        ("fdg_k2_b0.5_untied", "untied", "bp_untied", 1234),
        ("fdg_k2_b0.5_stashed_s7_tied", "tied", "bp_s7_tied", 7),
    ],
)
def test_tie_suffix_and_its_paired_baseline(name: str, tie: str, baseline: str, seed: int) -> None:
    run = benchmark().parse_run(name)
    assert (run.tie, run.baseline, run.seed) == (tie, baseline, seed)


def test_both_variants_train_the_same_tied_model(tmp_path: Path) -> None:
    lm = benchmark()
    assert lm.model_config(lm.parse_run("fdg_k2_b0.5"), tmp_path) == (lm.MODEL, [])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tied_path, tied_flags = lm.model_config(lm.parse_run("fdg_k2_b0.5_tied"), tmp_path / "a")
    untied_path, untied_flags = lm.model_config(lm.parse_run("fdg_k2_b0.5_untied"), tmp_path / "b")
    assert (tied_flags, untied_flags) == ([], ["--untie"])
    source = json.loads(lm.MODEL.read_text())
    for path in (tied_path, untied_path):
        assert json.loads(path.read_text()) == {**source, "tie_word_embeddings": True}


def test_reference_runs_have_no_tied_variant() -> None:
    with pytest.raises(SystemExit, match="fdg_reference runs have no tied variant"):
        benchmark().parse_run("ref_k3_b0.5_tied")


def test_the_m_suffix_turns_delay_aware_momentum_on() -> None:
    lm = benchmark()
    run = lm.parse_run("ref_k4_b1.0_stashed_p0.9_m_s3")
    assert run.delay_momentum and run.predict_decay == 0.9 and run.weights == "stashed" and run.seed == 3
    assert run.kind == "reference" and run.baseline == "bp_s3"
    assert not lm.parse_run("ref_k4_b1.0").delay_momentum


def test_the_r_suffix_raises_the_delayed_stages_momentum() -> None:
    lm = benchmark()
    run = lm.parse_run("ref_k4_b1.0_stashed_dlr1600_p0.0_first_r2_parts0-1-2-3-8_s3")
    assert run.delay_momentum_raise == 2.0 and not run.delay_momentum and run.parts == (0, 1, 2, 3, 8)
    assert run.baseline == "bp_s3" and lm.parse_run("ref_k4_b1.0").delay_momentum_raise is None
    config = lm.deepspeed_config(lm.parse_run("fdg_k2_b1.0_stashed_p0.0_first_r0.5"), 800)["pipeline"]["fdg"]
    assert config["delay_momentum_raise"] == 0.5 and config["delay_momentum"] is False
    with pytest.raises(SystemExit, match="does not read as"):
        lm.parse_run("ref_k4_b1.0_m_r2")  # one or the other


def test_the_first_suffix_aims_the_prediction_at_stage_0s_update() -> None:
    lm = benchmark()
    run = lm.parse_run("fdg_k2_b1.0_stashed_p0.0_first_s2")
    assert run.predict_horizon == "first_stage" and run.predict_decay == 0.0 and run.baseline == "bp_s2"
    assert lm.deepspeed_config(run, 800)["pipeline"]["fdg"]["predict_horizon"] == "first_stage"
    assert lm.parse_run("ref_k4_b1.0_stashed_p0.0").predict_horizon == "own"
    with pytest.raises(SystemExit, match="does not read as"):
        lm.parse_run("ref_k4_b1.0_stashed_first")  # a horizon without a prediction


def test_a_deepspeed_run_has_one_rank_per_stage() -> None:
    lm = benchmark()
    for stages in (2, 3, 4):  # the FDG config file says 2; K > 2 must not become data parallelism
        assert lm.deepspeed_config(lm.parse_run(f"fdg_k{stages}_b1.0"), 800)["pipeline"]["stages"] == stages


def test_a_deepspeed_run_sets_its_corrections_from_its_name_alone() -> None:
    """lm_fdg_k2.json says corrections "auto"; a run's config drops it (the name sets the keys) and parses."""
    lm = benchmark()
    run = lm.parse_run("fdg_k2_b1.0_stashed_dlr1600_p0.0_first_r1")
    config = lm.deepspeed_config(run, 800)
    parsed = fdg_config.parse(config)
    assert parsed is not None and parsed.corrections is None and "corrections" not in config["pipeline"]["fdg"]
    assert (parsed.delay_lr_ticks, parsed.predict_decay, parsed.delay_momentum_raise) == (1600, 0.0, 1.0)
    assert fdg_config.parse(lm.deepspeed_config(lm.parse_run("fdg_k2_b0.5"), 800)).predict_decay is None


def test_the_cos_suffix_schedules_the_rate_and_pairs_with_the_cos_baseline() -> None:
    lm = benchmark()
    run = lm.parse_run("ref_k4_b1.0_m_cos_s3")
    assert run.cosine and run.delay_momentum and run.seed == 3 and run.baseline == "bp_cos_s3"
    assert lm.parse_run("bp_cos").baseline == "bp_cos" and not lm.parse_run("bp").cosine
    assert lm.parse_run("fdg_k2_b1.0_cos_tied").baseline == "bp_cos_tied"
    run = lm.parse_run("fdg_k2_b1.0_a4_cos_s2")
    assert (run.accumulate, run.cosine, run.seed, run.baseline) == (4, True, 2, "bp_a4_cos_s2")
    assert lm.parse_run("bp_a4").baseline == "bp_a4" and lm.parse_run("bp").accumulate == 1
    params = lm.schedule(800)["params"]
    assert (params["total_num_steps"], params["warmup_num_steps"], params["cos_min_ratio"]) == (800, 80, 0.1)


def test_the_lr_suffix_sets_the_rate_and_pairs_with_bp_at_the_same_rate(tmp_path: Path) -> None:
    lm = benchmark()
    run = lm.parse_run("fdg_k2_b1.0_lr0.002_a2_s1")
    assert (run.lr, run.accumulate, run.seed, run.baseline) == (0.002, 2, 1, "bp_lr0.002_a2_s1")
    assert lm.parse_run("bp_lr0.0005").baseline == "bp_lr0.0005" and lm.parse_run("bp").lr is None
    assert lm.parse_run("ref_k4_b1.0_m_lr0.0005_cos").baseline == "bp_lr0.0005_cos"
    with pytest.raises(SystemExit, match="must be a learning rate"):
        lm.parse_run("bp_lr1.5")
    assert lm.deepspeed_config(run, 800)["optimizer"]["params"]["lr"] == 0.002
    assert lm.deepspeed_config(lm.parse_run("bp_lr0.0005"), 800)["optimizer"]["params"]["lr"] == 0.0005
    assert lm.deepspeed_config(lm.parse_run("bp"), 800)["optimizer"]["params"]["lr"] == 0.001


def test_the_parts_suffix_splits_both_backends_at_the_same_layers() -> None:
    """_parts sets the stage boundaries: the reference's stage modules and the recipe's --partition."""
    lm = benchmark()
    run = lm.parse_run("ref_k4_b1.0_stashed_dlr1600_p0.0_first_parts0-2-3-5-8_s1")
    assert run.parts == (0, 2, 3, 5, 8) and run.seed == 1 and run.baseline == "bp_s1"
    assert lm.parse_run("ref_k4_b1.0").parts is None
    assert lm.partition_method(lm.parse_run("fdg_k2_b1.0_parts0-3-8")) == "parts:0,3,8"
    assert lm.partition_method(lm.parse_run("fdg_k2_b1.0")) == "type:BlockPipe"
    stage_modules, _, _, _ = lm.gpt2_setup(1234, 4, 1, parts=run.parts)
    assert [len(m) for m in stage_modules] == [2, 1, 2, 3]
    assert [len(m) for m in lm.gpt2_setup(1234, 4, 1)[0]] == [3, 2, 1, 2]  # blocks evenly: type:BlockPipe
    for bad in ("ref_k4_b1.0_parts0-2-8", "ref_k2_b1.0_parts0-5-3", "ref_k2_b1.0_parts1-3-8"):
        with pytest.raises(SystemExit, match="_parts"):
            lm.parse_run(bad)
