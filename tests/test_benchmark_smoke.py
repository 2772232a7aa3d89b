"""Smoke test of benchmarks/throughput/throughput.py: a --quick run on a tiny model writes a complete, sane report.

No timing is asserted (the machine is shared); only that every variant ran, every field is there,
and the values are physically possible.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "bp",
    "1f1b_m2",
    "1f1b_m4",
    "1f1b_m8",
    "fdg_current_stored",
    "fdg_current_recomputed",
    "fdg_stashed_stored",
    "fdg_stashed_recomputed",
    "dp2",
    "1f1b_m4_by_params",
    "fdg_current_stored_by_params",
}


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_quick_run_writes_a_complete_report(tmp_path: Path) -> None:
    # transformer_tiny: no batch norm, the fastest model
    done = run_benchmark("throughput", "--quick", "--models=transformer_tiny", "--repeats=1", f"--out={tmp_path}")
    assert (
        "command: DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.throughput --quick"
        in done.stdout
    )

    report = json.loads((tmp_path / "throughput.json").read_text())
    markdown = (tmp_path / "throughput.md").read_text()
    for key in ("command", "date", "machine", "engine", "load_start", "load_end", "models"):
        assert key in report, key
    rows = report["models"]["transformer_tiny"]["variants"]
    assert set(rows) == VARIANTS
    for name, row in rows.items():
        assert name in markdown
        if row["split"] is not None:  # every pipeline variant: the split rebalanced on its measured stage times
            assert f"- {name}: rebalanced on these measurements: " in markdown, name
        sps = row["samples_per_s"]
        assert 0 < sps["min"] <= sps["median"] <= sps["max"] < math.inf, (name, sps)
        assert 0 < row["efficiency"]["median"] <= 1.05, (name, row["efficiency"])  # timers inside the wall time
        assert row["ratio_vs_bp"]["median"] > 0 and row["ratio_vs_1f1b_m4"]["median"] > 0
        stages = 1 if name == "bp" else 2
        assert len(row["stage_compute_s_per_micro_batch"]) == stages, name
        assert all(c > 0 for c in row["stage_compute_s_per_micro_batch"]), name
        assert len(row["memory"]) == stages, name
        assert all(len(pair) == 2 for pair in row["load_avg_1min"])
    assert rows["bp"]["ratio_vs_bp"]["median"] == pytest.approx(1.0)
    assert rows["1f1b_m4"]["optimizer_steps_per_micro_batch"] == pytest.approx(0.25)
    # The default optimizer: the benchmark's SGD with momentum, unclipped, on every rank of every variant.
    assert report["optimizer"] == "sgd" and report["optimizer_settings"]["gradient_clipping"] == 0.0
    stepped = [got for r in report["models"]["transformer_tiny"]["raw"] for got in r["optimizer"].values()]
    assert len(stepped) == 1 + 2 * (len(VARIANTS) - 1)  # bp on rank 0 only, every other variant on both ranks
    assert all(got == {"class": "SGD", "gradient_clipping": 0.0} for got in stepped)
    assert "Every variant steps sgd (lr 0.01, momentum 0.9; gradient clipping off)." in markdown

    # Splits come from the library: the profile is kept, every pipeline has a predicted time per stage.
    result = report["models"]["transformer_tiny"]
    assert len(result["profile"]["layers"]) == 3  # 2 blocks and the head
    for name, row in rows.items():
        if name not in ("bp", "dp2"):
            assert row["split"][0] == 0 and row["split"][-1] == 3, (name, row["split"])
            assert len(row["stage_predicted_s_per_micro_batch"]) == 2 and all(
                t > 0 for t in row["stage_predicted_s_per_micro_batch"]
            ), name

    # Memory: FDG stage 0 holds 2 micro-batches (delay 2), the last stage none; 1F1B and BP save activations.
    for name in VARIANTS:
        first, *rest = rows[name]["memory"]
        if name.startswith("fdg"):
            assert first["in_flight_max"] == 2 and first["held_max"] > 0, (name, first)
            assert rest[0]["held_max"] == 0 and rest[0]["in_flight_max"] == 0, (name, rest)
        else:
            assert first["saved_peak"] > 0, (name, first)
    stored, recomputed = rows["fdg_current_stored"]["memory"][0], rows["fdg_current_recomputed"]["memory"][0]
    assert recomputed["held_max"] < stored["held_max"]  # inputs only, not the activations

    # Recomputed against stored: the bound from the two splits' predicted ticks, the paired ratio, both printed.
    for weights in ("current", "stashed"):
        bound = rows[f"fdg_{weights}_recomputed"]["recompute_bound"]
        predicted = [
            rows[f"fdg_{weights}_{mode}"]["stage_predicted_s_per_micro_batch"] for mode in ("stored", "recomputed")
        ]
        assert bound["profile"] == pytest.approx(max(predicted[0]) / max(predicted[1]))
        assert bound["ideal"] == 0.875 and bound["measured"] > 0
        assert f"- fdg_{weights}_recomputed: {bound['measured']:.3f} × the stored mode's samples/s" in markdown
    assert "recompute_bound" not in rows["fdg_current_stored"]

    # --render summarizes the raw windows again, with the same numbers, and says so.
    run_benchmark("throughput", f"--render={tmp_path / 'throughput.json'}", timeout=60)
    again = json.loads((tmp_path / "throughput.json").read_text())
    assert again["summarized_by"] and again["command"] == report["command"]
    assert again["models"]["transformer_tiny"]["variants"] == rows
    assert "Summarized again from the run's raw windows by " in (tmp_path / "throughput.md").read_text()


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_the_plain_halves_run_fdgs_split_on_both_ranks_and_every_pipeline_is_compared_with_them(tmp_path: Path) -> None:
    variants = "--variants=bp,1f1b_m4,fdg_current_stored,halves,halves_exchange,halves_shm,fdg_current_stored_shm"
    variants += ",fdg_current_recomputed_shm,halves_recomputed"
    run_benchmark("throughput", "--quick", "--models=transformer_tiny", "--repeats=1", variants, f"--out={tmp_path}")
    rows = json.loads((tmp_path / "throughput.json").read_text())["models"]["transformer_tiny"]["variants"]
    halves = rows["halves"]
    assert halves["split"] == rows["fdg_current_stored"]["split"]  # FDG's stored split, one stage per rank
    assert len(halves["stage_compute_s_per_micro_batch"]) == 2
    assert all(c > 0 for c in halves["stage_compute_s_per_micro_batch"])
    assert halves["stage_wait_s_per_micro_batch"] == [0.0, 0.0]  # no rank waits for another
    exchange = rows["halves_exchange"]  # the same stages, plus FDG's exchange with the neighbour every tick
    assert exchange["split"] == halves["split"] and all(c > 0 for c in exchange["stage_compute_s_per_micro_batch"])
    assert sum(exchange["stage_wait_s_per_micro_batch"]) > 0
    shm = rows["halves_shm"]  # the same exchange through shared memory
    assert shm["split"] == halves["split"] and all(c > 0 for c in shm["stage_compute_s_per_micro_batch"])
    # FDG with the shared-memory transport: FDG's split; the recomputed mode's bound against its stored mode
    assert rows["fdg_current_stored_shm"]["split"] == halves["split"]
    assert rows["fdg_current_recomputed_shm"]["recompute_bound"]["measured"] > 0
    markdown = (tmp_path / "throughput.md").read_text()
    for name in ("1f1b_m4", "fdg_current_stored", "fdg_current_stored_shm"):
        assert rows[name]["ratio_vs_halves"]["median"] > 0, name
        assert f"- {name}: {rows[name]['ratio_vs_halves']['median']:.2f} [" in markdown, name
    assert "ratio_vs_halves" not in rows["bp"] and "ratio_vs_halves" not in halves
    # the exchanges alone against the halves, and FDG stored against the halves with its own transport's messages
    assert exchange["ratio_vs_halves"]["median"] > 0 and shm["ratio_vs_halves"]["median"] > 0
    assert rows["fdg_current_stored"]["ratio_bases"]["ratio_vs_halves_with_its_messages"] == "halves_exchange"
    assert rows["fdg_current_stored_shm"]["ratio_bases"]["ratio_vs_halves_with_its_messages"] == "halves_shm"
    assert "- fdg_current_stored_shm: " in markdown and " × `halves_shm` (the halves plus the same" in markdown
    # the recomputed halves: the recomputed split, no waits, and the recomputed modes' ceiling in the report
    recomputed = rows["halves_recomputed"]
    assert recomputed["split"] == rows["fdg_current_recomputed_shm"]["split"]
    assert recomputed["stage_wait_s_per_micro_batch"] == [0.0, 0.0]
    ratio = rows["fdg_current_recomputed_shm"]["ratio_vs_halves_recomputed"]["median"]
    assert ratio > 0 and f"- fdg_current_recomputed_shm: {ratio:.2f} [" in markdown
    assert "ratio_vs_halves_recomputed" not in rows["fdg_current_stored_shm"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("optimizer", "stepped"), [("adamw", "AdamW"), ("muon", "MuonWithAuxAdam")])
def test_every_variant_steps_the_optimizer_asked_for_and_the_ratio_file_reads_the_run(
    tmp_path: Path, optimizer: str, stepped: str
) -> None:
    """``--optimizer``: bp, 1F1B, FDG and the plain halves all step it, clipped at 1.0 as the time-to-loss runs (the
    DeepSpeed engines' own record of what they built); the report says so, and ttl_ratios turns it into the
    analysis' ratio for that optimizer."""
    from benchmarks.convergence import time_to_loss
    from benchmarks.throughput import ttl_ratios

    names = {"bp", "1f1b_m4", "fdg_stashed_stored", "halves"}
    run_benchmark("throughput", "--quick", "--models=transformer_tiny", "--repeats=1", "--variants=" + ",".join(names),
                  f"--optimizer={optimizer}", f"--out={tmp_path}", timeout=220)  # fmt: skip
    # (Muon: 60-90 s on a loaded 2-core machine, most of it DeepSpeed building its Muon and the engines)
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert report["optimizer"] == optimizer and report["optimizer_settings"]["gradient_clipping"] == 1.0
    raw = report["models"]["transformer_tiny"]["raw"]
    assert set(raw[0]["optimizer"]) == names and set(raw[1]["optimizer"]) == names - {"bp"}
    assert all(got == {"class": stepped, "gradient_clipping": 1.0} for r in raw for got in r["optimizer"].values())
    assert f"Every variant steps {optimizer} (" in (tmp_path / "throughput.md").read_text()

    # as a time-to-loss model's run: the ratio file holds the medians' ratio under <task>_<optimizer>
    report["models"] = {"ttl_lm": report["models"]["transformer_tiny"]}
    (tmp_path / "as_ttl.json").write_text(json.dumps(report))
    ttl_ratios.main([str(tmp_path / "as_ttl.json"), "--json", str(tmp_path / "ratios.json")])
    rows = report["models"]["ttl_lm"]["variants"]
    expected = rows["fdg_stashed_stored"]["samples_per_s"]["median"] / rows["1f1b_m4"]["samples_per_s"]["median"]
    got = time_to_loss.throughput_ratio(tmp_path / "ratios.json", "lm", optimizer, 2)
    assert got is not None and got["ratio"] == pytest.approx(expected) and got["optimizer_matches"]


@pytest.mark.timeout(150)
def test_correction_cost_measures_every_correction_and_its_delta(tmp_path: Path) -> None:
    run_benchmark("correction_cost", "--models=transformer_tiny", "--repeats=2", "--window=2", f"--out={tmp_path}")
    result = json.loads((tmp_path / "correction_cost.json").read_text())["models"]["transformer_tiny"]
    rows = result["variants"]
    assert set(rows) == {"none", "delay_lr", "predict", "both"}
    assert rows["none"]["ratio_vs_none"]["median"] == pytest.approx(1.0)
    for name, row in rows.items():
        assert 0 < row["tick_ms_median"] < math.inf and row["ratio_vs_none"]["median"] > 0, name
        # δ: one fp32 tensor per parameter of the stage with prediction on, nothing without.
        expected = 4 * result["stage0_params"] if name in ("predict", "both") else 0
        assert row["held_bytes"] == expected, name
    assert "| predict |" in (tmp_path / "correction_cost.md").read_text()


def run_benchmark(script: str, *args: str, timeout: float = 140) -> subprocess.CompletedProcess[str]:
    """Run ``python -m benchmarks.throughput.<script> args`` from the repository root on the CPU accelerator with one
    thread; fail with its output's tail."""
    command = [sys.executable, "-m", f"benchmarks.throughput.{script}", *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def tiny_model_row(script: str, *args: str) -> tuple[str, list[str]]:
    """Run ``benchmarks.throughput.<script>`` on resnet8_tiny; its table row, and the row's cells after the model's
    name."""
    done = run_benchmark(script, "--models=resnet8_tiny", *args)
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| resnet8_tiny |")]
    return row, [cell.strip() for cell in row.strip("|").split("|")[1:]]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("order", ["plain", "fdg"])
def test_core_contention_reports_both_modes_and_the_ceiling(order: str) -> None:
    row, cells = tiny_model_row("core_contention", "--rounds=2", "--iterations=3", f"--halves-order={order}")
    alone, pair, slowdown, ceiling, split, stages_sum, stage_ms, spread, lockstep, with_lockstep = cells
    assert re.fullmatch(r"0,\d+,\d+", split), row
    assert re.fullmatch(r"[\d.]+ / [\d.]+ \([\d.]+ / [\d.]+\)", stage_ms), row
    medians = [float(cell.split()[0]) for cell in (alone, pair, stages_sum, spread, ceiling)]
    assert all(0 < value < math.inf for value in medians) and float(slowdown) > 0, row
    assert float(lockstep.split()[0]) >= 0  # a maximum is never below either mean
    assert float(with_lockstep) <= float(ceiling.split()[0]) + 0.005, row


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_staleness_metric_reads_every_stage_back_from_its_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/studies/staleness_metric.py: a 2-stage GPT-2 engine run, the metric read from each stage's offline
    W&B run."""
    script = ["-m", "benchmarks.studies.staleness_metric"]
    name = "fdg_k2_b1.0_stashed_p0.0_first"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "STALENESS_METRIC_OUT": str(tmp_path)}
    env.update(PYTHONPATH=str(ROOT), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))
    run = [sys.executable, *script, "run", "--runs", name, "--micro_batches", "24", "--eval_every", "12"]
    done = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((tmp_path / name / "ds_config.json").read_text())["pipeline"]["fdg"]["staleness_every"] == 4

    from benchmarks.studies import staleness_metric

    monkeypatch.setattr(staleness_metric, "OUT", tmp_path)
    series = staleness_metric.stage_series(name)
    assert sorted(series) == [0, 1]
    first = [v for _, v in series[0]]
    assert len(first) in (24 // 4, 24 // 4 + 1), series[0]  # one per train_batch() call of 4 ticks (+ the drain's)
    assert all(math.isfinite(v) and 0 < v < 1 for v in first[1:]), first  # stage 0 steps from the second call on
    assert all(v == 0.0 for _, v in series[1]), series[1]  # the last stage: 0 by definition

    report = [sys.executable, *script, "report", "--runs", name]
    done = subprocess.run(report, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"| {name} | 0 | " in done.stdout and f"| {name} | 1 | 0.00e+00 |" in done.stdout


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_stage_alone_reports_each_splits_offset_and_share_errors(tmp_path: Path) -> None:
    args = ["--stages=3", "--activations=stored", "--ticks=4", "--rounds=2", "--profile-repeats=2"]
    run_benchmark("stage_alone", "--models=resnet8_tiny", *args, f"--out={tmp_path}")
    rows = json.loads((tmp_path / "stage_alone.json").read_text())["rows"]
    assert [r["stage"] for r in rows] == [0, 1, 2]
    predicted = sum(r["predicted_s"] for r in rows)
    measured = sum(r["measured_s"] for r in rows)
    for r in rows:  # error = (1 + offset) (1 + share error) - 1: the split's offset times the stage's share
        assert r["offset"] == pytest.approx(measured / predicted - 1)
        assert (1 + r["error"]) == pytest.approx((1 + r["offset"]) * (1 + r["share_error"]))
    assert sum(r["predicted_s"] / predicted * (1 + r["share_error"]) for r in rows) == pytest.approx(1.0)
    assert "| share error |" in (tmp_path / "stage_alone.md").read_text()


@pytest.mark.timeout(150)
def test_engine_overhead_times_bp_fdg_and_stock_deepspeed_on_one_core() -> None:
    row, cells = tiny_model_row("engine_overhead", "--rounds=2", "--gas=2")
    values = [float(cell.split()[0]) for cell in cells]
    assert len(values) == 5 and all(0 < value < math.inf for value in values), row


@pytest.mark.timeout(150)
def test_freed_memory_times_both_allocator_settings_in_fresh_processes() -> None:
    row, cells = tiny_model_row("freed_memory", "--rounds=2", "--warmup=2", "--iterations=2")
    system_ms, retained_ms, ratio, system_faults, retained_faults, system_kernel, retained_kernel = cells
    assert all(float(cell.split()[0]) > 0 for cell in (system_ms, retained_ms, ratio)), row
    assert all(float(cell.split()[0]) >= 0 for cell in (system_faults, retained_faults, system_kernel, retained_kernel))


def shared_memory_link(rank: int, world: int, ticks: int) -> tuple[list[list[float]], list[bool]]:
    """Each rank sends a tensor that names its rank and tick, and receives the peer's of the tick before."""
    from datetime import timedelta

    from benchmarks.common.throughput_variants import shared_memory_link as link_between_the_halves
    from fdg_schedule.exchange.shm_link import Direction, ring_path

    like = torch.zeros(3, 5)
    link = link_between_the_halves(like)
    received = []
    for tick in range(ticks):
        into = torch.full_like(like, -1.0)
        if tick:
            link.receive([into], timedelta(seconds=30))
        received.append(into.flatten().unique().tolist())
        if tick % 3 == rank:  # one rank late now and then: the other must wait for it, not read a stale slot
            time.sleep(0.05)
        link.send([torch.full_like(like, 100.0 * rank + tick)], timedelta(seconds=30))
    return received, [os.path.exists(ring_path(link.token, d)) for d in Direction]


@pytest.mark.distributed
def test_the_plain_halves_exchange_through_the_librarys_shared_memory_link(tmp_path: Path) -> None:
    from dist_harness import run_ranks

    ticks = 9  # more than the link's slots
    per_rank = run_ranks(shared_memory_link, 2, tmp_path, ticks, deadline_s=120)
    for rank, (received, named) in enumerate(per_rank):
        peer = 1 - rank
        assert received == [[-1.0]] + [[100.0 * peer + tick] for tick in range(ticks - 1)]
        assert named == [False, False]  # the ring files' names are gone once both ranks mapped them


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_transport_cost_times_both_transports_per_size(tmp_path: Path) -> None:
    done = run_benchmark("transport_cost", "--sizes=0.01,0.1", "--rounds=2", "--ticks=3", f"--out={tmp_path}")
    report = json.loads((tmp_path / "transport_cost.json").read_text())
    assert [row["mib"] for row in report["rows"]] == [0.01, 0.1]
    for row in report["rows"]:
        for transport in ("process_group", "shm"):
            assert row[transport]["wall_ms"] > 0 and len(row[transport]["cpu_ms"]) == 2
        assert row["shm_over_gloo_wall_ms"] > 0 and row["shm_over_gloo_cpu_ms"] > 0
    assert len(report["raw"]) == 2 and len(report["raw"][0]) == 2 * 2 * 2  # rounds x sizes x transports
    assert "| 0.1 MiB |" in done.stdout


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_the_new_shapes_run_with_their_halves(tmp_path: Path) -> None:
    """Issue 48's shapes (the plain conv net as LayerSpecs, a wide MLP): FDG and its plain-torch halves on the same
    split, compared."""
    run_benchmark("throughput", "--quick", "--models=plainconv_tiny,widemlp_tiny", "--repeats=1",
                  "--variants=bp,fdg_current_stored,halves", f"--out={tmp_path}")  # fmt: skip
    models = json.loads((tmp_path / "throughput.json").read_text())["models"]
    for model in ("plainconv_tiny", "widemlp_tiny"):
        rows = models[model]["variants"]
        assert rows["halves"]["split"] == rows["fdg_current_stored"]["split"], model
        assert rows["fdg_current_stored"]["ratio_vs_halves"]["median"] > 0, model


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_tick_anatomy_splits_every_variant_per_rank(tmp_path: Path) -> None:
    """benchmarks/studies/tick_anatomy.py (issue 48): the halves and FDG on both transports, bound and unbound, each
    rank's tick split into the layers' compute, the engine, other threads and the lock-step."""
    command = [sys.executable, "-m", "benchmarks.studies.tick_anatomy", "--model=plainconv_tiny", "--rounds=1",
               "--window=4", "--warmup=4", f"--out={tmp_path}"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = json.loads((tmp_path / "tick_anatomy.json").read_text())["ranks"]
    names = {w["variant"] for w in ranks[0]["windows"]}
    assert {"halves", "halves_exchange", "halves_shm", "fdg", "fdg_shm", "fdg_bound"} <= names
    for rank in ranks:
        (fdg,) = [w for w in rank["windows"] if w["variant"] == "fdg"]
        assert fdg["ticks"] == 4 and len(fdg["ticks_busy_wait_s"]) == 4
        assert fdg["inner"]["module_forward"] > 0 and fdg["instruction_cpu"]["FDGForward"] > 0
    assert "slower rank alone" in done.stdout and "| fdg_shm | 1 |" in done.stdout
