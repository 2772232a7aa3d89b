"""What each FDG call reports through DeepSpeed's own channels: monitors, wall-clock timers, the print line."""

from __future__ import annotations

import math
from typing import Any


def report_call(engine: Any, steps_before: int, elapsed: float) -> None:
    """DeepSpeed's per-batch reporting for an FDG call of ``elapsed`` seconds on a ``PipelineEngine``.

    Every ``steps_per_print`` ticks: the wall-clock timers (one line per stage, as each stage learns
    alone) and, on global rank 0, ``steps: ... loss: ... samples/sec: ...``; every call on global
    rank 0: ``Train/Samples/lr`` and ``train_loss`` to DeepSpeed's monitors (NaN losses skipped), and with fp16
    ``Train/Samples/loss_scale``.
    """
    every = engine.steps_per_print()
    printing = bool(every) and engine.global_steps // every != steps_before // every
    if printing and engine.wall_clock_breakdown() and engine.grid.data_parallel_id == 0:
        engine.timers.log(engine.engine_timers.active_timers(), ranks=[engine.global_rank])
    if engine.global_rank != 0:
        return
    loss = engine.agg_train_loss.item()
    if engine.monitor.enabled:
        events = [("Train/Samples/lr", engine.get_lr()[0], engine.global_samples)]
        if not math.isnan(loss):
            events.append(("Train/Samples/train_loss", loss, engine.global_samples))
        if "loss_scale" in engine.fdg_stats:  # fp16, as DeepSpeed writes it: stage 0's scale of its last step
            events.append(("Train/Samples/loss_scale", engine.fdg_stats["loss_scale"], engine.global_samples))
        engine.monitor.write_events(events)
    if printing:
        ticks_run = max(engine.global_steps - steps_before, 1)
        samples = engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * ticks_run
        print(
            f"steps: {engine.global_steps} loss: {loss:0.4f} iter time (s): {elapsed:0.3f} "
            f"samples/sec: {samples / max(elapsed, 1e-9):0.3f}",
            flush=True,
        )


def stop_backward_timers(engine: Any) -> None:
    """Stop the backward timers DeepSpeed started during a non-last stage's ``torch.autograd.backward``.

    DeepSpeed's hook on the forward outputs runs its backward prologue, which starts them; the
    epilogue that stops them belongs to ``engine.backward(loss)``, which only the last stage calls.
    (They are started only with ``wall_clock_breakdown``.)
    """
    for name in engine.engine_timers.backward_inner_timers + engine.engine_timers.backward_timers:
        if engine.timers(name).started_:
            engine.timers(name).stop()


def print_flops_profile(engine: Any) -> None:
    """DeepSpeed's flops profiler: its forwards profile tick ``profile_step`` (global rank 0, stage 0, as
    under 1F1B); the profile is printed at the end of that tick, where DeepSpeed prints it after its step."""
    profiler = getattr(engine, "flops_profiler", None)
    if profiler is None or not profiler.started or engine.global_steps != engine.flops_profiler_profile_step():
        return
    profiler.print_model_profile(
            profile_step=engine.global_steps, module_depth=engine.flops_profiler_module_depth(),
            top_modules=engine.flops_profiler_top_modules(), detailed=engine.flops_profiler_detailed(),
            output_file=engine.flops_profiler_output_file(),
        )  # fmt: skip
    profiler.end_profile()
