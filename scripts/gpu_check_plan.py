"""The device check's setup, read before any part runs: each part's time bounds, the network interface its
process groups use, and which code the report is of. Standard library only: ``scripts/gpu_check.sh`` runs it
with the lent machine's own python3 before the carried wheels are installed, and
``scripts/prepare_gpu_wheels.sh`` runs it here.

    python3 scripts/gpu_check_plan.py timeouts               # "install 40", then "PART SECONDS" per part, in order
    python3 scripts/gpu_check_plan.py record DIR             # DIR/COMMIT and DIR/MANIFEST (prepare_gpu_wheels.sh)
    python3 scripts/gpu_check_plan.py provenance DIR         # the report's lines on the code: DIR's commit, the tree

Note [the device check's time bounds]: each part runs under the shell's ``timeout``, which kills it without a
trace; inside it, ``fdg_schedule.tools.launch.run`` gives the ranks a deadline, has every rank still running
5 s before it print its stack, and at the deadline kills them and raises ``RankFailed``, which the part reports.
A hang therefore leaves a trace only if every deadline of the part runs out before the shell's timeout, with
time to spare for what the launcher's clock does not count: the interpreter's start and torch's and
DeepSpeed's imports before the first ``run`` (2 s on the CPU machine, more on a cold one), killing the ranks,
the traceback and the RESULT line after the last. So this table holds the deadlines alone, and each part's
shell timeout is their sum plus ``MARGIN_S``: the two cannot drift apart. A part also checks the timeout the
shell actually gave it (``gpu_check.py PART --timeout-s N``), and a part killed regardless prints its own
stack on the shell's SIGTERM.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

MARGIN_S = 20  # Note [the device check's time bounds]: start-up before the first deadline, teardown after the last
INSTALL_S = 40  # the carried wheels' pip install, before the parts
# Each part's launcher deadlines, one per fdg_schedule.tools.launch.run call, in the order it makes them.
DEADLINES_S: dict[str, tuple[int, ...]] = {
    "env": (),  # no ranks: versions and GPUs, in the part's own process
    "single": (100,),  # K = 1
    "shared": (90, 90),  # K = 2, then K = 3
    "nccl": (80,),  # K = 2, one rank per GPU
}
LOOPBACK_ONLY = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # the variables set to the loopback's name


def timeout_s(part: str) -> int:
    """The shell's ``timeout`` for ``part``: its deadlines and the margin (Note [the device check's time bounds])."""
    if part not in DEADLINES_S:
        raise ValueError(f"unknown part {part!r}: one of {', '.join(DEADLINES_S)}")
    return sum(DEADLINES_S[part]) + MARGIN_S


def nesting_problem(part: str, shell_timeout_s: float) -> str | None:
    """None if the part's deadlines end ``MARGIN_S`` before ``shell_timeout_s``; otherwise what is wrong."""
    spare = shell_timeout_s - sum(DEADLINES_S[part])
    if spare >= MARGIN_S:
        return None
    return (f"the shell's timeout of {shell_timeout_s:g} s for part {part} leaves {spare:g} s after its launcher "
            f"deadlines {list(DEADLINES_S[part])} s, under the {MARGIN_S} s a hang's stack dump needs: run it with "
            f"--timeout-s {timeout_s(part)} (scripts/gpu_check_plan.py timeouts)")  # fmt: skip


def bounds_line(part: str, shell_timeout_s: float) -> str:
    """The report's line on how the part is bounded."""
    deadlines = DEADLINES_S[part]
    inner = (f"launcher deadlines {' + '.join(map(str, deadlines))} s (ranks print their stacks 5 s before)"
             if deadlines else "no ranks")  # fmt: skip
    spare = shell_timeout_s - sum(deadlines)
    return f"bounds: {inner}, shell timeout {shell_timeout_s:g} s: {spare:g} s to spare (at least {MARGIN_S} s)"


# -- the network interface ----------------------------------------------------------------------------------


class Interface(NamedTuple):
    """A network interface as the kernel lists it."""

    name: str
    up: bool
    loopback: bool


IFF_UP, IFF_LOOPBACK = 0x1, 0x8  # <linux/if.h>


def interfaces(sys_net: Path = Path("/sys/class/net")) -> list[Interface]:
    """This machine's network interfaces, from ``/sys/class/net`` (Linux); empty where that is missing."""
    found = []
    for path in sorted(sys_net.iterdir()) if sys_net.is_dir() else []:
        try:
            flags = int((path / "flags").read_text().strip(), 16)
        except (OSError, ValueError):
            continue
        found.append(Interface(path.name, bool(flags & IFF_UP), bool(flags & IFF_LOOPBACK)))
    return found


def socket_env(seen: Sequence[Interface], environ: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` set to the loopback's name when it is the only interface
    up (the lent machine has no other), each unless ``environ`` already sets it; otherwise nothing: gloo and NCCL
    choose as they do anywhere. gloo otherwise binds to the address the host name resolves to, and NCCL skips
    ``lo`` before it falls back to it."""
    up = [i for i in seen if i.up]
    if not up or not all(i.loopback for i in up):
        return {}
    return {name: up[0].name for name in LOOPBACK_ONLY if name not in environ}


def network_line(seen: Sequence[Interface], chosen: Mapping[str, str], environ: Mapping[str, str]) -> str:
    """The report's line on the interfaces and what the parts' process groups were told to use."""
    up = ", ".join(i.name for i in seen if i.up) or "none"
    if chosen:
        told = ", ".join(f"{k}={v}" for k, v in chosen.items()) + " (only the loopback is up)"
    else:
        told = "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME left to the backends"
    kept = ", ".join(f"{k}={environ[k]}" for k in LOOPBACK_ONLY if k in environ and k not in chosen)
    return f"network: interfaces up: {up}; {told}" + (f"; kept from the caller: {kept}" if kept else "")


# -- the code the report is of ------------------------------------------------------------------------------


def git(root: Path, *args: str) -> str | None:
    """``git args`` in ``root``'s checkout: its output, or None where there is no git or no checkout."""
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checked_out(root: Path) -> str | None:
    """``root``'s commit (12 digits), with "with uncommitted changes" if its tracked files differ; None without
    git (the lent machine has none, and the device tool carries no ``.git``)."""
    head = git(root, "rev-parse", "--short=12", "HEAD")
    if head is None:
        return None
    clean = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True, timeout=30)
    return head if clean.returncode == 0 else f"{head} with uncommitted changes"


def tree_files(root: Path, leave_out: Path | None = None) -> list[str]:
    """The files the device tool carries from ``root``: tracked and untracked-but-not-ignored, those present."""
    listed = git(root, "ls-files", "-co", "--exclude-standard")
    if listed is None:
        raise RuntimeError(f"{root} is not a git checkout: the wheels' commit cannot be recorded")
    skip = leave_out.resolve() if leave_out else None
    files = []
    for name in sorted(set(listed.splitlines())):
        path = (root / name).resolve()
        if path.is_file() and not (skip and path.is_relative_to(skip)):
            files.append(name)
    return files


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(wheels: Path, root: Path) -> str:
    """Write ``wheels/COMMIT`` (the commit, whether the tree had changes, when) and ``wheels/MANIFEST`` (the
    SHA-256 of every file that travels, in ``sha256sum`` form); returns the COMMIT line."""
    commit = checked_out(root)
    if commit is None:
        raise RuntimeError(f"{root} is not a git checkout: the wheels' commit cannot be recorded")
    line = f"{commit} (wheels prepared {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
    files = tree_files(root, leave_out=wheels)
    (wheels / "MANIFEST").write_text("".join(f"{sha256(root / f)}  {f}\n" for f in files))
    (wheels / "COMMIT").write_text(line + "\n")
    return line


def tree_changes(manifest: Iterable[str], root: Path) -> tuple[int, list[str], list[str]]:
    """Against ``manifest``'s lines (``sha256sum`` form): how many files it lists, those changed, those missing.
    Files added since are not seen (there may be no git to list them)."""
    listed, changed, missing = 0, [], []
    for line in manifest:
        digest, _, name = line.rstrip("\n").partition("  ")
        if not name:
            continue
        listed += 1
        path = root / name
        if not path.is_file():
            missing.append(name)
        elif sha256(path) != digest:
            changed.append(name)
    return listed, changed, missing


def few(names: list[str], at_most: int = 8) -> str:
    return ", ".join(names[:at_most]) + (f" and {len(names) - at_most} more" if len(names) > at_most else "")


def provenance(wheels: Path, root: Path, head: str | None) -> list[str]:
    """The report's lines on the code it is of: the commit recorded with the wheels, whether the tree here is
    still that commit's (file by file, no git needed), and ``head``, the checked-out commit where git knows it."""
    commit_file, manifest = wheels / "COMMIT", wheels / "MANIFEST"
    shown = wheels.resolve().relative_to(root.resolve()) if wheels.resolve().is_relative_to(root.resolve()) else wheels
    if not commit_file.is_file():
        lines = [f"Wheels' commit: none recorded (no {shown}/COMMIT: no wheels prepared; a dry run needs none)."]
        recorded = None
    else:
        line = (commit_file.read_text().strip() or "unknown").splitlines()[0]
        recorded = line.split()[0]
        lines = [f"Wheels' commit: {line}, from {shown}/COMMIT."]
        if not manifest.is_file():
            lines.append(f"Tree: not checked: no {shown}/MANIFEST (prepared by an older "
                         "scripts/prepare_gpu_wheels.sh: run it again).")  # fmt: skip
        else:
            listed, changed, missing = tree_changes(manifest.read_text().splitlines(), root)
            if not changed and not missing:
                lines.append(f"Tree: the wheels' commit's, all {listed} files unchanged.")
            else:
                diff = [f"{len(changed)} changed ({few(changed)})"] if changed else []
                diff += [f"{len(missing)} missing ({few(missing)})"] if missing else []
                lines.append(f"Tree: **differs from the wheels' commit {recorded}**: {' and '.join(diff)} of "
                             f"{listed} files; the results are of this tree, not of {recorded}.")  # fmt: skip
    if head is None:
        lines.append("Checked out: unknown (no git here); the tree is identified by the wheels' file list.")
    elif recorded is None or head.split()[0] == recorded:
        lines.append(f"Checked out: {head}" + (", the wheels' commit." if recorded else "."))
    else:
        lines.append(f"Checked out: **{head}, not the wheels' commit {recorded}**.")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["timeouts"] and len(argv) == 1:
        print(f"install {INSTALL_S}")
        for part in DEADLINES_S:
            print(f"{part} {timeout_s(part)}")
    elif argv[:1] == ["record"] and len(argv) == 2:
        print(record(Path(argv[1]), Path(__file__).resolve().parents[1]))
    elif argv[:1] == ["provenance"] and len(argv) == 2:
        root = Path(__file__).resolve().parents[1]
        print("\n".join(f"- {line}" for line in provenance(Path(argv[1]), root, checked_out(root))))
    else:
        print("usage: gpu_check_plan.py timeouts | record DIR | provenance DIR", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
