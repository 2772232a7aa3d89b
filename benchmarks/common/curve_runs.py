"""What the loss-curve runners share (issue 63's time_to_loss.py, issue 64's auto_v2_test.py): run files, the
training loop that records a curve, the evaluation, the lr schedule, the grid-point choice, the queue's lock and its
pause.

A run file is one JSON per run, written whole or not at all; a run that failed holds a ``"failed"`` key and counts
as done. A curve (``"val"``) is the list of ``(tokens, loss)`` evaluations, tokens rising; ``"final"`` its last loss.
"""

from __future__ import annotations

import fcntl
import json
import math
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from benchmarks.common.provenance import commit, machine
from fdg_schedule.plan import token_overhead as to


def read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.rename(path)


def failed(fields: dict[str, Any], why: str) -> dict[str, Any]:
    """The run file of a run that did not finish: its own ``fields``, why, and where it ran."""
    return {**fields, "failed": why, "machine": machine(), "commit": commit()}


def run_recorded(path: Path, fields: dict[str, Any], train: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``train()``'s result written to ``path`` when it ends; an error is written as a failure (the queue goes on)."""
    try:
        result = train()
    except Exception:  # noqa: BLE001 - recorded, and the queue goes on
        result = failed(fields, traceback.format_exc()[-3000:])
    write_result(path, result)
    return result


def train_curve(
    modules: Sequence[Any],
    optimizers: Sequence[Any],
    batches: Sequence[Any],
    loss_fn: Any,
    fdg: Any,
    *,
    schedulers: Sequence[Any],
    clip: float,
    evaluation: Sequence[tuple[Any, Any]],
    per_micro: int,
    eval_every: int,
    pause_while: Path | None,
    start: float,
) -> dict[str, Any]:
    """Train the stages on ``fdg_reference`` (``fdg``: its FDGConfig; one stage is backprop) over ``batches``,
    evaluating every ``eval_every`` micro-batches and after the drain; while ``pause_while`` exists, waits between
    ticks (the curve does not depend on it). The result's curve part: ``val`` (tokens = micro-batches entered x
    ``per_micro``), ``final``, the last 64 training losses' mean, wall time since ``start`` less the pauses,
    evaluation and paused seconds, where it ran, and ``failed`` on a non-finite loss."""
    from fdg_schedule import fdg_reference

    curve: list[tuple[int, float]] = []
    n = len(batches)
    eval_s = paused_s = 0.0

    def after_tick(tick: int) -> None:
        nonlocal eval_s, paused_s
        paused_s += wait_while(pause_while)
        if (tick + 1) % eval_every == 0 and tick + 1 < n:
            t0 = time.time()
            curve.append(((tick + 1) * per_micro, evaluate(modules, evaluation, loss_fn)))
            eval_s += time.time() - t0

    losses = fdg_reference(modules, optimizers, batches, loss_fn, fdg, drain=True, schedulers=schedulers,
                           clip_grad_norm=clip, after_tick=after_tick)  # fmt: skip
    curve.append((n * per_micro, evaluate(modules, evaluation, loss_fn)))  # after the drain
    result: dict[str, Any] = {
        "val": curve,
        "final": curve[-1][1],
        "train_loss_last_64": sum(losses[-64:]) / max(1, len(losses[-64:])),
        "wall_s": time.time() - start - paused_s,  # paused time excluded
        "eval_s": eval_s,
        "paused_s": paused_s,
        "machine": machine(),
        "commit": commit(),
    }
    if not all(math.isfinite(v) for _, v in curve) or not all(math.isfinite(v) for v in losses):
        result["failed"] = "non-finite loss"
    return result


def score(result: dict[str, Any] | None) -> float:
    """A run's final loss; infinite for a missing or failed run."""
    return math.inf if result is None or "failed" in result else float(result["final"])


def pick(results: Sequence[dict[str, Any] | None], target: float | None = None) -> int:
    """The chosen grid point's index. Without ``target`` (a baseline): the lowest final loss. With it (FDG): the
    point whose curve first reaches ``target`` in the fewest tokens; none reaching: the lowest final loss. Ties go
    to the earlier point (``min`` keeps the first)."""
    if target is None:
        return min(range(len(results)), key=lambda i: score(results[i]))

    def key(i: int) -> tuple[float, float]:
        r = results[i]
        if r is None or "failed" in r:
            return (math.inf, math.inf)
        reached = to.tokens_to_reach(r["val"], target)
        return (reached if reached is not None else math.inf, score(r))

    return min(range(len(results)), key=key)


def power(n: int, sd: float, margin: float, draws: int = 20000, seed: int = 0) -> float:
    """The chance that the one-sided 95 % upper bound of a mean over ``n`` seeds (normal spread ``sd``) falls below
    the true mean + ``margin``: the power to pass a goal the truth beats by ``margin`` (for log r: a factor
    exp(margin))."""
    import random
    import statistics

    rng, t, hit = random.Random(seed), to.t_quantile(0.95, n - 1), 0
    for _ in range(draws):
        xs = [rng.gauss(0, sd) for _ in range(n)]
        hit += statistics.fmean(xs) + t * statistics.stdev(xs) / math.sqrt(n) < margin
    return hit / draws


def evaluate(modules: Sequence[Any], evaluation: Sequence[tuple[Any, Any]], loss_fn: Any) -> float:
    """Mean loss over the evaluation batches with the stages' weights of the moment, in eval mode."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for m in modules:
            m.eval()
        for x, y in evaluation:
            out = x
            for m in modules:
                out = m(out)
            total += float(loss_fn(out, y)) * len(x)
            count += len(x)
        for m in modules:
            m.train()
    return total / count


def warmup_cosine(optimizer: Any, steps: int, warmup: float) -> Any:
    """DeepSpeed's WarmupCosineLR over ``steps`` optimizer steps: linear warm-up over ``warmup`` of them (at least
    one step), then cosine down to a tenth of the lr."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    return WarmupCosineLR(optimizer, total_num_steps=steps, warmup_num_steps=max(1, int(warmup * steps)),
                          warmup_min_ratio=0.0, cos_min_ratio=0.1, warmup_type="linear")  # fmt: skip


def wait_while(path: Path | None) -> float:
    """Sleep while ``path`` exists (a machine's quiet period for timing benchmarks); the seconds waited."""
    if path is None or not path.exists():
        return 0.0
    t0 = time.time()
    while path.exists():
        time.sleep(15)
    return time.time() - t0


def lock_queue(out: Path, who: str) -> IO[str]:
    """Hold ``out``'s queue lock (one queue per folder) until the returned file is closed or the process ends."""
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".queue.lock", "w")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"{who}: another queue runs on {out}") from None
    return lock
