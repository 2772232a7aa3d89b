"""``pipeline.fdg.corrections`` (Note [the auto rule] in fdg_schedule/corrections/auto_corrections.py): the keys
"auto" picks
per optimizer family, K, accumulate and scheduler; the config's errors; the reference resolving "auto" itself;
a resume that would choose otherwise refused on every rank; the line a K >= 3 job without the key gets, and the
measured costs it states (Note [the cost of no correction])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import engine_workers
import pytest
import torch
import toy
from deepspeed.runtime.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from dist_harness import run_ranks_calls

from fdg_schedule import FDGConfig, fdg_reference
from fdg_schedule.base.config import CORRECTIONS, FDGConfigError
from fdg_schedule.corrections import auto_corrections
from fdg_schedule.corrections.auto_corrections import (
    FOREVER,
    Schedule,
    check_resume,
    choose,
    recorded,
    resolve,
    schedule_of,
)

ADAM_KEYS = {"delay_momentum_raise": 1.0, "predict_decay": 0.0, "predict_horizon": "first_stage"}


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))]


def _choice(optimizer: Any, stages: int, scheduler: Any = None, accumulate: int = 1, weights: str = "stashed"):
    return choose(optimizer, stages, accumulate, weights, schedule_of(scheduler, optimizer))


@pytest.mark.parametrize("stages", [3, 4, 8])
def test_sgd_with_momentum_lowers_the_delayed_momentum_up_to_the_peak_lr_at_three_stages_and_more(stages) -> None:
    sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    choice = _choice(sgd, stages)
    assert choice.family == "momentum"
    assert choice.keys == {"delay_momentum": True, "delay_momentum_peak_lr": 0.1}
    assert not choice.warning


def test_sgd_with_momentum_at_two_stages_gets_no_correction() -> None:
    sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    assert _choice(sgd, 2).keys == {} and _choice(sgd, 2).family == "momentum"


def test_the_peak_lr_is_read_from_the_scheduler() -> None:
    """rho: DeepSpeed's WarmupLR / WarmupDecayLR max lr (the groups start at the min), WarmupCosineLR's base lrs,
    OneCycle's max, torch's base lrs; the largest over the param groups."""

    def sgd(lr: float = 0.05) -> torch.optim.SGD:
        return torch.optim.SGD([{"params": _params()[:1]}, {"params": _params()[1:], "lr": lr / 2}], lr=lr,
                               momentum=0.9)  # fmt: skip

    opt = sgd()
    assert _choice(opt, 4, WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.3)).keys["delay_momentum_peak_lr"] == 0.3
    opt = sgd()
    decay = WarmupDecayLR(opt, total_num_steps=100, warmup_max_lr=0.2)
    assert _choice(opt, 4, decay).keys["delay_momentum_peak_lr"] == 0.2
    opt = sgd()
    assert _choice(opt, 4, WarmupCosineLR(opt, total_num_steps=100)).keys["delay_momentum_peak_lr"] == 0.05
    opt = sgd()
    cycle = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.4, cycle_first_step_size=10, cycle_momentum=False)
    assert _choice(opt, 4, cycle).keys["delay_momentum_peak_lr"] == 0.4
    opt = sgd()
    multistep = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[5], gamma=0.1)
    assert _choice(opt, 4, multistep).keys["delay_momentum_peak_lr"] == 0.05
    assert _choice(sgd(0.07), 4).keys["delay_momentum_peak_lr"] == 0.07  # no scheduler: the groups' largest lr


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam])
def test_adam_family_predicts_to_stage_0_and_raises_beta1_and_at_three_stages_slows_the_delayed_lr(kind) -> None:
    opt = kind(_params(), lr=1e-3)
    assert _choice(opt, 2).keys == ADAM_KEYS and _choice(opt, 2).family == "betas"
    # no run length: T = 2**62 ticks, a constant tau ** -1
    assert _choice(opt, 3).keys == {**ADAM_KEYS, "delay_lr_ticks": FOREVER}
    # a run of 100 scheduler steps, one per 2 ticks: T = twice its 200 ticks
    cosine = WarmupCosineLR(opt, total_num_steps=100)
    assert _choice(opt, 4, cosine, accumulate=2).keys == {**ADAM_KEYS, "delay_lr_ticks": 400}
    for scheduler, steps in [
        (torch.optim.lr_scheduler.CosineAnnealingLR(kind(_params(), lr=1e-3), T_max=50), 50),
        (torch.optim.lr_scheduler.OneCycleLR(kind(_params(), lr=1e-3), max_lr=1e-3, total_steps=70), 70),
        (WarmupDecayLR(kind(_params(), lr=1e-3), total_num_steps=30), 30),
    ]:
        assert _choice(scheduler.optimizer, 4, scheduler).keys["delay_lr_ticks"] == 2 * steps
    # a ramp's length is not the run's
    linear = torch.optim.lr_scheduler.LinearLR(kind(_params(), lr=1e-3), total_iters=10)
    assert _choice(linear.optimizer, 4, linear).keys["delay_lr_ticks"] == FOREVER


def test_deepspeeds_fused_adam_is_adam_family() -> None:
    from deepspeed.ops.adam import FusedAdam

    assert _choice(FusedAdam(_params(), lr=1e-3), 4).keys == {**ADAM_KEYS, "delay_lr_ticks": FOREVER}


@pytest.mark.parametrize(
    "build, why",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "neither momentum > 0"),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), "neither momentum > 0"),
        (lambda ps: torch.optim.SGD([{"params": ps[:1], "momentum": 0.9}, {"params": ps[1:]}], lr=0.1), "neither"),
    ],
    ids=["sgd-without-momentum", "adagrad", "one-group-without-momentum"],
)
def test_an_optimizer_the_rule_does_not_cover_gets_no_correction_and_a_warning(build, why: str) -> None:
    for rule in ("v1", "v2"):
        choice = choose(build(_params()), 4, 1, "stashed", Schedule(), rule)
        assert choice.family == "uncovered" and choice.keys == {}
        assert why in choice.why and "does not cover" in choice.warning and f"(rule {rule})" in choice.line()


MUON_KEYS = {"predict_decay": 0.0, "predict_horizon": "first_stage"}
MUONS = {
    "deepspeed": lambda: toy.ds_optimizer("Muon", torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))),
    "torch": lambda: torch.optim.Muon(_params()[:1], lr=0.02),
}


@pytest.mark.parametrize("muon", MUONS)
def test_rule_v2_predicts_muons_forwards_to_stage_0_at_three_stages_and_more(muon: str) -> None:
    """DeepSpeed's MuonWithAuxAdam (its Adam half included: one optimizer, one family) and torch's Muon."""
    opt = MUONS[muon]()
    for stages in (3, 4, 8):
        choice = _choice(opt, stages)
        assert (choice.family, choice.keys, choice.rule, choice.warning) == ("muon", MUON_KEYS, "v2", "")
        assert "(rule v2) chose predict_decay=0.0, predict_horizon='first_stage'" in choice.line()
    assert _choice(opt, 2).keys == {} and "uncorrected was +0.24-0.51 % from BP-Muon" in _choice(opt, 2).why
    assert 'measured with weights "stashed"' in _choice(opt, 4, weights="current").warning


def test_rule_v2_predicts_lions_forwards_and_says_how_little_that_was_measured() -> None:
    """DeepSpeed's CPU Lion: rule v2 predicts from its last update to stage 0's tick (the screen's Lion cell: the Adam
    family's keys, which rule v1 gives Lion and v2 gave first, doubled Lion's gap there)."""
    lion = toy.ds_optimizer("Lion", torch.nn.Linear(3, 2))
    for stages in (2, 4):
        choice = _choice(lion, stages)
        assert choice.family == "lion" and choice.keys == MUON_KEYS
        assert "one seed of a development task" in choice.warning and choice.warning in choice.line()
    v1 = choose(lion, 4, 1, "stashed", Schedule(), "v1")
    adam = torch.optim.AdamW(_params(), lr=1e-3)
    assert v1.family == "betas" and v1.keys == _choice(adam, 4).keys and not v1.warning


def test_auto_v1_stays_reachable_and_chooses_what_it_chose() -> None:
    """ "auto-v1" is rule v1 (Muon uncovered, Lion in the betas family); for every other optimizer v1 and v2 choose
    the same keys; "auto" is the newest rule and "auto-v2" names it."""
    assert set(auto_corrections.RULE_OF) == set(CORRECTIONS) - {"none"}
    assert auto_corrections.RULE_OF["auto"] == auto_corrections.LATEST == "v2"
    muon = MUONS["deepspeed"]()
    v1, chose = resolve(FDGConfig(corrections="auto-v1", weights="stashed"), muon, None, 4)
    assert chose is not None and chose.family == "uncovered" and chose.rule == "v1" and "rule v1 has no" in chose.why
    assert recorded(v1) == recorded(FDGConfig(corrections="auto-v1", weights="stashed"))  # no key set
    for name in ("auto", "auto-v2"):
        v2, chose = resolve(FDGConfig(corrections=name, weights="stashed"), muon, None, 4)
        assert chose is not None and chose.keys == MUON_KEYS and (v2.predict_decay, v2.predict_horizon) == (
            0.0, "first_stage")  # fmt: skip
    for opt in (torch.optim.AdamW(_params(), lr=1e-3), torch.optim.SGD(_params(), lr=0.1, momentum=0.9)):
        for stages in (2, 4):
            got = {rule: choose(opt, stages, 1, "stashed", Schedule(0.1, 50), rule).keys for rule in ("v1", "v2")}
            assert got["v1"] == got["v2"], (opt, stages)


def test_a_muon_checkpoint_saved_under_rule_v1_resumes_with_auto_v1_not_auto() -> None:
    muon = MUONS["torch"]()
    saved, _ = resolve(FDGConfig(corrections="auto-v1"), muon, None, 4)
    check_resume(recorded(saved), resolve(FDGConfig(corrections="auto-v1"), muon, None, 4)[0], "stage 0")
    with pytest.raises(FDGConfigError, match=r'"auto" \(rule v2\) chose .*predict_decay: 0.0.* "auto-v1"'):
        check_resume(recorded(saved), resolve(FDGConfig(corrections="auto"), muon, None, 4)[0], "stage 0")


def test_current_weights_keep_the_keys_and_the_log_line_says_the_tested_form_is_stashed() -> None:
    adam, sgd = torch.optim.AdamW(_params(), lr=1e-3), torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    for opt, stages in [(adam, 2), (adam, 4), (sgd, 4)]:
        choice = _choice(opt, stages, weights="current")
        assert choice.keys == _choice(opt, stages).keys
        assert 'measured with weights "stashed"' in choice.warning and choice.warning in choice.line()
    assert not _choice(sgd, 2, weights="current").warning  # nothing applied, nothing to say
    assert _choice(adam, 1).keys == {} and _choice(adam, 1).family == "undelayed"


def test_resolve_fills_the_keys_and_leaves_other_configs_alone() -> None:
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    plain = FDGConfig(grad_shrink=0.5, delay_momentum=True)
    assert resolve(plain, opt, None, 4) == (plain, None)
    config, choice = resolve(FDGConfig(corrections="auto", weights="stashed"), opt, None, 4)
    assert choice is not None and config.corrections == "auto"
    assert (config.delay_momentum, config.delay_momentum_peak_lr) == (True, 0.1)
    assert recorded(config) == {"delay_lr_ticks": 0, "predict_decay": None, "predict_horizon": "own",
                                "delay_momentum": True, "delay_momentum_peak_lr": 0.1,
                                "delay_momentum_raise": None}  # fmt: skip
    with pytest.raises(FDGConfigError, match="no optimizer to read"):
        resolve(FDGConfig(corrections="auto"), None, None, 4)


@pytest.mark.parametrize(
    "block, message",
    [
        ({"corrections": "auto", "delay_momentum": True}, r"corrections is 'auto' and pipeline.fdg sets \['delay_mom"),
        ({"corrections": "none", "predict_decay": 0.5}, r"corrections is 'none' and pipeline.fdg sets \['predict_d"),
        ({"corrections": "Auto"}, r"corrections must be one of \['none', 'auto', 'auto-v1', 'auto-v2'\], got 'Auto'"),
        ({"corrections": "auto-v1", "predict_decay": 0.0}, r"corrections is 'auto-v1' and pipeline.fdg sets \['pre"),
    ],
)
def test_bad_corrections_blocks_name_the_keys_and_the_fix(block: dict[str, Any], message: str) -> None:
    with pytest.raises(FDGConfigError, match=message):
        FDGConfig.from_dict(block)
    with pytest.raises(FDGConfigError, match='"none" is FDG without staleness corrections'):
        FDGConfig(corrections="none", delay_lr_ticks=10)
    assert FDGConfig.from_dict({"corrections": "none"}) == FDGConfig(corrections="none")


def test_a_resume_that_would_choose_otherwise_is_an_error() -> None:
    opt = torch.optim.AdamW(_params(), lr=1e-3)
    before, _ = resolve(FDGConfig(corrections="auto"), opt, WarmupCosineLR(opt, total_num_steps=100), 4)
    after, _ = resolve(FDGConfig(corrections="auto"), opt, WarmupCosineLR(opt, total_num_steps=300), 4)
    check_resume(recorded(before), before, "stage 0")  # the same choice
    check_resume(None, after, "stage 0")  # a checkpoint without "auto"
    with pytest.raises(FDGConfigError, match=r"chose \{delay_lr_ticks: 600\} .* trained with \{delay_lr_ticks: 200\}"):
        check_resume(recorded(before), after, "stage 0")


@pytest.mark.parametrize("name", ["auto", "auto-v1"])
def test_the_reference_resolves_auto_per_stage_as_the_explicit_keys(name: str) -> None:
    """fdg_reference with corrections "auto" (or a named rule) trains exactly as with the keys the rule chose,
    written out."""
    finals = []
    for config in (
        FDGConfig(corrections=name, weights="stashed"),
        FDGConfig(weights="stashed", delay_momentum=True, delay_momentum_peak_lr=0.1),
        FDGConfig(weights="stashed"),
    ):
        stages = toy.reference_stages([0, 3, 6, 9])
        opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
        fdg_reference(stages, opts, toy.micro_batches(12, 4), toy.loss_fn, config, drain=True)
        finals.append([p.detach().clone() for s in stages for p in s.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(finals[0], finals[1]))
    assert not all(torch.equal(a, c) for a, c in zip(finals[0], finals[2]))  # the keys changed the training


@pytest.mark.distributed
def test_resume_with_another_auto_choice_is_refused_on_every_rank(tmp_path) -> None:
    """Saved under "auto" with a 100-step cosine schedule (T = 200 ticks), loaded with a 300-step one: every rank
    raises before DeepSpeed's load."""
    base = {"stages": 3, "n": 48, "gas": 3, "optimizer": "adamw", "corrections": "auto", "weights": "stashed"}
    saved, loaded = {**base, "cosine_steps": 100}, {**base, "cosine_steps": 300}
    calls = [(engine_workers.auto_resume_refused, (saved, loaded, str(tmp_path / "ckpt")))]
    [errors] = run_ranks_calls(3, tmp_path, calls, deadline_s=120)
    assert all("chose {delay_lr_ticks: 600}" in e and "trained with {delay_lr_ticks: 200}" in e for e in errors), errors


def test_the_choice_goes_into_each_stages_wandb_config() -> None:
    """tracking.run_config (what each stage's W&B run is given): "auto" and the keys it chose, no internal field."""
    from types import SimpleNamespace

    from fdg_schedule.observability import tracking

    opt = torch.optim.AdamW(_params(), lr=1e-3)
    config, _ = resolve(FDGConfig(corrections="auto", weights="stashed"), opt, WarmupCosineLR(opt, 50), 4)
    from fdg_schedule.observability.view import StageIds

    ids = StageIds(stage_id=1, num_stages=4, global_rank=1, dp_id=0, dp_world_size=1)
    view = SimpleNamespace(ids=ids, config=config, micro_batch_size=8, gradient_accumulation_steps=4)
    fdg = tracking.run_config(view, {})["fdg"]
    assert fdg["corrections"] == "auto" and fdg["delay_lr_ticks"] == 100 and fdg["delay_momentum_raise"] == 1.0
    assert fdg["predict_decay"] == 0.0 and fdg["predict_horizon"] == "first_stage"
    assert not any(key.startswith("_") for key in fdg)


def test_the_reference_decides_once_across_calls() -> None:
    """A run in several fdg_reference calls (one ReferenceState) keeps the first call's choice, as the engine keeps
    what it chose at initialize: the peak lr of 0.1, not the decayed lr a later call would read."""
    from fdg_schedule.corrections.reference import ReferenceState

    stages = toy.reference_stages([0, 3, 6, 9])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    state, config = ReferenceState(), FDGConfig(corrections="auto", weights="stashed")
    fdg_reference(stages, opts, toy.micro_batches(4, 4), toy.loss_fn, config, state=state)
    for opt in opts:
        opt.param_groups[0]["lr"] = 0.01
    fdg_reference(stages, opts, toy.micro_batches(4, 4), toy.loss_fn, config, state=state)
    assert state.configs is not None and {c.delay_momentum_peak_lr for c in state.configs} == {0.1}


ROOT = Path(__file__).resolve().parents[1]


def test_the_measured_costs_are_the_auto_tests_report() -> None:
    """MEASURED_K4 is docs/results/auto/report.json's mean paired differences at K = 4, rounded as the docs state
    them, from complete tasks with no failed run; docs/staleness.md states the same numbers as the log line."""
    tasks = json.loads((ROOT / "docs" / "results" / "auto" / "report.json").read_text())["tasks"]
    assert {m.task for m in auto_corrections.MEASURED_K4} == set(tasks)
    for m in auto_corrections.MEASURED_K4:
        assert tasks[m.task]["unit"] == m.unit, m
        for arm in ("none", "auto"):
            row = tasks[m.task][arm]
            assert row["n"] == (24 if m.task == "resnet32" else 8) and row["failed"] == 0, (m.task, arm)
            assert round(row["mean"], 2) == getattr(m, arm), (m.task, arm, row["mean"])
    staleness = (ROOT / "docs" / "staleness.md").read_text()
    for arm in ("none", "auto"):
        assert auto_corrections.measured_costs(arm) in staleness, auto_corrections.measured_costs(arm)


OPTIMIZERS = {
    "sgd-momentum": lambda: torch.optim.SGD(_params(), lr=0.1, momentum=0.9),
    "adamw": lambda: torch.optim.AdamW(_params(), lr=1e-3),
    "plain-sgd": lambda: torch.optim.SGD(_params(), lr=0.1),
}


@pytest.mark.parametrize(
    ("config", "stages", "optimizer", "expected"),
    [
        (FDGConfig(), 3, "sgd-momentum", True),
        (FDGConfig(weights="stashed"), 8, "adamw", True),
        (FDGConfig(), 2, "sgd-momentum", False),  # K = 2: the test measured K = 4
        (FDGConfig(corrections="none"), 4, "adamw", False),  # a choice made
        (FDGConfig(delay_momentum=True), 4, "sgd-momentum", False),  # a correction of the user's own
        (FDGConfig(predict_decay=0.9), 4, "adamw", False),
        (FDGConfig(), 4, "plain-sgd", False),  # "auto" chooses no correction here either
    ],
)
def test_the_no_correction_line_is_for_k3_and_more_without_the_key(config, stages, optimizer, expected) -> None:
    line = auto_corrections.no_correction_line(config, OPTIMIZERS[optimizer](), stages)
    assert (line is not None) == expected, line
    if line is not None:
        assert f"K = {stages} job" in line and 'Set "corrections": "auto"' in line and "docs/staleness.md" in line
        assert auto_corrections.measured_costs("none") in line and auto_corrections.measured_costs("auto") in line


def test_a_muon_job_without_the_key_hears_muons_measured_cost() -> None:
    """MUON_NONE_K4 is docs/results/muon/report.json's FDG-Muon K = 4 - BP-Muon (5 seeds each), rounded; the line
    says that rule v2's Muon keys are not tested on held-out tasks; under K = 3 or with "none" no line."""
    tasks = json.loads((ROOT / "docs" / "results" / "muon" / "report.json").read_text())["tasks"]
    for m in auto_corrections.MUON_NONE_K4:
        (row,) = [v for k, v in tasks[m.task]["comparisons"].items() if k.startswith("FDG-Muon K=4 vs BP-Muon")]
        assert row["n"] == 5 and round(row["mean"], 2) == m.none, (m, row["mean"])
    muon = MUONS["torch"]()
    line = auto_corrections.no_correction_line(FDGConfig(), muon, 4)
    assert line is not None and "LLaMA-style +2.22 %, GPT-2 +4.20 %" in line and "not yet tested" in line
    assert auto_corrections.measured_costs("none") not in line  # AdamW's and SGD's numbers are not Muon's
    assert auto_corrections.no_correction_line(FDGConfig(), muon, 2) is None
    assert auto_corrections.no_correction_line(FDGConfig(corrections="none"), muon, 4) is None


def _notices(ranks: list[list[str]]) -> list[list[str]]:
    return [[w for w in warnings if 'no "corrections" key' in w] for warnings in ranks]


@pytest.mark.distributed
def test_a_k3_engine_without_the_key_says_once_on_rank_0_what_no_correction_cost(tmp_path) -> None:
    """Real engines: K = 3 with no corrections key logs the line once, on global rank 0 only; "none", explicit keys
    and "auto" do not, and neither does K = 2 (its own launch)."""
    base = {"stages": 3, "n": 12, "gas": 3}
    cases = [base, {**base, "corrections": "none"}, {**base, "delay_momentum": True}, {**base, "corrections": "auto"}]
    (tmp_path / "k3").mkdir()
    (tmp_path / "k2").mkdir()
    default, none, explicit, auto = run_ranks_calls(
        3, tmp_path / "k3", [(engine_workers.start_warnings, (case,)) for case in cases], deadline_s=180
    )
    assert len(_notices(default)[0]) == 1 and _notices(default)[1:] == [[], []], default
    line = _notices(default)[0][0]
    assert "K = 3 job" in line and auto_corrections.measured_costs("none") in line, line
    assert _notices(none) == _notices(explicit) == _notices(auto) == [[], [], []], (none, explicit, auto)
    [k2] = run_ranks_calls(2, tmp_path / "k2", [(engine_workers.start_warnings, ({**base, "stages": 2},))], 120)
    assert _notices(k2) == [[], []], k2
