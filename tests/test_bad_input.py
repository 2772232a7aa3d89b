"""Bad configurations and inputs a user could plausibly hit get a clear error naming the value and the fix.

Config-level mistakes are covered in test_config.py (pure) and test_engine.py (every rank refuses at
deepspeed.initialize); this file covers inputs met while the job runs. The rank that meets the bad
input raises at once; its neighbours exit within ``pipeline.fdg.timeout`` (5 s here:
engine_workers.BAD_INPUT_TIMEOUT_S), never hang. The kinds every rank refuses before any rank waits on
another share one launch (Note [one launch, several calls] in dist_harness.py); each kind a neighbour
gives up on gets a launch of its own.
"""

from __future__ import annotations

import engine_workers
import pytest
from dist_harness import run_ranks, run_ranks_each

pytestmark = pytest.mark.distributed

CASES = {
    # every rank refuses inside deepspeed.initialize, before any rank waits on another
    "more_stages_than_layers": ("both", "pipeline stages [1] would hold no layers (partition [0, 1, 1])"),
    "batch_size_mismatch": ("both", "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step"),
    "no_data": ("both", "reads data but has none: pass train_batch(data_iter=...)"),
    # met at run time by one stage
    "labels_dtype": (1, "loss_fn failed on micro-batch 0 with outputs torch.float32 (4, 3) and labels torch.float32"),
    "bf16_inputs": (0, "micro-batch 0 has floating inputs of dtype torch.float32 but bf16.enabled is true"),
    "no_grad_activation": (0, "floating output 0 of the stage (torch.float32 (4, 8)) does not require grad"),
    "shape_change": (0, "activation shapes changed from [(torch.Size([4, 8]), torch.float32)] to [(torch.Size([3, 8])"),
}


REFUSED_BY_BOTH = [kind for kind, (who, _) in CASES.items() if who == "both"]


@pytest.fixture(scope="module")
def refused_by_both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """Each kind every rank refuses, in turn in one launch: kind -> the results in rank order."""
    calls = [(kind,) for kind in REFUSED_BY_BOTH]
    results = run_ranks_each(engine_workers.bad_input, 2, tmp_path_factory.mktemp("refused"), calls, deadline_s=200)
    return dict(zip(REFUSED_BY_BOTH, results))


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_input_gets_a_clear_error_and_nobody_hangs(request, tmp_path, kind: str) -> None:
    who, message = CASES[kind]
    if who == "both":
        results = request.getfixturevalue("refused_by_both")[kind]
    else:
        results = run_ranks(engine_workers.bad_input, 2, tmp_path, kind, deadline_s=150)
    raisers = [0, 1] if who == "both" else [who]
    for rank in raisers:
        assert results[rank]["error"] is not None and message in results[rank]["error"], results[rank]
    for rank in set(range(2)) - set(raisers):  # the neighbour gives up within the timeout
        timeout = engine_workers.BAD_INPUT_TIMEOUT_S
        assert "gave up" in results[rank]["error"] and results[rank]["seconds"] < timeout + 30
