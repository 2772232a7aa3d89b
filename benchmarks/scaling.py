"""Write docs/scaling.md: the planner's predictions for FDG and four other schedules at K = 2 ... 64 on three clusters.

    export DS_ACCELERATOR=cpu PYTHONPATH=$PWD
    python benchmarks/scaling.py            # ~3 min on one core: docs/scaling.md, scaling.json, scaling_*.png

Every number in docs/scaling.md comes from this script: the three settings below are planned with
``fdg_schedule.plan`` (FLOP estimates, named clusters), the FDG paper's speed-ups are re-derived
from a stated cost model, and the calibration on this machine is read from
``docs/plan_calibration.json`` (written by ``benchmarks/plan_calibration.py``, which measures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from fdg_schedule.plan import (  # noqa: E402
    CLUSTERS,
    GPUS,
    TRANSFORMERS,
    CostModel,
    Efficiency,
    ModelProfile,
    Variant,
    default_variants,
    estimate_resnet,
    estimate_transformer,
    predict,
)
from fdg_schedule.plan.recommend import Plan, describe, plan, plot, rate  # noqa: E402

DOCS = ROOT / "docs"
COMMAND = "python benchmarks/scaling.py"


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str
    title: str
    profile: Callable[[], ModelProfile]
    gpu: str
    cluster: str
    dp: int
    stages: list[int]


SETTINGS = [
    Setting(
        "resnet101_a100",
        "ResNet-101 (ImageNet, 224 px, bf16), micro-batch 32, on A100 nodes (8 per node) with one 100 Gb/s port",
        lambda: estimate_resnet("resnet101", 32, GPUS["A100"], "bfloat16"),
        "A100",
        "a100-100gbe",
        1,
        [2, 3, 4, 6, 8, 12, 16, 24, 32, 36],
    ),
    Setting(
        "gpt13b_h100",
        "GPT-1.3B (24 layers, width 2048, sequence 2048, bf16), micro-batch 1, 4 data-parallel replicas, on H100 "
        "nodes (8 per node) with 8 x 400 Gb/s InfiniBand",
        lambda: estimate_transformer(TRANSFORMERS["gpt-1.3b"], 1, GPUS["H100"]),
        "H100",
        "h100-ib",
        4,
        [2, 3, 4, 6, 8, 12, 16, 24, 32, 48],
    ),
    Setting(
        "llama8b_h100",
        "a LLaMA-3-8B-shaped transformer (32 layers, width 4096, GQA, SwiGLU, sequence 8192, bf16), micro-batch 1, "
        "on H100 nodes (8 per node) with one 400 Gb/s port",
        lambda: estimate_transformer(TRANSFORMERS["llama-8b"], 1, GPUS["H100"]),
        "H100",
        "h100-400g",
        1,
        [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64],
    ),
]

# The columns of the per-setting tables (all variants are in the JSON)
SHOWN = [
    "fdg current/stored",
    "fdg current/recomputed",
    "fdg stashed/stored",
    "fdg stashed/recomputed",
    "fdg current/stored acc=m",
    "deepspeed 1f1b",
    "gpipe",
    "interleaved v=2",
    "zb-h1",
]


def run_setting(setting: Setting) -> Plan:
    profile = setting.profile()
    eff = Efficiency()
    model = CostModel(copy_bandwidth=GPUS[setting.gpu].memory_bandwidth * eff.memory)
    return plan(profile, CLUSTERS[setting.cluster], setting.stages, default_variants(), setting.dp, model=model)


# ---------------------------------------------------------------------------------------------------
# The FDG paper's speed-ups, re-derived


PAPER_TABLE6 = {  # github.com/ZHUANGHP/FDG README, Table 6: s/epoch (GPU utilisation) on CIFAR-10
    "wrn_28_10": {"bp": (219.1, 0.95), 2: 118.3, 3: 89.6, 4: 74.1},
    "resnet56": {"bp": (30.2, 0.57), 2: 29.6, 3: 27.0, 4: 27.3},
}
ISSUE_FIGURES = {"cifar10": {2: 1.88, 3: 2.72}, "resnet101": {2: 1.68}}
CIFAR_ITERATIONS = 391  # 50,000 images in batches of 128


def paper_model() -> dict[str, Any]:
    """FDG as the authors' code runs it (one process, a thread per GPU, a join and serial copies per tick).

    Calibrated on Table 6's BP column only: each model's GPU time per iteration is its BP time x
    utilisation (this sets the FLOP efficiency), and the host time per layer and pass comes from
    ResNet-56, whose BP is host-bound (57% GPU use): 30.2 s / 391 iterations / (3 passes x 30 layers).
    FDG's stages share that one host thread. Copies run one after another on PCIe 3.0.
    """
    from fdg_schedule.zoo.resnet import paper_split

    gpu = GPUS["GTX1080Ti"]
    bp_s, _ = PAPER_TABLE6["resnet56"]["bp"]
    host_s = bp_s / CIFAR_ITERATIONS / (3 * 30)
    model = CostModel(host_s_per_layer=host_s, shared_host=True)
    out: dict[str, Any] = {"host_s_per_layer": host_s, "cifar": {}, "imagenet": {}}
    for name, row in PAPER_TABLE6.items():
        raw = estimate_resnet(name, 128, gpu, "float32", eff=Efficiency(1.0, 1.0))
        bp_epoch, util = row["bp"]
        gpu_s = sum(layer.forward_s + layer.backward_s + layer.step_s for layer in raw.layers)
        factor = util * bp_epoch / CIFAR_ITERATIONS / gpu_s
        profile = raw.scaled(factor)
        rows = {}
        for k in (2, 3, 4):
            p = predict(profile, Variant("fdg", threads=True), k, CLUSTERS["pcie3"], model=model,
                        bounds=paper_split(name, k))  # fmt: skip
            epoch = CIFAR_ITERATIONS * p.time_per_micro_batch_s
            rows[k] = {"epoch_s": epoch, "speedup": bp_epoch / epoch, "paper_speedup": bp_epoch / row[k]}
        out["cifar"][name] = {"efficiency": 1 / factor, "rows": rows}
    efficiency = out["cifar"]["wrn_28_10"]["efficiency"]  # the same GPU, large convolutions
    for batch in (128, 256):
        raw = estimate_resnet("resnet101", batch, gpu, "float32", eff=Efficiency(efficiency, efficiency))
        bp = sum(layer.forward_s + layer.backward_s + layer.step_s for layer in raw.layers)
        rows = {}
        for bandwidth in (10e9, 3e9):
            cluster = dataclasses.replace(CLUSTERS["pcie3"], intra_bandwidth=bandwidth)
            rows[str(bandwidth)] = {
                k: bp / predict(raw, Variant("fdg", threads=True), k, cluster, model=model,
                                bounds=paper_split("resnet101", k)).time_per_micro_batch_s
                for k in (2, 3, 4, 5)
            }  # fmt: skip
        out["imagenet"][str(batch)] = rows
    return out


# ---------------------------------------------------------------------------------------------------
# Writing


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _cell(p: Any) -> str:
    if p is None:
        return "–"
    return rate(p.samples_per_s) + ("" if p.fits else " ✗")


def setting_section(setting: Setting, result: Plan) -> list[str]:
    by = {(p.variant.name, p.stages): p for p in result.predictions}
    ks = sorted({p.stages for p in result.predictions})
    p0 = result.profile
    params = sum(layer.param_bytes for layer in p0.layers) / p0.dtype_bytes
    lines = [
        f"### {setting.title}",
        "",
        f"{len(p0.layers)} pipeline layers, {params / 1e9:.2f} B parameters; backprop on one device "
        f"{result.backprop_s * 1e3:.1f} ms per micro-batch ({p0.micro_batch / result.backprop_s:,.0f} samples/s); "
        f"data-parallel degree {result.dp} (devices = K x {result.dp}); flushing schedules run 4K micro-batches per "
        f"batch; memory limit {_gb(result.memory_limit)} GB per device.",
        "",
        f"![throughput and memory against K](scaling_{setting.key}.png)",
        "",
        "Samples/s of the whole job (✗: over the memory limit with any split):",
        "",
        "| K | " + " | ".join(SHOWN) + " |",
        "|---" * (len(SHOWN) + 1) + "|",
    ]
    for k in ks:
        lines.append(f"| {k} | " + " | ".join(_cell(by.get((name, k))) for name in SHOWN) + " |")
    lines += ["", "Peak memory per device, GB (weights, gradients and optimizer state included):", "",
              "| K | " + " | ".join(SHOWN) + " |", "|---" * (len(SHOWN) + 1) + "|"]  # fmt: skip
    for k in ks:
        cells = [("–" if by.get((n, k)) is None else _gb(by[(n, k)].peak_memory)) for n in SHOWN]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", *break_even(result), "", describe(result.recommendation, result), ""]
    return lines


def break_even(result: Plan) -> list[str]:
    """Where the best fitting FDG mode is ahead of the best fitting other schedule, and by how much."""
    ks = sorted({p.stages for p in result.predictions})
    wins, losses, lines = [], [], []
    for k in ks:
        fits = [p for p in result.predictions if p.stages == k and p.fits]
        fdg = max((p for p in fits if p.variant.schedule == "fdg"), key=lambda p: p.samples_per_s, default=None)
        fdg1 = max((p for p in fits if p.variant.schedule == "fdg" and p.variant.accumulate == 1),
                   key=lambda p: p.samples_per_s, default=None)  # fmt: skip
        other = max((p for p in fits if p.variant.schedule != "fdg"), key=lambda p: p.samples_per_s, default=None)
        if fdg is None or other is None:
            what = (
                "nothing fits"
                if fdg is None and other is None
                else ("only FDG fits" if other is None else "only the flushing schedules fit")
            )
            lines.append(f"- K = {k}: {what}.")
            (wins if other is None and fdg is not None else losses).append(k)
            continue
        ratio = fdg.samples_per_s / other.samples_per_s
        (wins if ratio > 1.0 else losses).append(k)
        one = ""
        if fdg1 is not None:
            one = f"; with a step per micro-batch ({fdg1.variant.name}) {fdg1.samples_per_s / other.samples_per_s:.2f}x"
        lines.append(f"- K = {k}: best FDG ({fdg.variant.name}) {rate(fdg.samples_per_s)} vs best other "
                     f"({other.variant.name}) {rate(other.samples_per_s)} samples/s: {ratio:.2f}x{one}.")  # fmt: skip
    head = [f"Break-even: the best FDG mode that fits is ahead at K = {_list(wins)} and behind at K = {_list(losses)}:"]
    return head + lines


def _list(ks: list[int]) -> str:
    return ", ".join(map(str, ks)) if ks else "none"


def paper_section(paper: dict[str, Any]) -> list[str]:
    c = paper["cifar"]
    lines = [
        "| model (CIFAR-10, batch 128) | K | predicted s/epoch | predicted speed-up | Table 6 speed-up |",
        "|---|---|---|---|---|",
    ]
    for name, data in c.items():
        for k, row in data["rows"].items():
            lines.append(f"| {name} | {k} | {row['epoch_s']:.1f} | {row['speedup']:.2f} | {row['paper_speedup']:.2f} |")
    lines += [
        "",
        "| ResNet-101, ImageNet | batch | copy bandwidth | K = 2 | K = 3 | K = 4 | K = 5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, rows in paper["imagenet"].items():
        for bw, ks in rows.items():
            lines.append(f"| predicted speed-up | {batch} | {float(bw) / 1e9:.0f} GB/s | " + " | ".join(
                f"{ks[k] if k in ks else ks[str(k)]:.2f}" for k in (2, 3, 4, 5)) + " |")  # fmt: skip
    return lines


def calibration_section() -> list[str]:
    path = DOCS / "plan_calibration.json"
    if not path.exists():
        return ["(no docs/plan_calibration.json yet: run `/work/tools/quiet.sh python benchmarks/plan_calibration.py "
                "--out docs` on two idle cores)"]  # fmt: skip
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_calibration import markdown

    return [markdown(json.loads(path.read_text()))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated setting keys (default all)")
    args = parser.parse_args(argv)
    settings = [s for s in SETTINGS if not args.only or s.key in args.only.split(",")]
    results = {}
    for setting in settings:
        print(f"planning {setting.key} ...", flush=True)
        result = run_setting(setting)
        plot(result, DOCS / f"scaling_{setting.key}.png", title=setting.title)
        results[setting.key] = result
    print("re-deriving the paper's speed-ups ...", flush=True)
    paper = paper_model()
    (DOCS / "scaling.json").write_text(
        json.dumps(
            {"command": COMMAND, "settings": {k: r.to_dict() for k, r in results.items()}, "paper": paper}, indent=1
        )
    )
    (DOCS / "scaling.md").write_text(render(settings, results, paper))
    print(f"wrote {DOCS / 'scaling.md'}")


def render(settings: list[Setting], results: dict[str, Plan], paper: dict[str, Any]) -> str:
    lines: list[str] = []
    for setting in settings:
        lines += setting_section(setting, results[setting.key])
    lines += paper_section(paper)
    lines += calibration_section()
    return "\n".join(lines)


if __name__ == "__main__":
    main()
