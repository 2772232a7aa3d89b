"""fdg_schedule.plan.token_overhead: r, the band, r over seeds with its t bound, the net speed-up, curves, the CLI.

Every expected value is computed by hand in the comment beside it (docs/token-overhead.md states the formulas).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fdg_schedule.plan.overheads import parse_token_overhead
from fdg_schedule.plan.token_overhead import (
    Overhead,
    Setting,
    Summary,
    load_curve,
    main,
    measure,
    net_speedup,
    read,
    summarize,
    t_quantile,
    token_overhead,
    tokens_to_reach,
    write,
)

CURVE = [(100, 6.0), (200, 5.0), (300, 4.0)]


@pytest.mark.parametrize(
    ("target", "tokens"),
    [
        (4.5, 250.0),  # between 200 (5.0) and 300 (4.0): 200 + (5.0 - 4.5) / (5.0 - 4.0) x 100
        (5.0, 200.0),  # an exact hit on an evaluation: that evaluation's tokens
        (4.0, 300.0),  # the last evaluation, exactly
        (7.0, 100.0),  # already below at the first evaluation: nothing is known before it
        (3.9, None),  # never reached within the curve
    ],
)
def test_tokens_to_reach_interpolates_linearly_between_evaluations(target: float, tokens: float | None) -> None:
    assert tokens_to_reach(CURVE, target) == (None if tokens is None else pytest.approx(tokens))


def test_the_first_crossing_counts_not_a_later_one() -> None:
    dips = [(100, 6.0), (200, 4.0), (300, 5.0), (400, 3.0)]
    # 4.5 is crossed between 100 and 200 (100 + 1.5 / 2 x 100 = 175), again between 300 and 400 (325): 175 counts
    assert tokens_to_reach(dips, 4.5) == pytest.approx(175.0)
    # 3.5 is reached only after the rise: 300 + (5.0 - 3.5) / (5.0 - 3.0) x 100 = 375
    assert tokens_to_reach(dips, 3.5) == pytest.approx(375.0)


BASELINE = [(100, 6.0), (200, 5.0), (400, 4.0)]
DELAYED = [(100, 6.5), (200, 5.5), (400, 4.5), (600, 3.9)]


def test_r_at_the_baselines_final_loss_and_along_the_band() -> None:
    # target 4.0, BP's final loss at 400 tokens; FDG crosses it between 400 (4.5) and 600 (3.9):
    # 400 + 0.5 / 0.6 x 200 = 566.67 tokens, r = 566.67 / 400 = 1.4167; cap = 600 / 400 = 1.5
    o = token_overhead(BASELINE, DELAYED)
    assert (o.target, o.baseline_tokens, o.cap) == (4.0, 400.0, 1.5)
    assert o.tokens == pytest.approx(1700 / 3) and o.r == pytest.approx(1700 / 3 / 400)
    # half way: BP had 5.0 at 200 tokens; FDG reaches 5.0 at 200 + 0.5 / 1.0 x 200 = 300: r = 1.5, cap 3
    half = token_overhead(BASELINE, DELAYED, 0.5)
    assert (half.target, half.baseline_tokens, half.r, half.cap) == (5.0, 200.0, pytest.approx(1.5), 3.0)
    # at 0.75 (300 tokens, between BP's 200 and 400): BP's loss 4.5; FDG reaches 4.5 at its evaluation at 400
    three = token_overhead(BASELINE, DELAYED, 0.75)
    assert three.target == pytest.approx(4.5) and three.r == pytest.approx(400 / 300)


def test_a_run_that_never_reaches_is_greater_than_its_cap() -> None:
    capped = DELAYED[:3]  # FDG stopped at 400 tokens (1x BP's) at 4.5 > 4.0
    o = token_overhead(BASELINE, capped)
    assert o.r is None and not o.reached and o.cap == 1.0 and str(o) == "> 1"


def test_curves_are_checked() -> None:
    with pytest.raises(ValueError, match=r"tokens must rise from one evaluation to the next, got 200 then 200"):
        tokens_to_reach([(100, 5.0), (200, 4.0), (200, 3.0)], 3.5)
    with pytest.raises(ValueError, match="non-finite evaluations"):
        tokens_to_reach([(100, 5.0), (200, math.nan)], 3.5)
    with pytest.raises(ValueError, match="has no evaluations"):
        tokens_to_reach([], 3.5)
    with pytest.raises(ValueError, match=r"use fractions of at least 0\.25"):
        token_overhead(BASELINE, DELAYED, 0.1)


@pytest.mark.parametrize(
    ("q", "df", "t"),
    [(0.95, 1, 6.3138), (0.95, 2, 2.9200), (0.95, 4, 2.1318), (0.95, 6, 1.9432), (0.95, 9, 1.8331),
     (0.95, 30, 1.6973), (0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.975, 100, 1.9840)],
)  # fmt: skip
def test_t_quantile_matches_the_printed_tables(q: float, df: int, t: float) -> None:
    assert t_quantile(q, df) == pytest.approx(t, abs=6e-5)


def _seeds(*rs: float | None, cap: float = 1.5) -> Summary:
    return Summary(tuple(Overhead(4.0, 100.0, None if r is None else 100.0 * r, cap) for r in rs))


def test_r_over_seeds_is_the_geometric_mean_with_a_one_sided_t_bound_on_log_r() -> None:
    s = _seeds(1.1, 1.2, 1.3)
    # log r: 0.0953102, 0.1823216, 0.2623643; mean 0.1799987, sd 0.0835512 (n - 1 = 2)
    assert s.mean_log == pytest.approx(0.1799987, abs=1e-7) and s.sd_log == pytest.approx(0.0835512, abs=1e-7)
    assert s.r == pytest.approx(1.197216, abs=1e-6)  # exp(0.1799987)
    # t(0.95, 2) = 2.919986: exp(0.1799987 + 2.919986 x 0.0835512 / sqrt 3) = exp(0.3208540) = 1.378310
    assert s.upper == pytest.approx(1.378310, abs=1e-5)
    # t(0.975, 2) = 4.302653: half width 0.2075530, exp(0.1799987 -+ it) = 0.972822, 1.473368
    assert s.interval == (pytest.approx(0.972822, abs=1e-5), pytest.approx(1.473368, abs=1e-5))
    assert (s.n, s.reached, s.at_least, s.r_text(), s.upper_text()) == (3, 3, None, "1.197", "1.378")


def test_a_seed_that_does_not_reach_enters_at_its_cap_and_the_result_is_a_lower_bound() -> None:
    s = _seeds(1.2, None, cap=1.5)
    # never dropped: log r of the second seed is at least log 1.5, so r > exp((log 1.2 + log 1.5) / 2) = sqrt 1.8
    assert s.r is None and s.upper is None and s.interval is None
    assert s.at_least == pytest.approx(math.sqrt(1.8))
    assert (s.n, s.reached, s.r_text(), s.upper_text()) == (2, 1, "> 1.342", "> 1.342")


def test_one_seed_has_no_bound() -> None:
    s = _seeds(1.25)
    assert s.r == pytest.approx(1.25) and s.upper is None and s.upper_text() == "n/a (one seed)"


def test_net_speedup_is_the_throughput_ratio_over_r_and_its_bound_uses_rs_upper_bound() -> None:
    net = net_speedup(1.2, _seeds(1.1, 1.2, 1.3))
    assert net.value == pytest.approx(1.2 / 1.197216, abs=1e-6)  # 1.00233: just worth it
    assert net.lower == pytest.approx(1.2 / 1.378310, abs=1e-5)  # 0.87063 at r's upper bound
    capped = net_speedup(1.2, _seeds(1.2, None, cap=1.5))
    assert capped.value is None and capped.at_most == pytest.approx(1.2 / math.sqrt(1.8)) and str(capped) == "< 0.894"
    with pytest.raises(ValueError, match="throughput ratio must be > 0, got 0"):
        net_speedup(0.0, _seeds(1.1))


def test_measure_pairs_seeds_and_writes_json_the_planner_reads(tmp_path: Path) -> None:
    pairs = [(BASELINE, DELAYED), ([(100, 6.0), (200, 5.0), (400, 4.2)], DELAYED)]
    # seed 1: BP's final 4.2 at 400; FDG reaches 4.2 at 400 + 0.3 / 0.6 x 200 = 500: r = 1.25
    m = measure(pairs, setting=Setting("gpt", "adamw", 4, "auto", 1, 4), throughput_ratio=1.3)
    assert [o.r for o in m.final.seeds] == [pytest.approx(1700 / 1200), pytest.approx(1.25)]
    assert m.final.r == pytest.approx(math.sqrt(1700 / 1200 * 1.25))
    assert [f for f, _ in m.band] == [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    path = write(tmp_path / "r.json", m)
    data = json.loads(path.read_text())
    assert m.final.r is not None and data["net_speedup"]["value"] == pytest.approx(1.3 / m.final.r)
    assert data["seeds"][1]["tokens"] == pytest.approx(500.0)
    back = read(path)
    assert back.r == pytest.approx(m.final.r) and back.setting == Setting("gpt", "adamw", 4, "auto", 1, 4)
    assert back.upper_95 == pytest.approx(m.final.upper) and back.n == 2
    assert parse_token_overhead(str(path))[1] == back and parse_token_overhead("1.4") == (1.4, None)


def test_read_refuses_a_file_that_is_not_a_measurement(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text(json.dumps({"runs": {}}))
    with pytest.raises(ValueError, match="is not a token-overhead measurement"):
        read(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"format": "fdg_schedule.token_overhead/1", "r": 1.2}))
    with pytest.raises(ValueError, match=r"lacks \['r_at_least', 'upper_95', 'n', 'cap'\]"):
        read(tmp_path / "y.json")
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError, match="must be a number > 0"):
            parse_token_overhead(bad)
    with pytest.raises(ValueError, match="is neither a number .* nor a file"):
        parse_token_overhead(str(tmp_path / "missing.json"))


def test_curves_load_from_the_projects_run_files(tmp_path: Path) -> None:
    staleness = tmp_path / "staleness.json"  # docs/results/staleness/staleness_gpt2_*.json
    staleness.write_text(json.dumps({"what": "x", "runs": {"bp": {"val": [[100, 6.0], [200, 5.0]], "wall_s": 1},
                                                           "fdg": {"val": [[100, 6.5], [200, 5.5]]}}}))  # fmt: skip
    assert load_curve(f"{staleness}:bp") == [(100.0, 6.0), (200.0, 5.0)]
    with pytest.raises(ValueError, match=r"holds runs \['bp', 'fdg'\]; name one as .*:RUN \('ref' is not among"):
        load_curve(f"{staleness}:ref")
    run = tmp_path / "bp"  # lm_convergence's output folder: metrics.jsonl, training rows and evaluations
    run.mkdir()
    rows = [{"step": 1, "tokens": 1024, "train_loss": 7.0}, {"step": 100, "tokens": 102400, "val_loss": 6.2}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_curve(str(run)) == load_curve(str(run / "metrics.jsonl")) == [(102400.0, 6.2)]
    rows_json = tmp_path / "k4.json"  # staleness_gpt2_k4_momentum.json's "validation" rows
    rows_json.write_text(json.dumps({"validation": [{"step": 100, "tokens": 102400, "val_loss": 6.3}]}))
    assert load_curve(str(rows_json)) == [(102400.0, 6.3)]
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([[1, 3.0], [2, 2.0]]))
    assert load_curve(str(plain)) == [(1.0, 3.0), (2.0, 2.0)]


def test_the_command_line_prints_r_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({"runs": {"bp": {"val": BASELINE}, "fdg": {"val": DELAYED[:3]}}}))
    out = tmp_path / "r.json"
    argv = [f"{runs}:bp", f"{runs}:fdg", "--throughput-ratio", "1.1", "--json", str(out), "--stages", "4"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "r = > 1.000 over 1 seeds (0 reached" in text and "net speed-up = 1.1 / r = < 1.100: undecided" in text
    assert "- f = 0.5: r = 1.500" in text  # BP's 5.0 at 200 tokens, FDG's at 300
    assert read(out).r_at_least == pytest.approx(1.0) and read(out).setting.stages == 4
    with pytest.raises(SystemExit):
        main([f"{runs}:bp"])
    assert "give curves in pairs, BASELINE DELAYED per seed; got 1" in capsys.readouterr().err


def test_summarize_needs_pairs() -> None:
    with pytest.raises(ValueError, match="no \\(baseline, delayed\\) pairs"):
        summarize([])


def test_by_train_s_reads_the_recipes_training_seconds_and_gives_the_time_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """recipes/train_lm.py's metrics.jsonl carries train_s: against it, r is FDG's seconds to the baseline's final
    loss over the baseline's seconds, and 1 / r the net speed-up (docs/token-overhead.md, "Timing your own job")."""

    def run(name: str, evals: list[tuple[int, float, float]]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        rows = [
            {"step": i, "tokens": t, "val_loss": v, "time": s + 1, "train_s": s} for i, (t, v, s) in enumerate(evals)
        ]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder

    base = run("1f1b", [(4000, 5.5, 50.0), (8000, 5.0, 100.0)])
    fdg = run("fdg", [(2000, 5.2, 40.0), (4000, 4.8, 60.0)])  # crosses 5.0 at 50 s (and 3,000 tokens)
    assert load_curve(str(fdg), "train_s") == [(40.0, 5.2), (60.0, 4.8)]
    assert main([str(base), str(fdg), "--by", "train_s"]) == 0
    text = capsys.readouterr().out
    assert "| baseline train_s | delayed train_s |" in text and "r = 0.500 over 1 seeds" in text
    assert "net speed-up = 1 / r = 2.000" in text
    assert main([str(base), str(fdg)]) == 0 and "r = 0.375 over 1 seeds" in capsys.readouterr().out  # tokens
    with pytest.raises(SystemExit):
        main([str(base), str(fdg), "--by", "train_s", "--json", str(tmp_path / "r.json")])
    assert "time ratio, not a token overhead" in capsys.readouterr().err
    old = tmp_path / "old"  # a metrics.jsonl from before train_s
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": 10, "val_loss": 6.0}) + "\n")
    with pytest.raises(ValueError, match="has no 'train_s'"):
        load_curve(str(old), "train_s")


def test_by_samples_reads_the_resnet_recipes_metrics_with_test_or_validation_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """recipes/train_resnet.py --metrics counts images (``samples``) and names its loss by what it evaluated:
    ``val_loss`` with --val-images, ``test_loss`` without. Training rows (no loss) are skipped."""

    def run(name: str, key: str, evals: list[tuple[int, float, float]]) -> Path:
        rows: list[dict[str, float]] = []
        for step, (samples, loss, seconds) in enumerate(evals):
            rows.append({"step": step, "samples": samples, "train_loss": 9.0, "train_s": seconds})
            rows.append({"step": step, "samples": samples, key: loss, f"{key[:-5]}_acc": 0.5, "train_s": seconds})
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    base = run("1f1b", "val_loss", [(1024, 1.0, 10.0), (2048, 0.5, 20.0)])
    fdg = run("fdg", "val_loss", [(1024, 0.75, 8.0), (2048, 0.25, 16.0)])  # 0.5 at 1,536 images, 12 s
    assert load_curve(str(fdg), "samples") == [(1024.0, 0.75), (2048.0, 0.25)]
    assert main([str(base), str(fdg), "--by", "samples", "--throughput-ratio", "1.2"]) == 0
    text = capsys.readouterr().out
    assert "r = 0.750 over 1 seeds" in text and "net speed-up = 1.2 / r = 1.600" in text  # 1536 / 2048
    assert main([str(base), str(fdg), "--by", "train_s"]) == 0 and "r = 0.600 over 1 seeds" in capsys.readouterr().out
    tested = run("test", "test_loss", [(1024, 0.75, 8.0)])
    assert load_curve(str(tested), "samples") == [(1024.0, 0.75)]
    with pytest.raises(ValueError, match="has no 'tokens'.*train_resnet.py samples"):
        load_curve(str(fdg), "tokens")
