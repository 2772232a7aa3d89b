"""fdg_schedule.base.host_memory: freed host memory stays in the process, so a training step stops faulting pages in.

Each check runs in a fresh interpreter: the allocator setting is process-wide and would outlive the test.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fdg_schedule.base import host_memory
from fdg_schedule.partitioning import profile

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)

# A 64 MiB tensor written and freed, as a step's activations are: glibc serves a block that large from a
# fresh mmap by default (above its largest dynamic mmap threshold, 32 MiB) and unmaps it on free.
_CHURN = """
import json, resource, sys
from fdg_schedule.base import host_memory
applied = host_memory.retain_freed_memory() if sys.argv[1] == "call" else None
import torch
def step():
    torch.ones(16 * 1024 * 1024)  # 64 MiB, every page written, freed at once
for _ in range(20):  # glibc settles within the first ten: then every step reuses the same pages
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults_per_step": faults / 10, "describe": host_memory.describe()}))
"""
_PAGES = 64 * 1024 * 1024 // 4096  # 16,384 pages of 4 KiB in one step's tensor


def _churn(mode: str, env: dict[str, str] | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", _CHURN, mode],
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_by_default_every_step_faults_its_memory_in_again() -> None:
    got = _churn("none")
    assert got["describe"] == "system default"
    assert got["faults_per_step"] > 0.5 * _PAGES, got


def test_retained_memory_is_reused_without_faults() -> None:
    got = _churn("call")
    assert got["applied"] is True
    assert got["describe"].startswith("retained (mallopt")
    assert got["faults_per_step"] < 0.01 * _PAGES, got


def test_the_environment_variables_in_the_docs_do_the_same() -> None:
    got = _churn("none", {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "18446744073709551615"})
    assert got["describe"].startswith("retained (environment")
    assert got["faults_per_step"] < 0.01 * _PAGES, got


def test_a_cpu_profile_is_keyed_on_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [torch.nn.Linear(4, 4)]
    inputs = torch.zeros(2, 4)
    default = profile.profile_key(layers, inputs, device="cpu")
    monkeypatch.setattr(host_memory, "describe", lambda: "retained (mallopt: M_MMAP_MAX=0, M_TRIM_THRESHOLD=max)")
    assert profile.profile_key(layers, inputs, device="cpu") != default


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("recipe", "flag"), [("train_resnet.py", "--freed-memory"), ("train_lm.py", "--freed_memory")])
def test_the_recipes_refuse_an_unknown_setting_before_starting(recipe: str, flag: str) -> None:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "recipes" / recipe), f"{flag}=keep"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert flag in done.stderr and "keep" in done.stderr and "retain" in done.stderr, done.stderr[-2000:]
