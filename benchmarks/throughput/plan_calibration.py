"""Calibrate the planner on this machine, then check its K = 2 predictions against measured FDG and 1F1B runs.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.plan_calibration                                 # ~10 min on two idle cores
    python -m benchmarks.throughput.plan_calibration --report-only                   # re-print from the JSON

1. Links: ping-pong between two gloo ranks at 4 KiB ... 4 MiB, fitted to ``latency + bytes / bandwidth``.
2. Calibration (not validated on): the framework's own time per micro-batch, measured on
   ``transformer_tiny`` (a few ms of compute) as measured time minus the planner's prediction
   without overheads: DeepSpeed's per-instruction dispatch (from 1F1B m = 4) and FDG's per-tick
   bookkeeping (from FDG current/stored, after the former).
3. Validation: ResNet-32 and the 4-block transformer of benchmarks/common/throughput_variants.py. Each layer is
   timed alone (median of 15 after 3 warm-up rounds, one thread): forward, backward, recompute
   (no-grad forward), SGD step, and its sizes; the planner picks each schedule's split from those
   numbers, predicts samples/s, and throughput.py's interleaved rounds measure the same variants
   with the same splits (``--parts``).

Writes ``<out>/plan_calibration.json`` and ``.md`` (predicted, measured, error %).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import throughput_variants as variants  # noqa: E402  (its models and optimizer settings)
from benchmarks.common.provenance import engine_version  # noqa: E402
from benchmarks.throughput import throughput  # noqa: E402  (benchmarks/throughput/throughput.py: interleaved timing of the variants)
from fdg_schedule.plan import CLUSTERS, CostModel, LayerCost, ModelProfile, Variant, predict  # noqa: E402
from fdg_schedule.tools.launch import run  # noqa: E402

VARIANTS = {  # throughput.py name -> planner variant
    "bp": None,
    "1f1b_m4": Variant("1f1b"),
    "fdg_current_stored": Variant("fdg", "current", "stored"),
    "fdg_stashed_stored": Variant("fdg", "stashed", "stored"),
    "fdg_current_recomputed": Variant("fdg", "current", "recomputed"),
}
MICRO_BATCHES_1F1B = 4


# ---------------------------------------------------------------------------------------------------
# 1. Layer costs


def measure_layers(model: str, warmup: int = 3, repeats: int = 15) -> ModelProfile:
    """Time each layer of ``model`` alone in this process (one thread); medians of ``repeats`` rounds.

    Note [planner profile loader]: this is the profiler's measurement in miniature; once
    ``fdg_schedule.partitioning.profile`` is merged, its ``profile_layers`` replaces it.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [spec.build() for spec in variants.model_layers(model)]
    x0 = variants.fixed_data(model, 1)[0][0]
    out, h = [], x0
    for layer in layers:
        params = [p for p in layer.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=variants.LR, momentum=variants.MOMENTUM) if params else None
        times: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "recompute_s": [], "step_s": []}
        saved = [0]
        storages = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}

        def pack(t: torch.Tensor, saved: list[int] = saved, storages: set[int] = storages) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in storages:
                saved[0] += t.numel() * t.element_size()
            return t

        for i in range(warmup + repeats):
            x = h.detach().requires_grad_(h.is_floating_point())
            saved[0] = 0
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x)
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            t2 = time.perf_counter()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            with torch.no_grad():
                layer(x)
            t4 = time.perf_counter()
            if i >= warmup:
                for key, value in zip(times, (t1 - t0, t2 - t1, t4 - t3, t3 - t2)):
                    times[key].append(value)
        out.append(
            LayerCost(
                name=type(layer).__name__,
                **{k: statistics.median(v) for k, v in times.items()},
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                activation_bytes=y.numel() * y.element_size(),
                saved_bytes=saved[0],
            )
        )
        h = y.detach()
    return ModelProfile(
        layers=tuple(out),
        micro_batch=variants.MODELS[model]["micro"],
        device="cpu",
        dtype="float32",
        input_bytes=x0.numel() * x0.element_size(),
        meta={"source": "benchmarks/throughput/plan_calibration.py", "model": model, "repeats": repeats},
    )


# ---------------------------------------------------------------------------------------------------
# 2. Links


def ping_pong_worker(rank: int, world: int, sizes: list[int], rounds: int) -> dict[str, float]:
    """Median one-way time of a message of each size between ranks 0 and 1 (half a round trip)."""
    out = {}
    for size in sizes:
        buf = torch.zeros(size // 4)
        samples = []
        for i in range(rounds + 3):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 3:
                samples.append((time.perf_counter() - start) / 2)
        out[str(size)] = statistics.median(samples)
    return out


def fit_link(one_way: dict[str, float]) -> tuple[float, float]:
    """Least-squares ``latency + bytes / bandwidth`` through the measured one-way times."""
    xs = [float(k) for k in one_way]
    ys = list(one_way.values())
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), 1 / slope


# ---------------------------------------------------------------------------------------------------
# 3. Predict and measure


def predictions(profile: ModelProfile, cluster: Any, model: CostModel) -> dict[str, dict[str, Any]]:
    """Planner's samples/s and split for each variant at K = 2 (bp: one process, one step per micro-batch)."""
    from fdg_schedule.plan.predict import backprop

    out: dict[str, dict[str, Any]] = {}
    for name, variant in VARIANTS.items():
        if variant is None:
            out[name] = {"samples_per_s": profile.micro_batch / backprop(profile), "split": None}
            continue
        p = predict(profile, variant, 2, cluster, micro_batches=MICRO_BATCHES_1F1B, model=model)
        out[name] = {"samples_per_s": p.samples_per_s, "split": p.bounds, "idle": p.idle_fraction,
                     "time_per_micro_batch_s": p.time_per_micro_batch_s}  # fmt: skip
    return out


def measure(model: str, splits: dict[str, list[int]], repeats: int, out: Path) -> dict[str, Any]:
    """throughput.py's interleaved rounds of VARIANTS on ``model`` with the planner's splits."""
    parts = ";".join(f"{model}:{key}={','.join(map(str, bounds))}" for key, bounds in splits.items())
    report = throughput.main([
        "--models", model, "--variants", ",".join(VARIANTS), "--repeats", str(repeats), "--rss", "",
        "--parts", parts, "--out", str(out / f"throughput-{model}"),
    ])  # fmt: skip
    rows = report["models"][model]["variants"]
    return {name: {"samples_per_s": row["samples_per_s"], "split": row["split"],
                   "cpu_share": row["cpu_share_per_stage"]} for name, row in rows.items()}  # fmt: skip


def in_situ_factor(profile: ModelProfile, measured: dict[str, Any]) -> float:
    """Measured BP time per micro-batch over the sum of the layers timed alone (the one fitted constant per model).

    Layers timed one at a time run from warm caches; the same layers chained in one backprop step
    take longer. BP is measured in the same interleaved rounds as the pipelines but is not validated.
    """
    from fdg_schedule.plan.predict import backprop

    return profile.micro_batch / measured["bp"]["samples_per_s"]["median"] / backprop(profile)


def copy_bandwidth(megabytes: int = 16, repeats: int = 20) -> float:
    """Bytes/s of ``tensor.clone()`` on this CPU (what a stashed weight copy costs)."""
    x = torch.randn(megabytes * 2**18)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.clone()
        samples.append(time.perf_counter() - start)
    return 2 * x.numel() * 4 / statistics.median(samples)  # read and write


def splits_for(predicted: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """throughput.py's split keys ("2" stored / 1F1B, "2r" recomputed) from the planner's choices."""
    return {"2": predicted["fdg_current_stored"]["split"], "2r": predicted["fdg_current_recomputed"]["split"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="resnet32,transformer", help="validation models (throughput.py names)")
    parser.add_argument("--calibration-model", default="transformer_tiny")
    parser.add_argument("--repeats", type=int, default=4, help="interleaved rounds per measurement")
    parser.add_argument("--out", default=str(ROOT / "out" / "plan_calibration"))
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        result = json.loads((out / "plan_calibration.json").read_text())
        print(markdown(result))
        return result
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m " + " ".join(
        ["benchmarks.throughput.plan_calibration", *(sys.argv[1:] if argv is None else argv)]
    )
    started = time.monotonic()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    result: dict[str, Any] = {"command": command, "date": date, "engine": engine_version(),
                              "load_start": os.getloadavg()}  # fmt: skip
    # 1. links
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    one_way = run(ping_pong_worker, 2, sizes, 20, deadline_s=600)[0]
    latency, bandwidth = fit_link(one_way)
    cluster = CLUSTERS["cpu-gloo"].__class__(64, bandwidth, latency, bandwidth, latency, 24e9, "this machine")
    result["link"] = {"one_way_s": one_way, "latency_s": latency, "bandwidth_Bps": bandwidth}
    print(f"link: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    # 2. calibration of the framework overheads on a tiny model
    tiny = measure_layers(args.calibration_model)
    measured_tiny = measure(args.calibration_model, splits_for(predictions(tiny, cluster, CostModel())),
                            args.repeats, out)  # fmt: skip
    tiny = tiny.scaled(in_situ_factor(tiny, measured_tiny))
    bare = predictions(tiny, cluster, CostModel())
    per_mb = {n: tiny.micro_batch / measured_tiny[n]["samples_per_s"]["median"] for n in measured_tiny}
    # 1F1B: every micro-batch passes one forward and one backward handler on each stage
    overhead_s = max(0.0, (per_mb["1f1b_m4"] - tiny.micro_batch / bare["1f1b_m4"]["samples_per_s"]) / 2)
    with_dispatch = predictions(tiny, cluster, CostModel(overhead_s=overhead_s))
    fdg_predicted = tiny.micro_batch / with_dispatch["fdg_current_stored"]["samples_per_s"]
    tick_s = max(0.0, per_mb["fdg_current_stored"] - fdg_predicted)
    cost_model = CostModel(overhead_s=overhead_s, tick_overhead_s=tick_s, copy_bandwidth=copy_bandwidth())
    result["calibration"] = {"model": args.calibration_model, "overhead_s": overhead_s, "tick_overhead_s": tick_s,
                             "copy_bandwidth": cost_model.copy_bandwidth, "measured": measured_tiny,
                             "time_factor": tiny.meta["time_factor"]}  # fmt: skip
    print(
        f"calibration: {overhead_s * 1e3:.2f} ms per forward/backward, FDG {tick_s * 1e3:.2f} ms per tick", flush=True
    )
    # 3. validation: the layer timings, scaled by the model's own BP run, predict the pipelines
    result["models"] = {}
    for model in args.models.split(","):
        raw = measure_layers(model)
        measured = measure(model, splits_for(predictions(raw, cluster, cost_model)), args.repeats, out)
        profile = raw.scaled(in_situ_factor(raw, measured))
        predicted = predictions(profile, cluster, cost_model)
        unscaled = predictions(raw, cluster, cost_model)
        rows = {}
        for name in VARIANTS:
            p, m = predicted[name]["samples_per_s"], measured[name]["samples_per_s"]["median"]
            rows[name] = {"predicted": p, "predicted_unscaled": unscaled[name]["samples_per_s"], "measured": m,
                          "measured_min": measured[name]["samples_per_s"]["min"],
                          "measured_max": measured[name]["samples_per_s"]["max"], "error": p / m - 1,
                          "split": predicted[name]["split"], "cpu_share": measured[name]["cpu_share"]}  # fmt: skip
        layers_ms = 1e3 * sum(layer.forward_s + layer.backward_s + layer.step_s for layer in raw.layers)
        result["models"][model] = {"rows": rows, "time_factor": profile.meta["time_factor"],
                                   "profile_sum_ms": layers_ms}  # fmt: skip
        print(markdown({**result, "models": {model: result["models"][model]}}), flush=True)
    result["load_end"] = os.getloadavg()
    result["seconds"] = time.monotonic() - started
    (out / "plan_calibration.json").write_text(json.dumps(result, indent=1))
    (out / "plan_calibration.md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    cal = result.get("calibration", {})
    lines = [
        f"Measured {result['date']}, engine {result['engine']}; command: `{result['command']}`",
        "",
        f"Link: {result['link']['latency_s'] * 1e6:.0f} us + bytes / {result['link']['bandwidth_Bps'] / 1e9:.2f} GB/s. "
        f"Calibrated on {cal.get('model')}: {cal.get('overhead_s', 0) * 1e3:.2f} ms per forward and per backward "
        f"(DeepSpeed dispatch), {cal.get('tick_overhead_s', 0) * 1e3:.2f} ms per FDG tick.",
        "",
    ]
    for model, data in result.get("models", {}).items():
        lines += [f"**{model}**: layers timed alone {data['profile_sum_ms']:.1f} ms per micro-batch; chained in "
                  f"backprop {data['time_factor']:.3f}x that (the in-situ factor, fitted on the bp row)", "",
                  "| variant | split | predicted samples/s | measured median [min-max] | error | CPU share per rank |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, row in data["rows"].items():
            split = "-" if row["split"] is None else ",".join(map(str, row["split"]))
            error = "(fitted)" if name == "bp" else f"{row['error']:+.1%}"
            share = " / ".join(f"{x:.2f}" for x in row["cpu_share"])
            lines.append(f"| {name} | {split} | {row['predicted']:.1f} | {row['measured']:.1f} "
                         f"[{row['measured_min']:.1f}-{row['measured_max']:.1f}] | {error} | {share} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
