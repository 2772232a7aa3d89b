"""The time-to-loss runner's queue and analysis (benchmarks/convergence/time_to_loss.py) on synthetic run files.

No training here: the curves are written by hand with a known r, so the analysis must give it back; the queue's
restart logic is checked on which run it picks next once files exist.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks.convergence import time_to_loss as ttl
from fdg_schedule.plan import token_overhead as to

N = ttl.BUDGET["lm"] * ttl.LM_MICRO * ttl.LM_BLOCK  # a baseline's tokens


def line(final: float, tokens: float, start: float = 6.0, points: int = 16) -> list[list[float]]:
    """A straight validation curve from ``start`` at tokens/points down to ``final`` at ``tokens``."""
    xs = [tokens * (i + 1) / points for i in range(points)]
    return [[x, start + (final - start) * (i + 1) / points] for i, x in enumerate(xs)]


def fdg_curve(target: float, r: float, start: float = 6.0) -> list[list[float]]:
    """A straight FDG curve over CAP x N tokens that crosses ``target`` at exactly r x N tokens."""
    points = 32
    xs = [ttl.CAP * N * (i + 1) / points for i in range(points)]
    slope = (target - start) / (r * N)
    return [[x, start + slope * x] for x in xs]


def put(out: Path, run: ttl.Run, curve: list[list[float]], failed: bool = False) -> None:
    result = {**dataclasses.asdict(run), "name": run.name, "val": curve, "final": curve[-1][1], "wall_s": 1.0}
    if failed:
        result["failed"] = "non-finite loss"
    ttl.write_result(run.path(out), result)


def test_run_names_round_trip() -> None:
    for run in (ttl.Run("lm", "adamw", "bp_a4", 5e-4, 0.1, 300), ttl.Run("resnet", "sgd", "fdg_k8", 0.2, 0.0, 306)):
        assert ttl.Run.parse(run.name) == run
    run = ttl.Run("lm", "muon", "fdg_k4", 0.02, 0.0, 301)
    assert (run.stages, run.accumulate, run.micro_batches, run.split) == (4, 1, ttl.CAP * ttl.BUDGET["lm"], "test")
    base = ttl.Run("lm", "muon", "bp_a4", 0.02, 0.0, ttl.TUNING_SEED)
    assert (base.stages, base.accumulate, base.micro_batches, base.split) == (1, 4, ttl.BUDGET["lm"], "validation")


def fill_grid(out: Path, best_bp: tuple[float, float], best_fdg_r: dict[tuple[float, float], float]) -> None:
    """The lm/adamw tuning grid: bp arms best at ``best_bp``; FDG's r on the tuning seed per grid point."""
    for arm in ("bp_a4", "bp_a1"):
        for run in ttl.grid("lm", "adamw", arm):
            final = 2.0 if (run.lr, run.warmup) == best_bp else 2.2 + run.lr
            put(out, run, line(final, N))
    for run in ttl.grid("lm", "adamw", "fdg_k2"):
        put(out, run, fdg_curve(2.0, best_fdg_r.get((run.lr, run.warmup), 3.0)))  # 3.0: beyond the cap


def test_selection_baselines_by_final_loss_fdg_by_tokens_to_bp_a4(tmp_path: Path) -> None:
    assert ttl.choose(tmp_path, "lm", "adamw", "bp_a4") is None  # nothing in yet
    fill_grid(tmp_path, (1e-3, 0.1), {(5e-4, 0.0): 1.5, (2e-3, 0.1): 1.2})
    assert ttl.choose(tmp_path, "lm", "adamw", "bp_a4") == ttl.Run("lm", "adamw", "bp_a4", 1e-3, 0.1, 300)
    assert ttl.choose(tmp_path, "lm", "adamw", "bp_a1") == ttl.Run("lm", "adamw", "bp_a1", 1e-3, 0.1, 300)
    assert ttl.choose(tmp_path, "lm", "adamw", "fdg_k2") == ttl.Run("lm", "adamw", "fdg_k2", 2e-3, 0.1, 300)


def test_fdg_choice_waits_for_bp_a4(tmp_path: Path) -> None:
    for run in ttl.grid("lm", "adamw", "fdg_k2"):
        put(tmp_path, run, fdg_curve(2.0, 1.2))
    assert ttl.choose(tmp_path, "lm", "adamw", "fdg_k2") is None


def test_analysis_gives_back_a_known_r_with_bounds_and_net(tmp_path: Path) -> None:
    fill_grid(tmp_path, (1e-3, 0.1), {(2e-3, 0.1): 1.2})
    rs = [1.10, 1.25, 1.18, 1.30, 1.22, 1.15]
    assert len(rs) == len(ttl.SEEDS)
    for seed, r in zip(ttl.SEEDS, rs):
        final = 2.0 - 0.01 * (seed % 3)  # the target differs by seed; r is relative to each seed's own baseline
        put(tmp_path, ttl.Run("lm", "adamw", "bp_a4", 1e-3, 0.1, seed), line(final, N))
        put(tmp_path, ttl.Run("lm", "adamw", "bp_a1", 1e-3, 0.1, seed), line(final - 0.1, N))
        put(tmp_path, ttl.Run("lm", "adamw", "fdg_k2", 2e-3, 0.1, seed), fdg_curve(final, r))
    throughput = tmp_path / "ratio.json"
    throughput.write_text(json.dumps({"lm_adamw": 1.5}))
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps([{"K": 4, "cluster": "h100-ib", "model": "gpt-1.3b", "over_1f1b": 1.4,
                                      "over_best_sync": 1.1}]))  # fmt: skip
    report = ttl.analyze(tmp_path, throughput, predicted)
    k2 = next(e for e in report["configs"] if (e["task"], e["optimizer"], e["K"]) == ("lm", "adamw", 2))
    row = k2["against_bp_a4"]
    logs = [math.log(r) for r in rs]
    mean, sd = sum(logs) / len(logs), (sum((x - sum(logs) / len(logs)) ** 2 for x in logs) / (len(logs) - 1)) ** 0.5
    half = to.t_quantile(0.95, len(rs) - 1) * sd / math.sqrt(len(rs))
    assert row["r"] == pytest.approx(math.exp(mean), rel=1e-9)
    assert row["upper_95"] == pytest.approx(math.exp(mean + half), rel=1e-9)
    lo, hi = row["interval_95"]
    half2 = to.t_quantile(0.975, len(rs) - 1) * sd / math.sqrt(len(rs))
    assert (lo, hi) == (pytest.approx(math.exp(mean - half2)), pytest.approx(math.exp(mean + half2)))
    assert [s["r"] for s in row["seeds"]] == pytest.approx(rs, rel=1e-9)
    (net,) = row["net_speedups"]
    assert net["measured"] and net["optimizer_matches"] and net["net"] == pytest.approx(1.5 / math.exp(mean))
    assert net["net_lower_95"] == pytest.approx(1.5 / math.exp(mean + half))
    # bp_a1 ends lower: FDG's curve (aimed at bp_a4's loss) crosses bp_a1's loss later, r larger
    assert k2["against_bp_a1"]["r"] > row["r"]
    # K = 4: no runs, so no rows; the predicted ratios are only used where r exists
    k4 = next(e for e in report["configs"] if (e["task"], e["optimizer"], e["K"]) == ("lm", "adamw", 4))
    assert "against_bp_a4" not in k4
    assert "| lm | adamw | 2 | bp_a4 | 6 (6) of 6 |" in report["table"]
    assert "measured, ratio 1.500" in report["table"]


def test_predicted_ratios_come_from_the_planner_for_the_measured_fdg_mode() -> None:
    rows = ttl.predict()
    assert {(r["K"], r["cluster"], r["model"]) for r in rows} == {
        (k, c, m) for k in (4, 8) for c in ttl.PREDICT_CLUSTERS for m, _ in ttl.PREDICT_MODELS
    }
    for row in rows:
        assert row["fdg"].startswith("fdg stashed/stored") and row["micro_batches"] == ttl.BASELINE_GAS
        assert row["over_best_sync"] <= row["over_1f1b"]  # 1F1B is one of the synchronous schedules


def test_a_seed_that_does_not_reach_is_kept_as_beyond_the_cap(tmp_path: Path) -> None:
    fill_grid(tmp_path, (1e-3, 0.1), {(2e-3, 0.1): 1.2})
    for seed in ttl.SEEDS:
        put(tmp_path, ttl.Run("lm", "adamw", "bp_a4", 1e-3, 0.1, seed), line(2.0, N))
        put(tmp_path, ttl.Run("lm", "adamw", "fdg_k2", 2e-3, 0.1, seed), fdg_curve(2.0, 3.0 if seed == 301 else 1.2))
    row = ttl.analyze(tmp_path)["configs"][0]["against_bp_a4"]
    assert row["r"] is None and row["reached"] == len(ttl.SEEDS) - 1
    expected = math.exp((math.log(ttl.CAP) + (len(ttl.SEEDS) - 1) * math.log(1.2)) / len(ttl.SEEDS))
    assert row["r_at_least"] == pytest.approx(expected)
    assert row["seeds"][0]["r"] is None and row["seeds"][0]["cap"] == pytest.approx(ttl.CAP)


def test_queue_order_and_restart_skip_done_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order = ttl.queue_order(tmp_path)
    first = [i for i in order if isinstance(i, ttl.Run)][: 3 * len(ttl.GRIDS["adamw"]) * len(ttl.WARMUPS)]
    assert {r.arm for r in first} == {"bp_a4", "bp_a1", "fdg_k2"} and {r.optimizer for r in first} == {"adamw"}
    assert all(r.seed == ttl.TUNING_SEED for r in first)
    names = [i.name for i in order if isinstance(i, ttl.Run)]
    assert len(names) == len(set(names))  # the baselines' grid runs once, shared by K = 2, 4, 8
    points, seeds = len(ttl.GRIDS["adamw"]) * len(ttl.WARMUPS), len(ttl.SEEDS)
    k2 = sum(1 for _, _, k in ttl.CONFIGS if k == 2)
    assert len(order) == k2 * 3 * (points + seeds) + (len(ttl.CONFIGS) - k2) * (points + seeds)  # 156: each once
    assert ttl.next_run(tmp_path) == first[0]

    calls: list[str] = []

    def fake(run: ttl.Run) -> dict:
        calls.append(run.name)
        if run.arm == "bp_a1":
            raise RuntimeError("diverged")
        return {**dataclasses.asdict(run), "name": run.name, "val": line(2.0, N), "final": 2.0}

    monkeypatch.setattr(ttl, "one_run", fake)
    ttl.run_one(tmp_path, first[0])
    assert ttl.next_run(tmp_path) == first[1]  # the done run is skipped on restart
    for run in first[1:]:
        ttl.run_one(tmp_path, run)
    assert len(calls) == len(first)
    failed = ttl.read(first[len(first) // 3].path(tmp_path))
    assert failed is not None and "diverged" in failed["failed"]  # recorded, counted as done
    nxt = ttl.next_run(tmp_path)
    assert nxt is not None and nxt.seed == ttl.SEEDS[0] and nxt.arm == "bp_a4"  # tuning done: the report seeds
    assert ttl.choose(tmp_path, "lm", "adamw", "bp_a1") == ttl.grid("lm", "adamw", "bp_a1")[0]  # all failed: the first


def test_throughput_ratio_from_the_benchmarks_json(tmp_path: Path) -> None:
    path = tmp_path / "throughput.json"
    variants = {
        "fdg_stashed_stored": {"samples_per_s": {"median": 30.0}},
        "1f1b_m4": {"samples_per_s": {"median": 24.0}},
    }
    path.write_text(json.dumps({"models": {"ttl_lm": {"variants": variants}}}))
    got = ttl.throughput_ratio(path, "lm", "adamw", 2)
    assert got is not None and got["ratio"] == pytest.approx(1.25) and got["measured"]
    assert not got["optimizer_matches"]  # the benchmark steps SGD: said, not hidden
    assert (
        ttl.throughput_ratio(path, "resnet", "sgd", 2) is None and ttl.throughput_ratio(path, "lm", "adamw", 4) is None
    )


def test_the_queue_child_command_parses_to_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = ttl.Run("lm", "muon", "fdg_k8", 0.02, 0.1, 303)
    for pause in (None, tmp_path / "QUIET"):
        monkeypatch.setattr(ttl, "PAUSE_WHILE", pause)
        command = ttl.child_command(tmp_path, run)
        assert command[1:3] == ["-m", "benchmarks.convergence.time_to_loss"]
        args = ttl.parser().parse_args(command[3:])
        assert (args.what, ttl.Run.parse(args.name), args.out, args.pause_while) == ("one", run, tmp_path, pause)


def test_run_files_are_curves_the_token_overhead_command_reads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base, late = ttl.Run("lm", "adamw", "bp_a4", 1e-3, 0.1, 301), ttl.Run("lm", "adamw", "fdg_k2", 1e-3, 0.1, 301)
    put(tmp_path, base, line(2.0, N))
    put(tmp_path, late, fdg_curve(2.0, 1.25))
    assert to.load_curve(str(base.path(tmp_path))) == [tuple(p) for p in line(2.0, N)]
    assert to.main([str(base.path(tmp_path)), str(late.path(tmp_path))]) == 0
    assert "r = 1.250 over 1 seeds" in capsys.readouterr().out


# docs/results/time-to-loss-preregistration.md's task table, as literal values: `lm` "8 decoder layers, width 128,
# intermediate 344, 4 heads, 2 KV heads, untied, vocabulary 4,096: 10 pipeline layers", 128-token blocks, 8 per
# micro-batch; `resnet` "cifar_resnet_layers(20, 10, 1), 12 pipeline layers", 32 images of MNIST's 28x28. The
# table's runner (51720f3, which its queue runs frozen) held these in its LLAMA (the keys the table does not name
# included); main's copy must build exactly these models.
PREREGISTERED_LLAMA = {
    "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 344,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 4096,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6,
}  # fmt: skip


def test_the_models_are_the_preregistered_ones() -> None:
    from benchmarks.common import bench_models, ttl_models

    assert ttl_models.LLAMA == PREREGISTERED_LLAMA and ttl.LLAMA is ttl_models.LLAMA
    assert (ttl.LM_MICRO, ttl.LM_BLOCK, ttl.RESNET_MICRO) == (8, 128, 32)
    resnet = (ttl_models.RESNET_DEPTH, ttl_models.RESNET_CLASSES, ttl_models.RESNET_CHANNELS, ttl_models.RESNET_IMAGE)
    assert resnet == (20, 10, 1, 28)
    # the throughput benchmark times the same models (the K = 2 ratio of the pre-registration's command)
    assert bench_models.MODELS["ttl_lm"] == {"kind": "llama", "vocab": 4096, "seq": 128, "micro": 8}
    assert bench_models.MODELS["ttl_resnet"] == {"kind": "resnet", "depth": 20, "micro": 32, "image": 28, "channels": 1}


def test_the_builders_build_the_preregistered_models_weight_for_weight() -> None:
    import torch
    from transformers import LlamaConfig

    from benchmarks.common import ttl_models
    from fdg_schedule.zoo import hf_lm, resnet

    def built(layers: list) -> list:
        return [layer.build() if hasattr(layer, "build") else layer for layer in layers]

    def weights(layers: list) -> list[tuple[str, torch.Tensor]]:
        return [(name, p) for layer in layers for name, p in layer.state_dict().items()]

    torch.manual_seed(301)  # the runner seeds the initial weights with the run's seed
    lm = ttl_models.lm_layers()
    torch.manual_seed(301)
    expected = hf_lm.pipeline_layers(hf_lm.build_model(LlamaConfig(**PREREGISTERED_LLAMA)))
    torch.manual_seed(302)
    net = built(ttl_models.resnet_layers())
    torch.manual_seed(302)
    expected_net = built(resnet.cifar_resnet_layers(20, 10, 1))
    assert (len(lm), len(net)) == (10, 12)  # the table's pipeline layers
    # counted from 51720f3's definitions
    assert [sum(p.numel() for m in layers for p in m.parameters()) for layers in (lm, net)] == [2500736, 269434]
    for ours, theirs in ((weights(lm), weights(expected)), (weights(net), weights(expected_net))):
        assert [name for name, _ in ours] == [name for name, _ in theirs]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, theirs))
