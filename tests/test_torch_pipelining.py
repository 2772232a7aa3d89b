"""ScheduleFDG (torch.distributed.pipelining) on real gloo ranks against fdg_reference, tick by tick, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch_pp_workers as workers
from dist_harness import run_ranks

from fdg_schedule import FDGConfig, fdg_reference

pytestmark = pytest.mark.distributed
MODES = [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]
EXACT = {"rtol": 0.0, "atol": 0.0}


def reference(case: dict[str, Any], K: int) -> dict[str, Any]:
    """What fdg_reference computes for ``case``: every stage's state after every tick, and the losses."""
    stages = workers.stages(K, case.get("seed", 0))
    opts = [workers.make_optimizer(case.get("optimizer", "sgd"), s.parameters()) for s in stages]
    schedulers = []
    if case.get("scheduler"):
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    states: list[list[dict[str, torch.Tensor]]] = []
    after = lambda tick: states.append([workers._state(s) for s in stages])  # noqa: E731
    data = workers.micro_batches(case["calls"] * case["n"], case.get("data_seed", 1))
    config = FDGConfig(**case.get("fdg", {}))
    losses = fdg_reference(
        stages, opts, data, F.cross_entropy, config, drain=case.get("drain", True), schedulers=schedulers,
        clip_grad_norm=case.get("clip", 0.0), after_tick=after,
    )  # fmt: skip
    return {"states": states, "losses": losses}


def check_equal(results: list[dict[str, Any]], want: dict[str, Any], tol: dict[str, float] = EXACT) -> None:
    ticks = len(want["states"])
    for r in results:
        k = r["stage"]
        assert len(r["states"]) == ticks, (k, len(r["states"]), ticks)
        for tick, (got, ref) in enumerate(zip(r["states"], want["states"])):
            for key, value in ref[k].items():
                torch.testing.assert_close(got[key], value, **tol, msg=lambda m: f"stage {k} tick {tick} {key}: {m}")
    last = [r for r in results if r["stage"] == max(x["stage"] for x in results)]
    for r in last:
        got = [v for call in r["losses"] for v in call]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want["losses"]), **tol)


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("weights,activations", MODES)
def test_equals_the_reference_bit_for_bit(tmp_path, K: int, weights: str, activations: str) -> None:
    case = {"n": 3, "calls": 3, "fdg": {"grad_shrink": 0.5, "weights": weights, "activations": activations}}
    results = run_ranks(workers.train, K, tmp_path, case, deadline_s=240)
    check_equal(results, reference(case, K))
