"""scripts/gpu_check.sh --dry-run: the device check's steps, tiny and on the CPU, write a complete report.

The real check needs a GPU (docs/gpu.md); this keeps the script working in between: every pytest
selection it runs must resolve to tests, the benchmark must run with its flags, the report must hold
every step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_dry_run_writes_a_report_with_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "FDG_VENV": str(Path(sys.executable).parents[1]), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=190,
    )  # fmt: skip
    report = (tmp_path / "gpu_report.md").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + report[-3000:]
    assert report.startswith("# Device check report") and "Verdict: every step passed." in report
    for name in ("environment", "parity", "host_reads", "throughput"):
        assert f"### {name}: pass" in report, name
    parity = (tmp_path / "parity.log").read_text()
    for test in ("test_two_stages_all_modes", "test_recomputed_forward_draws", "test_bf16_and_zero1"):
        assert test in parity, f"the parity step does not select {test}"
    assert "test_steady_state_ticks_read_nothing_on_the_host" in (tmp_path / "host_reads.log").read_text()
    assert "## Throughput" in report and "fdg_current_stored" in report
