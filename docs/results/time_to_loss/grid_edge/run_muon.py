"""Grid-edge check for lm/Muon (outside the time-to-loss test; docs/results/time_to_loss/QUEUE.md "Grid edges").

Per arm in order bp_a4, bp_a1, fdg_k2: wait until its grid on seed 300 is in (the queue's folder), read its choice
with the frozen runner's own rule; if at the grid's top (bottom) lr, run the arm once at twice (half) that lr with
the chosen warm-up on seed 300, into /work/ttl_grid_ext; if that is better, once more at twice (half) again. Every
arm alike. Run from the queue's worktree (commit 7c941ae)."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.convergence import time_to_loss as ttl

OUT, EXT = Path("/work/ttl_results"), Path("/work/ttl_grid_ext")
for arm in ("bp_a4", "bp_a1", "fdg_k2"):
    while (chosen := ttl.choose(OUT, "lm", "muon", arm)) is None:
        time.sleep(60)
    grid = ttl.GRIDS["muon"]
    if chosen.lr not in (grid[0], grid[-1]):
        print(f"{time.strftime('%F %T')} {arm}: chose lr {chosen.lr:g} w{chosen.warmup:g}, inside the grid", flush=True)
        continue
    factor = 2.0 if chosen.lr == grid[-1] else 0.5
    best = ttl.score(ttl.read(chosen.path(OUT)))
    print(f"{time.strftime('%F %T')} {arm}: chose lr {chosen.lr:g} w{chosen.warmup:g} ({best:.4f}), at an edge",
          flush=True)  # fmt: skip
    run = chosen
    for _ in range(2):
        run = dataclasses.replace(run, lr=run.lr * factor)
        if not run.path(EXT).exists():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.convergence.time_to_loss",
                    "one",
                    run.name,
                    "--out",
                    str(EXT),
                    "--pause-while",
                    "/work/QUIET",
                ],
                check=False,
                capture_output=True,
            )
        final = ttl.score(ttl.read(run.path(EXT)))
        print(f"{time.strftime('%F %T')} {run.name}: {final:.4f}", flush=True)
        if not final < best:
            break
        best = final
print(f"{time.strftime('%F %T')} done", flush=True)
