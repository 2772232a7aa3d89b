"""Note [no host sync in a tick]: a steady-state tick never reads a tensor on the host (real ranks, gloo).

On CPU there is no device queue to stall, so the check is on the code path: every host read of a
tensor (``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()``, ``.cpu()``, ``.numpy()``) is
patched while the ticks of two steady-state calls run, and none may happen. Neither may a copy from
host memory to the stage's device without ``non_blocking=True`` in FDG's or DeepSpeed's code (the
first stage's inputs, the last stage's labels, received messages: on a GPU ``.to(device)`` waits for
the stage's queue; here the same calls run as no-op copies). The one read the
exchange makes, of the control word that lives in host memory (Note [control words on the host]),
goes through ``guards.read_host`` and is counted: one per tick on a stage that receives activations.
On a GPU, ``scripts/gpu_check.sh`` checks the same ticks under ``torch.cuda.set_sync_debug_mode("error")``.

Note [no wait between calls] (in fdg_schedule.exchange.comm): the work a call does around its ticks (the
non-finite check, the loss, DeepSpeed's monitors and prints, the caller's loop, the next call's set-up) waits for
no neighbour; the exchange's blocking operations are counted on every path, and none may fall outside the ticks.
"""

from __future__ import annotations

import engine_workers
import pytest
from dist_harness import run_ranks

pytestmark = pytest.mark.distributed

BASE = {"stages": 2, "n": 64, "gas": 3, "grad_shrink": 0.5, "clip": 1.0}


def test_steady_state_ticks_read_nothing_on_the_host(tmp_path) -> None:
    cases = [
        {**BASE},  # fp32, torch SGD, stage-local clipping, nonfinite="error"
        {**BASE, "weights": "stashed", "activations": "recomputed", "optimizer": "adam", "accumulate": 2},
        {**BASE, "check_every": 1},  # the knob: flags read every tick -- the patch must see those reads
    ]
    results = run_ranks(engine_workers.host_reads, 2, tmp_path, cases, deadline_s=200)
    for rank_results in results:
        for case, r in zip(cases, rank_results):
            reads = [name for name, _ in r["seen"]]
            if case.get("check_every"):
                assert "tolist" in reads, f"stage {r['stage_id']}: the flag reads every tick were not seen"
                continue
            assert not r["seen"], f"stage {r['stage_id']} {case}: host reads in a tick:\n" + "\n".join(
                f"{name} at\n{where}" for name, where in r["seen"]
            )
            want = r["ticks"] if r["stage_id"] > 0 else 0  # one control word per received activation
            assert r["control_words"] == [((1,), "torch.int64")] * want


@pytest.mark.parametrize("stages", [2, 3])
def test_no_stage_waits_for_a_neighbour_between_calls(tmp_path, stages: int) -> None:
    base = {"stages": stages, "n": 64, "gas": 2, "grad_shrink": 0.5, "clip": 1.0, "wall_clock": True}
    # the first case keeps glibc's allocator; the default ("retain") then keeps freed memory, process-wide
    cases = [{**base, "transport": "process_group", "host_memory": "system"}, {**base, "transport": "shm"},
             {**base, "gas": 1}]  # fmt: skip
    results = run_ranks(engine_workers.waits_between_calls, stages, tmp_path, cases, deadline_s=200)
    for rank_results in results:
        for case, r in zip(cases, rank_results):
            where = f"stage {r['stage_id']} {case}"
            assert r["inside"] > 0, f"{where}: no wait counted in the ticks -- the counter is not live"
            assert r["outside"] == 0, f"{where}: {r['outside']} waits for a neighbour between calls"
            assert r["transport"] == case.get("transport", "shm")  # "auto" runs "shm" on Linux with gloo
            # Note [a lent message]: over shared memory every received activation and gradient is read where it
            # lies (stage k receives from both neighbours but the ends), and each went back to its link
            assert (r["lent"] > 0) == (r["transport"] == "shm") and r["still_lent"] == [], (where, r)
            retained = case.get("host_memory", "retain") == "retain"  # pipeline.fdg.host_memory, on the CPU
            assert r["host_memory"].startswith("retained" if retained else "system"), (where, r["host_memory"])
