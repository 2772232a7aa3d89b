"""scripts/gpu_check.sh --dry-run: the device check's parts, on the CPU, write a complete report.

The real check needs a GPU (docs/gpu.md); this keeps the script and its parts (scripts/gpu_check.py) working in
between: every part runs the same engines, references and comparisons on the CPU, the report holds every part,
the NCCL part says why it was skipped. The sync-debug mode and the STAGED and STREAM paths need CUDA.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_dry_run_writes_a_report_with_every_part(tmp_path: Path) -> None:
    env = {**os.environ, "FDG_VENV": str(Path(sys.executable).parents[1]), "DS_ACCELERATOR": "cpu",
           "FDG_COMMIT": "abc123 (test)"}  # fmt: skip
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=190,
    )  # fmt: skip
    report = (tmp_path / "gpu_report.md").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + report[-3000:]
    assert report.startswith("# Device check report") and "Verdict: every part passed." in report
    assert "commit abc123 (test)" in report and done.stdout.startswith("env: pass")
    for name in ("env", "single", "shared"):
        assert f"### {name}: pass" in report, name
    assert "### nccl: skipped" in report and "NCCL needs 2" in report
    checks = list(dict.fromkeys(line for line in report.splitlines() if line.startswith("rank ")))  # once each
    assert "rank 0 of K = 1 (cpu): K = 1 = plain backprop: pass max |diff| 0 " in report
    assert sum("no host sync in a tick" in line for line in checks) == 2
    for stages in (2, 3):  # every stage of K = 2 and K = 3: the reference twice, the resume once
        for rank in range(stages):
            mine = [line for line in checks if line.startswith(f"rank {rank} of K = {stages} ")]
            names = [line.split(": ")[1] for line in mine]
            want = ["current/stored, SGD", "stashed/recomputed, Adam", "checkpoint resumed = straight"]
            assert [n for n in names if n in want] == want, mine
            assert all(": pass " in line for line in mine), mine
    assert sum("dropout: recomputed = stored: pass" in line for line in checks) == 2  # K = 2's stages


def test_without_the_prepared_wheels_the_real_check_says_what_to_run(tmp_path: Path) -> None:
    env = {**os.environ, "FDG_GPU_WHEELS": str(tmp_path / "none"), "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "run scripts/prepare_gpu_wheels.sh here, then carry .gpu_wheels" in done.stderr


def test_the_wheels_are_not_committed() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu_wheels/x.whl"], cwd=ROOT, timeout=30)
    assert ignored.returncode == 0


def test_a_check_fails_past_its_tolerance_and_on_nan() -> None:
    import gpu_check

    assert gpu_check.check("a", 1e-6)["ok"] and not gpu_check.check("a", 1e-3)["ok"]
    assert not gpu_check.check("a", math.nan)["ok"] and not gpu_check.check("a", 1e-9, tol=0.0)["ok"]
