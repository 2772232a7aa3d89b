"""The planner ranks by time to the same loss: samples/s / r, r = FDG's token overhead (1 for synchronous schedules).

Note [ranking by time to loss] in fdg_schedule/plan/recommend.py. The model: 8 identical layers (forward 1 s,
backward 2 s), no step, free links; the flushing schedules run m = 4K micro-batches per batch. At K = 4 FDG's tick
is 3 s per micro-batch on its slowest stage; 1F1B's batch of 16 takes (16 + 3) x 3 s: FDG is 19/16 = 1.1875 times as
fast per step, so its break-even r is 1.1875.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from plan_helpers import uniform_profile

from fdg_schedule.plan import Cluster, Prediction, Variant
from fdg_schedule.plan.__main__ import main
from fdg_schedule.plan.costs import profile_to_dict
from fdg_schedule.plan.overheads import Overheads
from fdg_schedule.plan.recommend import Plan, describe, plan, table
from fdg_schedule.plan.token_overhead import Recorded, Setting

PER_STEP = 19 / 16


def planned(overheads: Overheads | None = None, stages: tuple[int, ...] = (4,)) -> Plan:
    return plan(uniform_profile(8), Cluster(memory=1e9), list(stages), [Variant("fdg"), Variant("1f1b")],
                micro_batches=lambda k: 4 * k, overheads=overheads)  # fmt: skip


def by(result: Plan, name: str, k: int = 4) -> Prediction:
    return next(p for p in result.predictions if p.variant.name == name and p.stages == k)


def test_the_per_step_ratio_is_over_the_fastest_synchronous_schedule_at_the_same_k() -> None:
    result = planned()
    assert result.per_step(by(result, "fdg current/stored")) == pytest.approx(PER_STEP, rel=1e-5)
    assert result.per_step(by(result, "deepspeed 1f1b")) == 1.0
    assert result.r(by(result, "deepspeed 1f1b")).r == 1.0


def test_unknown_r_ranks_fdg_by_its_per_step_speed_and_says_the_pick_is_conditional() -> None:
    result = planned()
    pick, alt = result.recommendation, result.alternative
    assert pick is not None and pick.variant.schedule == "fdg" and not result.r(pick).known
    assert alt is not None and alt.variant.name == "deepspeed 1f1b"
    assert result.break_even() == pytest.approx(PER_STEP, rel=1e-5)
    text = describe(pick, result)
    assert "CONDITIONAL: 1.19x the fastest synchronous schedule at this K per step, but its token overhead r is " \
           "unknown (no measurement of family None" in text  # fmt: skip
    assert "it reaches the loss before deepspeed 1f1b at K=4 (0.561 samples/s) only if r < 1.19" in text
    assert result.to_dict()["recommendation_conditional"] is True


def test_a_known_r_above_the_per_step_ratio_makes_the_synchronous_schedule_the_pick() -> None:
    result = planned(Overheads(value=1.25))
    assert result.recommendation is not None and result.recommendation.variant.name == "deepspeed 1f1b"
    text = describe(result.recommendation, result)
    assert "FDG's fastest per step, fdg current/stored at K=4 (0.667 samples/s), 1.19x the fastest synchronous " \
           "schedule at its K per step, needs r = 1.25 times the tokens (--token-overhead 1.25): net 0.95x, so a " \
           "synchronous schedule reaches the loss sooner." in text  # fmt: skip
    # the table prints the per-step ratio and the net one side by side: 1.1875 / 1.25 = 0.95
    assert "| ×sync | r | net |" in table(result)
    assert "| 0.667 | 4.00 | 1.19 | 1.25 | 0.95 |" in table(result)
    assert "| 0.561 | 3.37 | 1.00 | 1 | 1.00 |" in table(result)


def test_a_known_r_below_the_per_step_ratio_keeps_fdg_with_its_net_speedup() -> None:
    recorded = Recorded(Setting(), 1.1, None, 1.15, 5, 2.0, "mine.json")
    result = planned(Overheads(recorded=recorded))
    assert result.recommendation is not None and result.recommendation.variant.schedule == "fdg"
    assert result.alternative is None and result.break_even() is None
    text = describe(result.recommendation, result)
    # 1.1875 / 1.1 = 1.08; at r's upper bound 1.1875 / 1.15 = 1.03
    assert "Time to loss: 1.19x the fastest synchronous schedule at this K per step; token overhead r = 1.10 (≤1.15) " \
           "(--token-overhead mine.json (5 seeds)): net 1.08x (1.03x at r's 95 % upper bound)." in text  # fmt: skip


@pytest.mark.parametrize(("at_least", "pick"), [(1.2, "deepspeed 1f1b"), (1.1, "fdg current/stored")])
def test_r_only_bounded_below_ranks_fdg_at_the_bound(at_least: float, pick: str) -> None:
    recorded = Recorded(Setting(), None, at_least, None, 3, 1.0, "capped.json")
    result = planned(Overheads(recorded=recorded))
    assert result.recommendation is not None and result.recommendation.variant.name == pick
    text = describe(result.recommendation, result)
    if pick == "deepspeed 1f1b":  # even at r = 1.2 FDG loses: 1.1875 / 1.2 = 0.99 < 1, whatever r is above it
        assert "needs r = > 1.20 times the tokens (--token-overhead capped.json (3 seeds)): net < 0.99x" in text
    else:  # at r = 1.1 it would win; above 1.1875 it would not: conditional
        assert "its token overhead r is only bounded below, r > 1.10" in text and "ranked at r = 1.10" in text
        assert "only if r < 1.19 (the break-even r)" in text


def test_a_users_measurement_applies_only_where_its_recorded_setting_matches() -> None:
    recorded = Recorded(Setting(stages=2), 1.05, None, None, 1, 2.0, "k2.json")
    result = planned(Overheads(recorded=recorded), stages=(2, 4))
    assert result.r(by(result, "fdg current/stored", 2)).r == 1.05
    assert not result.r(by(result, "fdg current/stored", 4)).known


def test_the_shipped_table_gives_r_where_the_setting_was_measured() -> None:
    # K = 4, m = K = 4 micro-batches per batch: FDG with accumulate 1 was measured against BP at 4 per step
    gpt = Overheads(family="gpt", optimizer="adamw", corrections="auto")
    result = plan(uniform_profile(8), Cluster(memory=1e9), [4], [Variant("fdg"), Variant("fdg", accumulate=None),
                  Variant("1f1b")], micro_batches=lambda k: k, overheads=gpt)  # fmt: skip
    one, acc = result.r(by(result, "fdg current/stored")), result.r(by(result, "fdg current/stored acc=m"))
    assert one.known and one.source.startswith("measured on a small GPT-2") and 0.8 < (one.r or 0) < 0.9
    assert not acc.known and "accumulate 4, baseline_batch 4" in acc.source
    assert "FDG's token overhead r (against backprop at the job's batch):" in table(result)


def test_a_named_auto_rule_finds_the_rows_of_the_rule_that_chose_the_same_keys() -> None:
    """The shipped "auto" rows were measured under rule v1 with AdamW, where v1 and v2 choose the same keys: "auto",
    "auto-v1" and "auto-v2" find them; for Muon (the rules differ) "auto" is v2 and "auto-v1" another setting."""
    from fdg_schedule.corrections import auto_corrections
    from fdg_schedule.plan import overheads

    assert f"auto-{auto_corrections.LATEST}" == overheads.LATEST_AUTO and set(auto_corrections.RULE_OF) == {
        "auto", "auto-v1", "auto-v2"}  # fmt: skip
    row = next(m.setting for m in overheads.measured() if m.setting.corrections == "auto")
    found = [overheads.lookup(dataclasses.replace(row, corrections=n)) for n in ("auto", "auto-v1", "auto-v2")]
    assert found[0] is not None and found[0].setting == row and found[1] == found[2] == found[0]
    muon = Setting("llama", "muon", 4, "auto", 1, 1)
    assert overheads.same_keys(muon).corrections == "auto-v2"
    assert overheads.same_keys(dataclasses.replace(muon, corrections="auto-v1")).corrections == "auto-v1"


def test_the_command_line_takes_r_or_the_measures_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_to_dict(uniform_profile(8))))
    base = ["--profile", str(profile), "--stages", "4", "--schedules", "fdg,1f1b", "--fdg-modes", "current/stored",
            "--fdg-accumulate", "1", "--memory-limit", "1GB"]  # fmt: skip
    assert main([*base, "--token-overhead", "1.25", "--json", str(tmp_path / "plan.json")]) == 0
    assert "needs r = 1.25 times the tokens" in capsys.readouterr().out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["recommendation"]["schedule"] == "deepspeed 1f1b" and saved["break_even_r"] is None
    fdg = next(p for p in saved["predictions"] if p["schedule"] == "fdg current/stored")
    assert fdg["token_overhead"]["r"] == 1.25 and fdg["per_step_over_synchronous"] == pytest.approx(PER_STEP, rel=1e-5)
    measured = tmp_path / "r.json"
    measured.write_text(json.dumps({"format": "fdg_schedule.token_overhead/1", "setting": {"stages": 4}, "r": 1.1,
                                    "r_at_least": None, "upper_95": 1.15, "n": 5, "cap": 2.0}))  # fmt: skip
    assert main([*base, "--token-overhead", str(measured)]) == 0
    out = capsys.readouterr().out
    assert f"token overhead r = 1.10 (≤1.15) (--token-overhead {measured} (5 seeds)): net 1.08x" in out
