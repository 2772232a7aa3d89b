"""A second worker for the time-to-loss queue (docs/results/time_to_loss/QUEUE.md "A second worker").

The queue (``time_to_loss run``) takes the first run without a result file, in queue order. This worker takes the
last one whose name is known, with the frozen runner's own ``one`` command, so that the two meet once, at the end.
It stops when fewer than ``MARGIN`` known runs are left: the queue then has at least four runs to finish before it
reaches the worker's, so the two do not run the same run (if they ever did, the later result file would replace
the earlier one of the same run). A run's curve depends only on its own seed (weights, data order), not on which
process ran it or when. Run from the queue's worktree (commit 7c941ae), as the queue is run.
"""

import subprocess
import time
from pathlib import Path

from benchmarks.convergence import time_to_loss as ttl

OUT, MARGIN = Path("/work/ttl_results"), 5
ttl.PAUSE_WHILE = Path("/work/QUIET")  # the queue's own child command then waits while it exists


def pending() -> list[ttl.Run]:
    """The runs without a result file whose name is known, in queue order."""
    return [r for r in ttl.queue_order(OUT) if isinstance(r, ttl.Run) and not r.path(OUT).exists()]


def main() -> None:
    while len(left := pending()) >= MARGIN:
        run = left[-1]
        print(f"{time.strftime('%F %T')} {run.name} ({len(left)} known runs left)", flush=True)
        subprocess.run(ttl.child_command(OUT, run), check=False, capture_output=True)
        result = ttl.read(run.path(OUT))
        state = "no result (rerun)" if result is None else result.get("failed", f"final {result.get('final')}")
        print(f"{time.strftime('%F %T')} {run.name}: {str(state)[-200:]}", flush=True)
        if result is None:
            time.sleep(60)
    print(f"{time.strftime('%F %T')} fewer than {MARGIN} known runs left: the queue does the rest", flush=True)


if __name__ == "__main__":
    main()
