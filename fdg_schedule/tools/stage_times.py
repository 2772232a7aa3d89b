"""Measured per-stage time of a pipeline engine (FDG or DeepSpeed's 1F1B), against the balanced split's prediction.

    clock = StageClock(engine)          # right after deepspeed.initialize, on every rank
    ... train ...
    text = stage_report(engine, clock)  # every rank calls it (a gather); global rank 0 gets the table

FDG engines count their own time per instruction kind (``engine.fdg_stats``) and their ticks;
DeepSpeed's ``PipelineEngine`` does not, so the clock times its instruction handlers during
``train_batch()`` through the public per-instruction hook (:func:`fdg_schedule.base.dispatch.observe`)
and counts its backward passes. Compute is forward + backward (+ the
recomputed forward, which runs inside it) + optimizer step + gradient all-reduce; wait is time
blocked on a neighbour.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fdg_schedule.base import dispatch
from fdg_schedule.partitioning.partition import Partition, balanced_partition, rescaled

COMPUTE = ("forward_s", "backward_s", "step_s", "reduce_s")


class StageClock:
    """Seconds per kind this rank's stage spends in ``train_batch()``, and micro-batches done, after a warm-up.

    Counting starts after the first ``train_batch()`` call that ends with at least ``warmup``
    micro-batches done (default ``2K``: FDG's pipeline has filled and first-call costs are past); a
    shorter run is counted from the start.
    """

    def __init__(self, engine: Any, warmup: int | None = None) -> None:
        self.engine = engine
        self.fdg = hasattr(engine, "fdg_stats")
        self.warmup = 2 * engine.num_stages if warmup is None else warmup
        self._stock: dict[str, float] = {}
        self._training = [False]  # eval_batch() runs the same handlers: only train_batch() time counts
        if not self.fdg:
            self._time_stock_instructions()
        self._start: dict[str, float] | None = None
        train_batch = engine.train_batch

        def counted_train_batch(*args: Any, **kwargs: Any) -> Any:
            self._training[0] = True
            try:
                return train_batch(*args, **kwargs)
            finally:
                self._training[0] = False
                if self._start is None and self.totals()["micro_batches"] >= self.warmup:
                    self._start = self.totals()

        engine.train_batch = counted_train_batch

    @property
    def counting(self) -> bool:
        """True once the warm-up is over (the numbers exclude it)."""
        return self._start is not None

    def totals(self) -> dict[str, float]:
        """Seconds per kind (``forward_s``, ``backward_s``, ``step_s``, ``reduce_s``, ``wait_s``) and
        ``micro_batches``, summed since the engine was built."""
        if self.fdg:
            stats = self.engine.fdg_stats
            out = {key: float(stats.get(key, 0.0)) for key in (*COMPUTE, "wait_s")}
            out["micro_batches"] = float(stats["ticks"])  # one micro-batch per tick in steady state
            return out
        return dict(self._stock)

    def since_start(self) -> dict[str, float]:
        now, start = self.totals(), self._start or {}
        return {key: now[key] - start.get(key, 0.0) for key in now}

    def per_micro_batch(self) -> dict[str, float]:
        """``compute_s`` and ``wait_s`` (and each kind) per micro-batch since the clock was made."""
        spent = self.since_start()
        count = max(spent.pop("micro_batches"), 1.0)
        out = {key: value / count for key, value in spent.items()}
        out["compute_s"] = sum(out.get(key, 0.0) for key in COMPUTE)
        return out

    def _time_stock_instructions(self) -> None:
        from deepspeed.runtime.pipe import schedule as s

        kinds = {
            s.ForwardPass: "forward_s",
            s.BackwardPass: "backward_s",
            s.OptimizerStep: "step_s",
            s.ReduceGrads: "reduce_s",
            s.ReduceTiedGrads: "reduce_s",
            s.SendActivation: "wait_s",
            s.RecvActivation: "wait_s",
            s.SendGrad: "wait_s",
            s.RecvGrad: "wait_s",
        }
        self._stock = {kind: 0.0 for kind in (*COMPUTE, "wait_s", "micro_batches")}

        def on_instruction(view: Any, cmd: Any, start: float, end: float) -> None:
            kind = kinds.get(type(cmd))
            if kind is not None and self._training[0]:
                self._stock[kind] += end - start
                self._stock["micro_batches"] += type(cmd) is s.BackwardPass

        dispatch.observe(self.engine, on_instruction)  # the public per-instruction hook


def stage_report(engine: Any, clock: StageClock) -> str | None:
    """Per stage: layers, predicted time (balanced splits), measured compute and wait per micro-batch.

    Every rank must call it (data-parallel rank 0 of each stage reports); returns the table on
    global rank 0, None elsewhere.
    """
    module = engine.module
    row = {
        "stage": engine.stage_id,
        "parts": list(module.parts),
        "measured": clock.per_micro_batch(),
        "dp_rank": engine.grid.get_data_parallel_rank(),
    }
    rows: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(row, rows if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    plan = getattr(module, "partition_plan", None)
    per_stage = sorted((r for r in rows if r["dp_rank"] == 0), key=lambda r: r["stage"])
    lines = [
        f"per-stage time per micro-batch ({'FDG, per tick' if clock.fdg else '1F1B'}; compute = forward + backward "
        f"+ step + all-reduce{'' if clock.counting else ', warm-up included: a short run'}):",
        "stage | layers | predicted ms | compute ms | error | wait ms",
    ]
    for r in per_stage:
        k, parts, measured = r["stage"], r["parts"], r["measured"]
        compute = measured["compute_s"] * 1e3
        predicted = plan.stages[k].time_s * 1e3 if plan is not None else None
        error = f"{compute / predicted - 1:+.1%}" if predicted else "-"
        lines.append(
            f"{k} | {parts[k]}-{parts[k + 1] - 1} | {'-' if predicted is None else f'{predicted:.2f}'} | "
            f"{compute:.2f} | {error} | {measured['wait_s'] * 1e3:.2f}"
        )
    measured = [r["measured"]["compute_s"] for r in per_stage]
    if plan is not None and plan.profile is not None and len(measured) > 1 and all(t > 0 for t in measured):
        lines.append(rebalanced_advice(plan, measured))
    return "\n".join(lines)


def rebalanced_advice(plan: Partition, measured_s: list[float]) -> str:
    """One line: the split :func:`~fdg_schedule.partitioning.partition.balanced_partition` gives once ``plan``'s profile
    is rescaled to these measured stage times (Note [rebalancing on measured stage times])."""
    assert plan.profile is not None
    again = balanced_partition(rescaled(plan.profile, plan, measured_s), len(plan.stages), plan.objective, plan.own)
    if again.parts == plan.parts:
        return f"rebalanced on these measurements: the same parts {plan.parts}"
    return (
        f"rebalanced on these measurements: parts {again.parts}, slowest stage {again.bottleneck_s * 1e3:.2f} ms "
        f"predicted against {max(measured_s) * 1e3:.2f} ms measured here; to use it: "
        f'partition_method "parts:{",".join(str(p) for p in again.parts)}"'
    )
