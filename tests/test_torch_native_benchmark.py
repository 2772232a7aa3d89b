"""Smoke test of benchmarks/throughput/torch_native.py: a --quick run writes a report with every variant.

No timing is asserted (the machine is shared); only that torch's 1F1B, torch's zero-bubble (ZBV) and ScheduleFDG
all ran side by side and gave physically possible numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_quick_run_reports_torch_1f1b_zero_bubble_and_fdg(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.throughput.torch_native", "--quick", f"--out={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=390)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "torch_native.json").read_text())
    rows = report["models"]["widemlp_tiny"]
    assert set(rows) == {f"{kind}_m{m}" for m in (4, 8) for kind in ("torch_1f1b", "torch_zbv", "fdg")}
    for name, row in rows.items():
        assert len(row["samples_per_s"]) == 1 and 0 < row["samples_per_s"][0] < math.inf, name
        assert name in (tmp_path / "torch_native.md").read_text()
