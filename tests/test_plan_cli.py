"""``python -m fdg_schedule.plan``: it runs, prints the table and the pick, saves JSON and a plot, refuses bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plan_helpers import uniform_profile

from fdg_schedule.plan.__main__ import main
from fdg_schedule.plan.costs import profile_to_dict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def profile_json(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_to_dict(uniform_profile(12))))
    return path


def test_the_module_runs_an_estimate_and_recommends(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "fdg_schedule.plan", "--model", "resnet18", "--gpu", "A100", "--micro-batch", "32",
         "--cluster", "a100-100gbe", "--stages", "2,4", "--json", str(tmp_path / "plan.json"),
         "--plot", str(tmp_path / "plan.png"), "--save-profile", str(tmp_path / "profile.json")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| 4 | fdg current/stored |" in out.stdout and "| 2 | zb-h1 |" in out.stdout
    head = "Recommendation (best throughput to the same loss, samples/s ÷ token overhead r, within 80.0 GB per device"
    assert head + "; within 2% of it, fewest devices):" in out.stdout
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert len(saved["predictions"]) == 2 * 12  # 8 FDG variants + 4 others, at two K
    assert saved["recommendation"]["fits"] is True
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the saved estimate reads back as a profile
    assert main(["--profile", str(tmp_path / "profile.json"), "--stages", "2", "--schedules", "fdg"]) == 0


def test_a_profile_plans_and_the_objective_per_device_prefers_fewer_devices(
    profile_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--profile", str(profile_json), "--cluster", "h100-ib", "--stages", "2-4", "--schedules", "fdg,1f1b",
          "--fdg-modes", "current/stored", "--fdg-accumulate", "1", "--objective", "per-gpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| 3 | fdg current/stored | 0,4,8,12 |" in out
    assert "Recommendation (best throughput per device" in out and "at K=2 x dp=1" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "1,2"], r"--stages must be integers >= 2 \(K = 1 is backprop, always reported\), got \[1\]"),
        (["--stages", "two"], r"--stages 'two' is not a list of integers; write e.g. 2,4,8 or 2-64"),
        (["--micro-batches", "0"], r"--micro-batches '0' must be an integer >= 1 or nK"),
        (["--schedules", "fdg,pipedream"], r"--schedules: unknown \['pipedream'\]; known: \['fdg', '1f1b'"),
        (["--fdg-modes", "old/stored"], r"--fdg-modes: unknown \['old/stored'\]"),
        (["--fdg-accumulate", "0"], r"--fdg-accumulate '0' must be an integer >= 1 or m"),
        (["--cluster", "dgx9"], r"--cluster 'dgx9' is not a preset; known: \["),
        (["--inter-bandwidth", "fast"], r"--inter-bandwidth 'fast' is not a bandwidth; write e.g. 100Gb/s"),
        (["--memory-limit", "80 gigs"], r"--memory-limit '80 gigs' is not a size; write e.g. 80GB"),
        (["--dp", "0"], r"--dp must be >= 1, got 0"),
        (["--token-overhead", "fast"], r"--token-overhead 'fast' is neither a number \(r, e.g. 1.4\) nor a file"),
        (["--token-overhead", "0"], r"--token-overhead must be a number > 0 \(r, e.g. 1.4\), got 0"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag_and_the_fix(
    profile_json: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--profile", str(profile_json), *args])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], r"give exactly one of --profile, --trace, --model \(got none\)"),
        (["--model", "resnet18", "--profile", "x.json"], r"give exactly one of .* \(got \['--profile', '--model'\]\)"),
        (["--model", "resnet18"], r"--model resnet18 needs --gpu \(one of \["),
        (
            ["--model", "vgg16", "--gpu", "A100"],
            r"--model 'vgg16' is unknown; known: resnet20.*resnet101.*gpt-1.3b.*or measure it",
        ),
        (["--model", "resnet18", "--gpu", "TPU"], r"unknown GPU 'TPU' in --gpu; known: \["),
        (["--model", "resnet18", "--gpu", "A100", "--efficiency", "2"], r"--efficiency .* must be in \(0, 1\]"),
        (["--profile", "/nonexistent/profile.json"], r"no profile at /nonexistent/profile.json"),
    ],
)
def test_bad_model_sources_are_refused(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
