"""Test setup: the tests' helper modules import by name; every rank runs one thread on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Note [preloaded ranks] in fdg_schedule/tools/launch.py: ranks forked from a server that imported these once.
# torch._dynamo: every torch optimizer imports it when first built (4-7 s of each launch's ranks); the Muon
# module: DeepSpeed's bf16 and ZeRO optimizers import it (and torch._inductor) when built (2-5 s).
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.pipe.engine",
           "deepspeed.runtime.zero.muon.muon_optimizer"]  # fmt: skip
os.environ.setdefault("FDG_LAUNCH_PRELOAD", ",".join(PRELOAD))


import pytest  # noqa: E402


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A real one-rank gloo process group in this process (for code that asks for its rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
