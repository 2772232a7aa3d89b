"""scripts/gpu_check.sh --dry-run: the device check's parts, on the CPU, write a complete report.

The real check needs a GPU (docs/gpu.md); this keeps the script and its parts (scripts/gpu_check.py) working in
between: every part runs the same engines, references and comparisons on the CPU, the report holds every part,
the NCCL part says why it was skipped. The sync-debug mode and the STAGED and STREAM paths need CUDA. What the
lent machine's run depends on besides (scripts/gpu_check_plan.py) is checked here too: every part's launcher
deadlines end well before its shell timeout, gloo and NCCL are pointed at the loopback when it is the only
interface, and the report names the commit the wheels were prepared at and whether the tree is still it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check_plan as plan  # noqa: E402
from gpu_check_plan import Interface  # noqa: E402

# What a part needs between its last launcher deadline and the shell's kill, set here apart from the plan's
# MARGIN_S so that lowering that cannot pass unseen: the interpreter and torch's and DeepSpeed's imports before
# the launcher's clock starts (2 s on the CPU machine, a cold lent machine slower), killing the ranks, the
# traceback and the RESULT line after it (Note [the device check's time bounds]).
SPARE_S = 15
DUMP_BEFORE_S = 5  # fdg_schedule.tools.launch: a rank still running this long before its deadline prints its stack


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_dry_run_writes_a_report_with_every_part(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    recorded = plan.record(wheels, ROOT)  # what scripts/prepare_gpu_wheels.sh writes beside the wheels
    # gloo bound to the loopback by name, as on the lent machine (where the parts set it themselves)
    env = {**os.environ, "FDG_VENV": str(Path(sys.executable).parents[1]), "DS_ACCELERATOR": "cpu",
           "FDG_GPU_WHEELS": str(wheels), "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    env.pop("NCCL_SOCKET_IFNAME", None)
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=190,
    )  # fmt: skip
    report = (out / "gpu_report.md").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + report[-3000:]
    assert report.startswith("# Device check report") and "Verdict: every part passed." in report
    assert done.stdout.startswith("env: pass")
    # the code it is of: the wheels' commit, the tree checked against their file list, git's commit
    commit = recorded.split()[0]
    assert f"- Wheels' commit: {recorded}, from {wheels}/COMMIT." in report
    assert re.search(r"^- Tree: the wheels' commit's, all \d+ files unchanged\.$", report, re.M), report[:1500]
    assert f"- Checked out: {plan.checked_out(ROOT)}, the wheels' commit." in report and len(commit) == 12
    # every part under the plan's shell timeout, its launcher deadlines ending SPARE_S before it
    rows = {row[0]: row for row in (line.strip("| ").split(" | ") for line in report.splitlines())
            if row[0] in plan.DEADLINES_S}  # fmt: skip
    assert list(rows) == list(plan.DEADLINES_S), rows
    for name, row in rows.items():
        limit = int(row[3])
        assert limit == plan.timeout_s(name) and limit - sum(plan.DEADLINES_S[name]) >= SPARE_S, row
        assert "bounds: " in report.split(f"### {name}: ")[1].split("###")[0], name
    # the network: here another interface is up, so the parts leave the caller's choice alone
    chosen = plan.socket_env(plan.interfaces(), env)
    assert "NCCL_SOCKET_IFNAME" not in chosen or chosen["NCCL_SOCKET_IFNAME"] == "lo"
    line = plan.network_line(plan.interfaces(), chosen, {**env, **chosen})
    assert line in report and "kept from the caller: GLOO_SOCKET_IFNAME=lo" in line, line
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


# -- the time bounds: Note [the device check's time bounds] -------------------------------------------------


def test_every_part_ends_its_deadlines_well_before_its_shell_timeout() -> None:
    assert plan.MARGIN_S >= SPARE_S
    for part, deadlines in plan.DEADLINES_S.items():
        assert plan.timeout_s(part) - sum(deadlines) >= SPARE_S, (part, deadlines, plan.timeout_s(part))
        assert all(d > DUMP_BEFORE_S for d in deadlines), (part, deadlines)  # the ranks' stack dump inside each
    # the whole check within the 480 s docs/gpu.md promises (the device tool's run: timeout_s=540)
    assert plan.INSTALL_S + sum(plan.timeout_s(part) for part in plan.DEADLINES_S) <= 480
    with pytest.raises(ValueError, match="unknown part 'gpu'"):
        plan.timeout_s("gpu")


@pytest.mark.parametrize("part", ["single", "shared", "nccl"])
def test_a_part_gives_the_launcher_the_plans_deadlines(part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What run_part really passes to fdg_schedule.tools.launch.run, under the shell timeout with SPARE_S left."""
    import gpu_check
    import torch

    import fdg_schedule.tools.launch as launch

    given: list[float] = []

    def run(worker: Any, world: int, *args: Any, deadline_s: float, workdir: str) -> list[dict[str, Any]]:
        given.append(deadline_s)
        return [{"rank": f"{r} of K = {world}", "device": "cpu", "checks": [gpu_check.check("c", 0.0)]}
                for r in range(world)]  # fmt: skip

    for name in ("FDG_LAUNCH_BACKEND", "FDG_LAUNCH_DEVICES"):  # run_part sets them for its ranks
        monkeypatch.setenv(name, "unset")
    monkeypatch.setattr(launch, "run", run)
    monkeypatch.setattr(gpu_check, "on_gpu", lambda: True)  # the nccl part runs with two GPUs only
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_check.run_part(part)["ok"]
    assert given == list(plan.DEADLINES_S[part])
    assert plan.timeout_s(part) - sum(given) >= SPARE_S


def test_a_part_refuses_a_shell_timeout_that_leaves_no_time_for_the_stack_dump(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpu_check

    def never(part: str) -> None:
        raise AssertionError("ran without time for its stack dump")

    monkeypatch.setattr(gpu_check, "run_part", never)
    monkeypatch.setattr(plan, "interfaces", lambda: [])
    assert gpu_check.main(["shared", "--timeout-s", "190"]) == 1
    out = capsys.readouterr().out
    result = json.loads(out.split("RESULT ")[-1])
    assert "timeout of 190 s for part shared leaves 10 s" in result["summary"], result
    assert "run it with --timeout-s 200" in out and "bounds: launcher deadlines 90 + 90 s" in out


def test_a_part_killed_by_the_shell_prints_where_it_was(tmp_path: Path) -> None:
    """The net under the margin: a part stuck past the shell's timeout prints its stack on the SIGTERM."""
    (tmp_path / "deepspeed.py").write_text("import time\ntime.sleep(120)\n")  # the env part imports it: a hang
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}:{ROOT / 'tests'}", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(["timeout", "8", sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "env"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 124, done.stderr[-2000:]
    assert "most recent call first" in done.stderr, done.stderr[-2000:]
    assert f'File "{tmp_path / "deepspeed.py"}", line 2' in done.stderr, done.stderr[-2000:]


# -- the network interface ----------------------------------------------------------------------------------

LO = Interface("lo", up=True, loopback=True)


def test_only_the_loopback_up_points_gloo_and_nccl_at_it() -> None:
    down = [Interface("ifb0", up=False, loopback=False), Interface("tunl0", up=False, loopback=False)]
    want = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert plan.socket_env([LO], {}) == want
    assert plan.socket_env([LO, *down], {}) == want  # interfaces that are down carry nothing
    assert plan.socket_env([LO], {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": "lo"}  # the caller's
    assert plan.socket_env([LO, Interface("eth0", up=True, loopback=False)], {}) == {}  # the backends choose
    assert plan.socket_env([], {}) == {}
    line = plan.network_line([LO, *down], {"NCCL_SOCKET_IFNAME": "lo"}, {"GLOO_SOCKET_IFNAME": "eth9"})
    assert line == ("network: interfaces up: lo; NCCL_SOCKET_IFNAME=lo (only the loopback is up); "
                    "kept from the caller: GLOO_SOCKET_IFNAME=eth9")  # fmt: skip


def test_the_interfaces_are_read_with_their_flags(tmp_path: Path) -> None:
    for name, flags in {"lo": "0x9", "eth0": "0x1003", "ifb0": "0x82"}.items():  # as /sys/class/net has them
        (tmp_path / name).mkdir()
        (tmp_path / name / "flags").write_text(flags + "\n")
    (tmp_path / "bonding_masters").mkdir()  # no flags: not an interface
    assert plan.interfaces(tmp_path) == [Interface("eth0", True, False), Interface("ifb0", False, False), LO]
    assert plan.interfaces(tmp_path / "none") == []


# -- the code the report is of ------------------------------------------------------------------------------


def test_the_report_names_the_wheels_commit_and_what_in_the_tree_differs(tmp_path: Path) -> None:
    tree, wheels = tmp_path / "tree", tmp_path / "wheels"
    (tree / "pkg").mkdir(parents=True)
    wheels.mkdir()
    names = ("pkg/a.py", "pkg/b.py", "pkg/c.py")
    for name in names:
        (tree / name).write_text(name)
    (wheels / "COMMIT").write_text("0123456789ab (wheels prepared 2026-12-07 01:00 UTC)\n")
    (wheels / "MANIFEST").write_text("".join(f"{plan.sha256(tree / n)}  {n}\n" for n in names))
    assert plan.provenance(wheels, tree, None) == [
        f"Wheels' commit: 0123456789ab (wheels prepared 2026-12-07 01:00 UTC), from {wheels}/COMMIT.",
        "Tree: the wheels' commit's, all 3 files unchanged.",
        "Checked out: unknown (no git here); the tree is identified by the wheels' file list.",
    ]
    (tree / "pkg/a.py").write_text("changed")
    (tree / "pkg/c.py").unlink()
    lines = plan.provenance(wheels, tree, "ba9876543210")
    assert lines[1] == ("Tree: **differs from the wheels' commit 0123456789ab**: 1 changed (pkg/a.py) and 1 missing "
                        "(pkg/c.py) of 3 files; the results are of this tree, not of 0123456789ab.")  # fmt: skip
    assert lines[2] == "Checked out: **ba9876543210, not the wheels' commit 0123456789ab**."
    assert plan.provenance(wheels, tree, "0123456789ab with uncommitted changes")[2] == (
        "Checked out: 0123456789ab with uncommitted changes, the wheels' commit."
    )
    (wheels / "MANIFEST").unlink()
    assert "Tree: not checked: no " in plan.provenance(wheels, tree, None)[1]
    (wheels / "COMMIT").unlink()
    assert plan.provenance(wheels, tree, "ba9876543210") == [
        f"Wheels' commit: none recorded (no {wheels}/COMMIT: no wheels prepared; a dry run needs none).",
        "Checked out: ba9876543210.",
    ]


def test_the_prepare_step_records_the_commit_and_every_carried_file(tmp_path: Path) -> None:
    line = plan.record(tmp_path, ROOT)
    head = plan.checked_out(ROOT)
    assert head is not None and line.startswith(f"{head} (wheels prepared ")
    assert (tmp_path / "COMMIT").read_text() == line + "\n"
    listed = [row.split("  ", 1)[1] for row in (tmp_path / "MANIFEST").read_text().splitlines()]
    assert "scripts/gpu_check_plan.py" in listed and "fdg_schedule/__init__.py" in listed
    assert not any(name.startswith((".git/", ".gpu_wheels/")) for name in listed)
    assert plan.provenance(tmp_path, ROOT, head)[1] == f"Tree: the wheels' commit's, all {len(listed)} files unchanged."
    done = subprocess.run(["sha256sum", "--quiet", "-c", str(tmp_path / "MANIFEST")], cwd=ROOT, timeout=60)
    assert done.returncode == 0  # the MANIFEST is sha256sum's own form: checkable there by hand
