"""Several launcher invocations at once (one per simulated node), each logged, all bound by one deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_launchers(commands: list[list[str]], deadline_s: float, log: Path) -> None:
    """Run the launcher invocations at once (one per node); all must exit 0 before the deadline."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    logs = [open(log.with_suffix(f".node{i}.log"), "w") for i in range(len(commands))]  # noqa: SIM115
    procs = [
        subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        for cmd, f in zip(commands, logs)
    ]
    end = time.monotonic() + deadline_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > end:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for f in logs:
            f.close()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = "\n".join(
            f"--- node {i} (exit {code}) ---\n{log.with_suffix(f'.node{i}.log').read_text()[-3000:]}" for i, code in bad
        )
        raise RuntimeError(f"launcher(s) failed or passed the {deadline_s:.0f} s deadline:\n{tails}")
