"""What the installed start-up hook (fdg_schedule_autoinstall.pth) costs programs, with and without it.

    /work/tools/quiet.sh .venv/bin/python -m benchmarks.throughput.startup_hook      # or plain python when idle

Builds a wheel of this checkout, installs it with pip into a throwaway venv layered on this one
(``with``), makes a second layered venv without it (``without``), and times interleaved runs:
``python -X importtime -c pass`` (the hook module's line and ``site``'s), the wall time of
``python -c pass`` and of ``python -c "import torch"`` (the finder sees every import until DeepSpeed
is imported), and what ``import deepspeed`` loads of fdg_schedule. Prints medians.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FILES = ["pyproject.toml", "setup.py", "README.md", "_fdg_schedule_autoinstall.py", "fdg_schedule"]
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def layered_venv(path: Path, wheel: Path | None) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    if wheel is not None:
        pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
        subprocess.run([*pip, str(wheel)], check=True, env=ENV)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    here = [p for p in sys.path if Path(p).name == "site-packages" and Path(p).is_dir()]  # torch, DeepSpeed
    (Path(site.stdout.strip()) / "layered_on.pth").write_text("".join(f"{path}\n" for path in here))
    return python


def build_wheel(work: Path) -> Path:
    source = work / "source"
    source.mkdir()
    for name in PACKAGE_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(work)!r}))"
    built = subprocess.run([sys.executable, "-c", code], cwd=source, check=True, capture_output=True, text=True)
    return work / built.stdout.split()[-1]


def importtime(python: Path, code: str, cwd: Path) -> dict[str, tuple[int, int]]:
    """Module -> (self, cumulative) microseconds, from ``-X importtime``."""
    run = subprocess.run(
        [str(python), "-X", "importtime", "-c", code], cwd=cwd, env=ENV, capture_output=True, text=True
    )
    rows = re.findall(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", run.stderr)
    return {name: (int(own), int(total)) for own, total, name in rows}


def wall_s(python: Path, code: str, cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", code], cwd=cwd, env=ENV, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=41)  # runs of `python -c pass` per venv
    parser.add_argument("--torch-imports", type=int, default=21)
    parser.add_argument("--deepspeed-imports", type=int, default=11)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pythons = {
            "with": layered_venv(work / "with", build_wheel(work)),
            "without": layered_venv(work / "without", None),
        }
        hook: list[int] = []
        site: dict[str, list[int]] = {kind: [] for kind in pythons}
        start: dict[str, list[float]] = {kind: [] for kind in pythons}
        for _ in range(args.starts):  # interleaved, so drift in machine load hits both alike
            for kind, python in pythons.items():
                rows = importtime(python, "pass", work)
                site[kind].append(rows["site"][1])
                if kind == "with":
                    hook.append(rows["_fdg_schedule_autoinstall"][1])
                start[kind].append(wall_s(python, "pass", work))
        torch_s: dict[str, list[float]] = {kind: [] for kind in pythons}
        for _ in range(args.torch_imports):
            for kind, python in pythons.items():
                torch_s[kind].append(wall_s(python, "import torch", work))
        loaded: list[int] = []
        for _ in range(args.deepspeed_imports):
            rows = importtime(pythons["with"], "import deepspeed", work)
            loaded.append(sum(own for name, (own, _) in rows.items() if name.startswith("fdg_schedule")))
            modules = sorted(name for name in rows if name.startswith("fdg_schedule"))

    def ms(values: list[float] | list[int], scale: float) -> str:
        return f"{statistics.median(values) * scale:.2f} ms"

    print(f"commit {commit.stdout.strip()}, python {sys.version.split()[0]}, medians")
    print(f"importtime _fdg_schedule_autoinstall: {ms(hook, 1e-3)} (of {args.starts} starts)")
    print(f"importtime site: {ms(site['with'], 1e-3)} with the .pth, {ms(site['without'], 1e-3)} without")
    print(f"python -c pass: {ms(start['with'], 1e3)} with, {ms(start['without'], 1e3)} without")
    print(f"python -c 'import torch': {ms(torch_s['with'], 1e3)} with, {ms(torch_s['without'], 1e3)} without")
    print(f"import deepspeed also loads {modules}: {ms(loaded, 1e-3)} (their own import time)")


if __name__ == "__main__":
    main()
