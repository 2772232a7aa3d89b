"""Grid-edge check for the test's other configurations (outside the time-to-loss test; grid_edge/README.md).

As run_muon.py did for lm / Muon at K = 2, arm by arm as their grids on seed 300 come in (the queue's folder): read
the arm's choice with the frozen runner's own rule; if it is at the grid's top (bottom) lr, run the arm
once at twice (half) that lr with the chosen warm-up on seed 300 into /work/ttl_grid_ext, and once more if that is
better. "Better" is each arm's own selection rule: a baseline's lower final loss; FDG's fewer tokens to the chosen
``bp_a4`` run's final loss (then the lower final loss). The baselines of the LM configurations are shared by K and
were checked at K = 2, so only the FDG arms are left there. Run from the queue's worktree (commit 7c941ae).
"""

import dataclasses
import math
import subprocess
import time
from pathlib import Path

from benchmarks.convergence import time_to_loss as ttl

OUT, EXT = Path("/work/ttl_results"), Path("/work/ttl_grid_ext")
ttl.PAUSE_WHILE = Path("/work/QUIET")  # the queue's own child command then waits while it exists
ARMS = (  # (task, optimizer, arm), in the order their grids come in
    ("resnet", "sgd", "bp_a4"),
    ("resnet", "sgd", "bp_a1"),
    ("resnet", "sgd", "fdg_k2"),
    ("lm", "muon", "fdg_k8"),
    ("lm", "adamw", "fdg_k8"),
    ("lm", "muon", "fdg_k4"),
    ("lm", "adamw", "fdg_k4"),
)


def say(text: str) -> None:
    print(f"{time.strftime('%F %T')} {text}", flush=True)


def merit(task: str, optimizer: str, run: ttl.Run, result: dict | None) -> tuple[float, float]:
    """Lower is better: (tokens to bp_a4's final loss, final loss) for FDG, (final loss,) for a baseline."""
    final = ttl.score(result)
    if not run.arm.startswith("fdg") or result is None or "failed" in result:
        return (final, final)
    base = ttl.choose(OUT, task, optimizer, "bp_a4")
    target = float(ttl.read(base.path(OUT))["final"])  # type: ignore[union-attr,index]
    reached = ttl.to.tokens_to_reach(result["val"], target)
    return (math.inf if reached is None else reached, final)


def check(task: str, optimizer: str, arm: str) -> None:
    chosen = ttl.choose(OUT, task, optimizer, arm)
    assert chosen is not None
    grid = ttl.GRIDS[optimizer]
    if chosen.lr not in (grid[0], grid[-1]):
        say(f"{task}_{optimizer}/{arm}: chose lr {chosen.lr:g} w{chosen.warmup:g}, inside the grid")
        return
    factor = 2.0 if chosen.lr == grid[-1] else 0.5
    best = merit(task, optimizer, chosen, ttl.read(chosen.path(OUT)))
    say(f"{task}_{optimizer}/{arm}: chose lr {chosen.lr:g} w{chosen.warmup:g} {best}, at an edge")
    run = chosen
    for _ in range(2):
        run = dataclasses.replace(run, lr=run.lr * factor)
        if not run.path(EXT).exists():
            subprocess.run(ttl.child_command(EXT, run), check=False, capture_output=True)
        now = merit(task, optimizer, run, ttl.read(run.path(EXT)))
        say(f"{run.name}: {now}")
        if not now < best:
            break
        best = now


if __name__ == "__main__":
    left = list(ARMS)
    while left:  # the first arm whose grid is in, then the next
        ready = [a for a in left if ttl.choose(OUT, *a) is not None]
        if not ready:
            time.sleep(60)
            continue
        check(*ready[0])
        left.remove(ready[0])
    say("done")
