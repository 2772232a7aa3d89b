"""Where and at which commit a measurement ran: the processor, its vector units and the software, the git commit.

Two runs make a pair only where ``machine()`` is the same (the auto test, muon_lm); every result file records both.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def machine() -> dict[str, str]:
    """What must match for two runs to be a pair: the processor, its vector units, the software."""
    import deepspeed
    import torch

    cpu = ""
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    vector = ",".join(sorted(f for f in flags if f.startswith(("avx512", "avx2", "fma", "amx"))))
    return {"cpu": cpu, "vector": vector, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "python": platform.python_version()}  # fmt: skip


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip()
    except OSError:
        return ""


def engine_version() -> str:
    """Where the engine a benchmark ran comes from: the commit, and whether fdg_schedule/ differs from it."""
    import fdg_schedule

    if Path(fdg_schedule.__file__).resolve().parents[1] != ROOT:
        return f"fdg_schedule from {Path(fdg_schedule.__file__).parent}"

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "fdg_schedule")
    return f"{head}{' + uncommitted changes in fdg_schedule/' if dirty else ''}"
