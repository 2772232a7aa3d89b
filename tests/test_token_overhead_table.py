"""The shipped token overheads (fdg_schedule/plan/measured_overheads.py) are what the committed script computes.

``python -m benchmarks.studies.token_overheads`` reads the recorded curves under docs/results/staleness/; a setting
it does not list is unknown to the planner.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks.studies.token_overheads import SETTINGS, TABLE, TTL, derive, markdown, module_text, table
from fdg_schedule.plan.measured_overheads import ENTRIES
from fdg_schedule.plan.overheads import SETTING_KEYS, Overheads, lookup, measured
from fdg_schedule.plan.token_overhead import Setting

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_table_equals_what_the_script_computes_from_the_curves() -> None:
    computed = table()
    assert computed == ENTRIES
    assert TABLE.read_text() == module_text(computed), "rewrite: python -m benchmarks.studies.token_overheads --write"


def test_the_doc_shows_the_shipped_table() -> None:
    text = (ROOT / "docs" / "token-overhead.md").read_text()
    after = text.split("<!-- TABLE: python -m benchmarks.studies.token_overheads -->\n")[1]
    shown = after.split("\n<!-- /TABLE -->")[0]
    assert shown == markdown(ENTRIES)


def test_every_entry_states_its_bound_seeds_cap_and_evidence() -> None:
    keys = [tuple(e[k] for k in ("family", "optimizer", "stages", "corrections", "accumulate", "baseline_batch"))
            for e in ENTRIES]  # fmt: skip
    assert len(set(keys)) == len(keys) == len(SETTINGS)
    for e in ENTRIES:
        assert e["n"] == len(e["seeds"]) >= 2 and 0 <= e["reached"] <= e["n"]
        # the staleness log's FDG runs stopped at BP's tokens; the time-to-loss test's ran on to twice them
        assert e["cap"] == (2.0 if e["evidence"][0].startswith(TTL) else 1.0)
        if e["reached"] == e["n"]:
            assert e["r"] is not None and e["upper_95"] >= e["r"] and e["r_at_least"] is None
        else:  # a seed that did not reach: r is only bounded below, never dropped
            assert e["r"] is None and e["upper_95"] is None and e["r_at_least"] is not None
            logs = [math.log(r if r is not None else cap) for _, r, cap in e["seeds"]]
            assert e["r_at_least"] == pytest.approx(math.exp(sum(logs) / len(logs)), abs=1e-4)
        assert all((ROOT / path).exists() for path in e["evidence"]) and e["evidence"]


def test_a_setting_not_measured_is_unknown_not_a_neighbours_value() -> None:
    k4 = Setting("gpt", "adamw", 4, "auto", 1, 4)
    assert lookup(k4) is not None and lookup(k4) in measured()
    for other in (dataclasses.replace(k4, stages=8), dataclasses.replace(k4, family="llama"),
                  dataclasses.replace(k4, baseline_batch=16), dataclasses.replace(k4, optimizer="muon")):  # fmt: skip
        assert lookup(other) is None
    r = Overheads(family="gpt", optimizer="adamw", corrections="auto").for_fdg(8, 1, 8)
    assert not r.known and r.at_least is None and r.text() == "?" and r.source.startswith("no measurement of")


def test_fdg_at_one_micro_batch_per_step_against_bp_at_four_reached_bps_loss_on_every_seed() -> None:
    # the one fully reached entry: K = 4, accumulate 1, against BP at 4 micro-batches per step (1,433,600 tokens)
    e = lookup(Setting("gpt", "adamw", 4, "auto", 1, 4))
    assert e is not None and e.r is not None and e.upper_95 is not None
    assert 0.8 < e.r < e.upper_95 < 0.9 and e.n == 5


def test_a_new_measurement_enters_through_curve_paths_and_gives_the_same_r() -> None:
    # how the lead's new runs enter: per seed (seed, BASELINE, DELAYED) as PATH[:RUN] (load_curve); here two seeds
    # of the K = 4 row against BP at 4 micro-batches per step, named by path instead of by run name
    long, split = (
        "docs/results/staleness/staleness_gpt2_long.json",
        "docs/results/staleness/staleness_gpt2_split_long.json",
    )
    run = "ref_k4_b1.0_stashed_dlr2800_p0.0_first_r1_parts0-1-2-4-8"
    setting = Setting("gpt", "adamw", 4, "auto", 1, 4)
    row = SETTINGS[[r.setting for r in SETTINGS].index(setting)]
    by_path = dataclasses.replace(row, curves=((1234, f"{long}:bp_a4", f"{split}:{run}"),
                                               (1, f"{long}:bp_a4_s1", f"{split}:{run}_s1")))  # fmt: skip
    entry = derive(by_path)
    shipped = next(e for e in ENTRIES if tuple(e[k] for k in ("stages", "accumulate", "baseline_batch")) == (4, 1, 4))
    assert entry["seeds"] == shipped["seeds"][:2] and entry["evidence"] == sorted([long, split])
    assert entry["n"] == 2 and entry["baseline"] == f"{long}:bp_a4"


def test_the_time_to_loss_rows_equal_the_pre_registered_analysis() -> None:
    # the shipped rows of the time-to-loss test against its analysis (docs/results/time_to_loss/analysis.json,
    # written by the test's own runner at its frozen commit): same r, bounds and seeds
    analysis = json.loads((ROOT / "docs/results/time_to_loss/analysis.json").read_text())
    ttl = [e for e in ENTRIES if e["evidence"][0].startswith(TTL)]
    assert ttl, "no time-to-loss row shipped"
    for e in ttl:
        (config,) = [c for c in analysis["configs"] if (c["optimizer"], c["K"]) == (e["optimizer"], e["stages"])
                     and c["task"] == ("lm" if e["family"] == "llama" else e["family"])]  # fmt: skip
        row = config[f"against_bp_a{e['baseline_batch']}"]
        assert (e["n"], e["reached"], e["cap"]) == (row["n"], row["reached"], 2.0) == (6, 6, 2.0)
        assert e["r"] == pytest.approx(row["r"], abs=1e-4) and e["upper_95"] == pytest.approx(row["upper_95"], abs=1e-4)
        assert [s[1] for s in e["seeds"]] == pytest.approx([s["r"] for s in row["seeds"]], abs=1e-4)
        assert lookup(Setting(**{k: e[k] for k in SETTING_KEYS})) is not None
