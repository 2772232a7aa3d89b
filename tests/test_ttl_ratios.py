"""benchmarks/throughput/ttl_ratios.py: the time-to-loss analysis' ratio file from throughput reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.convergence import time_to_loss as ttl
from benchmarks.throughput import ttl_ratios


def row(rates: list[float], paired: list[float] | None = None) -> dict:
    """A summarized variant row as the benchmark writes it (the fields the ratio file reads)."""
    spread = {"median": sorted(rates)[len(rates) // 2], "min": min(rates), "max": max(rates)}
    out = {"samples_per_s": spread, "samples_per_s_all": rates}
    if paired is not None:
        out["ratio_vs_1f1b_m4"] = {"median": sorted(paired)[len(paired) // 2], "min": min(paired), "max": max(paired)}
    return out


def report(path: Path, model: str, optimizer: str | None, fdg: list[float], sync: list[float]) -> Path:
    variants = {
        "bp": row([10.0] * len(fdg)),
        "1f1b_m4": row(sync),
        "fdg_stashed_stored": row(fdg, [f / s for f, s in zip(fdg, sync)]),
    }
    data: dict = {"command": "c", "models": {model: {"variants": variants}, "transformer_tiny": {"variants": {}}}}
    if optimizer is not None:
        data["optimizer"] = optimizer
        data["optimizer_settings"] = {"params": {"lr": 1e-3}, "gradient_clipping": 1.0}
    path.write_text(json.dumps(data))
    return path


def test_the_ratio_file_holds_each_tasks_and_optimizers_median_ratio_with_its_rounds(tmp_path: Path) -> None:
    adamw = report(tmp_path / "a.json", "ttl_lm", "adamw", [30.0, 33.0, 36.0], [24.0, 30.0, 25.0])
    muon = report(tmp_path / "m.json", "ttl_lm", "muon", [20.0, 21.0, 22.0], [20.0, 20.0, 20.0])
    resnet = report(tmp_path / "r.json", "ttl_resnet", None, [50.0, 52.0, 54.0], [40.0, 40.0, 41.0])  # no optimizer
    out = tmp_path / "ratios" / "ttl.json"
    found = ttl_ratios.main([str(adamw), str(muon), str(resnet), "--json", str(out)])
    assert json.loads(out.read_text()) == found
    assert set(found) == {"lm_adamw", "lm_muon", "resnet_sgd", "lm_adamw_rounds", "lm_muon_rounds", "resnet_sgd_rounds"}
    assert found["lm_adamw"] == pytest.approx(33.0 / 25.0)  # the medians' ratio, not the rounds' median (1.25)
    assert found["lm_muon"] == pytest.approx(21.0 / 20.0) and found["resnet_sgd"] == pytest.approx(52.0 / 40.0)
    rounds = found["lm_adamw_rounds"]
    assert rounds["paired"] == {"median": pytest.approx(1.25), "min": pytest.approx(1.1), "max": pytest.approx(1.44)}
    assert rounds["rounds"] == 3 and rounds["source"] == str(adamw) and rounds["model"] == "ttl_lm"
    assert rounds["fdg_stashed_stored_samples_per_s"]["median"] == 33.0 and rounds["1f1b_m4_samples_per_s"]["max"] == 30
    assert rounds["optimizer_settings"]["gradient_clipping"] == 1.0
    assert found["resnet_sgd_rounds"]["optimizer_settings"] is None  # a report from before --optimizer: SGD

    # the analysis reads it as measured with the row's own optimizer
    for task, optimizer in (("lm", "adamw"), ("lm", "muon"), ("resnet", "sgd")):
        got = ttl.throughput_ratio(out, task, optimizer, 2)
        assert got is not None and got["ratio"] == pytest.approx(found[f"{task}_{optimizer}"]), (task, optimizer)
        assert got["optimizer_matches"] and got["measured"]


def test_a_report_without_the_variants_or_a_ttl_model_or_a_repeated_setting_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    good = report(tmp_path / "a.json", "ttl_lm", "adamw", [30.0], [24.0])
    data = json.loads(good.read_text())
    del data["models"]["ttl_lm"]["variants"]["1f1b_m4"]
    (tmp_path / "no_1f1b.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"no_1f1b.json: model ttl_lm has no variant 1f1b_m4 .*--variants 1f1b_m4"):
        ttl_ratios.ratios([tmp_path / "no_1f1b.json"])
    del data["models"]["ttl_lm"]
    (tmp_path / "no_ttl.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"no time-to-loss model .*\['transformer_tiny'\].*--models ttl_lm"):
        ttl_ratios.ratios([tmp_path / "no_ttl.json"])
    again = report(tmp_path / "b.json", "ttl_lm", "adamw", [31.0], [24.0])
    with pytest.raises(SystemExit):  # the command line: a usage error naming both files
        ttl_ratios.main([str(good), str(again)])
    assert "lm_adamw: measured in both" in capsys.readouterr().err
