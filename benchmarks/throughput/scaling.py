"""Write docs/scaling.md: the planner's predictions for FDG and four other schedules at K = 2 ... 64 on three clusters.

    export DS_ACCELERATOR=cpu PYTHONPATH=$PWD
    python -m benchmarks.throughput.scaling  # 5-8 min on one core: docs/scaling.md; docs/results/scaling/*.{json,png}

Every number in docs/scaling.md comes from this script: the settings below (three clusters, two of them
again with few micro-batches per batch) are planned with
``fdg_schedule.plan`` (FLOP estimates, named clusters), the FDG paper's speed-ups are re-derived
from a stated cost model, and the calibration on this machine is read from
``docs/results/scaling/plan_calibration.json`` (written by ``benchmarks/throughput/plan_calibration.py``, which
measures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from fdg_schedule.plan import (  # noqa: E402
    CLUSTERS,
    GPUS,
    TRANSFORMERS,
    CostModel,
    Efficiency,
    ModelProfile,
    Placement,
    Prediction,
    Variant,
    default_variants,
    estimate_resnet,
    estimate_transformer,
    predict,
)
from fdg_schedule.plan.overheads import Overheads  # noqa: E402
from fdg_schedule.plan.recommend import Plan, describe, plan, plot, rate  # noqa: E402

DOCS = ROOT / "docs"
RESULTS = DOCS / "results" / "scaling"  # the evidence scaling.md shows
COMMAND = "python -m benchmarks.throughput.scaling"


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str
    short: str
    title: str
    profile: Callable[[], ModelProfile]
    gpu: str
    cluster: str
    dp: int
    stages: list[int]
    per_batch: int = 4  # flushing schedules run per_batch x K micro-batches per batch (FDG's acc=m steps as often)
    family: str = ""  # model family and optimizer: where the shipped token overheads are looked up
    optimizer: str = "adamw"


SETTINGS = [
    Setting(
        "resnet101_a100",
        "ResNet-101 on A100 nodes, 100 Gb/s",
        "ResNet-101 (ImageNet, 224 px, bf16), micro-batch 32, on A100 nodes (8 per node) with one 100 Gb/s port",
        lambda: estimate_resnet("resnet101", 32, GPUS["A100"], "bfloat16"),
        "A100",
        "a100-100gbe",
        1,
        [2, 3, 4, 6, 8, 12, 16, 24, 32, 36],
        family="resnet",
        optimizer="sgd",
    ),
    Setting(
        "gpt13b_h100",
        "GPT-1.3B, DP 4, on H100 nodes with InfiniBand",
        "GPT-1.3B (24 layers, width 2048, sequence 2048, bf16), micro-batch 1, 4 data-parallel replicas, on H100 "
        "nodes (8 per node) with 8 x 400 Gb/s InfiniBand",
        lambda: estimate_transformer(TRANSFORMERS["gpt-1.3b"], 1, GPUS["H100"]),
        "H100",
        "h100-ib",
        4,
        [2, 3, 4, 6, 8, 12, 16, 24, 32, 48],
        family="gpt",
    ),
    Setting(
        "llama8b_h100",
        "LLaMA-8B shape on H100 nodes, 400 Gb/s",
        "a LLaMA-3-8B-shaped transformer (32 layers, width 4096, GQA, SwiGLU, sequence 8192, bf16), micro-batch 1, "
        "on H100 nodes (8 per node) with one 400 Gb/s port",
        lambda: estimate_transformer(TRANSFORMERS["llama-8b"], 1, GPUS["H100"]),
        "H100",
        "h100-400g",
        1,
        [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64],
        family="llama",
    ),
    # Few micro-batches per batch (m = K: a memory- or batch-limited job), where flushing schedules lose half their
    # time to the bubble and FDG, which never flushes, should not (issue 46)
    Setting(
        "gpt13b_h100_m_k",
        "GPT-1.3B, DP 4, H100 + InfiniBand, m = K",
        "GPT-1.3B as above, DP 4, on H100 nodes with InfiniBand, with only K micro-batches per batch",
        lambda: estimate_transformer(TRANSFORMERS["gpt-1.3b"], 1, GPUS["H100"]),
        "H100",
        "h100-ib",
        4,
        [4, 8, 16, 24],
        per_batch=1,
        family="gpt",
    ),
    Setting(
        "llama8b_h100_m_k",
        "LLaMA-8B shape, H100, 400 Gb/s, m = K",
        "the LLaMA-8B shape as above, on H100 nodes with one 400 Gb/s port, with only K micro-batches per batch",
        lambda: estimate_transformer(TRANSFORMERS["llama-8b"], 1, GPUS["H100"]),
        "H100",
        "h100-400g",
        1,
        [4, 8, 16, 32],
        per_batch=1,
        family="llama",
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
    overheads = Overheads(family=setting.family or None, optimizer=setting.optimizer, corrections="auto")
    return plan(profile, CLUSTERS[setting.cluster], setting.stages, default_variants(), setting.dp,
                micro_batches=lambda k: setting.per_batch * k, model=model, overheads=overheads)  # fmt: skip


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
        f"{result.backprop_s * 1e3:.1f} ms per micro-batch ({rate(p0.micro_batch / result.backprop_s)} samples/s); "
        f"data-parallel degree {result.dp} (devices = K x {result.dp}); flushing schedules run "
        f"{'' if setting.per_batch == 1 else setting.per_batch}K micro-batches per batch; "
        f"memory limit {_gb(result.memory_limit)} GB per device.",
        "",
        f"![throughput and memory against K](results/scaling/scaling_{setting.key}.png)",
        "",
        "Samples/s of the whole job (✗: over the memory limit with any split; for interleaved, with the split "
        "balanced for speed):",
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


def head_to_head(result: Plan, k: int) -> tuple[Prediction | None, Prediction | None, Prediction | None]:
    """At K = k: the fastest fitting FDG mode, the fastest fitting FDG mode with a step per micro-batch, and the
    fastest fitting other schedule (None where nothing of that kind fits)."""
    fits = [p for p in result.predictions if p.stages == k and p.fits]

    def best(ps: list[Prediction]) -> Prediction | None:
        return max(ps, key=lambda p: p.samples_per_s, default=None)

    return (
        best([p for p in fits if p.variant.schedule == "fdg"]),
        best([p for p in fits if p.variant.schedule == "fdg" and p.variant.accumulate == 1]),
        best([p for p in fits if p.variant.schedule != "fdg"]),
    )


def _ks(result: Plan) -> list[int]:
    return sorted({p.stages for p in result.predictions})


def break_even(result: Plan) -> list[str]:
    """Where the best fitting FDG mode is ahead of the best fitting other schedule, and by how much."""
    wins: list[int] = []
    losses: list[int] = []
    lines: list[str] = []
    for k in _ks(result):
        fdg, fdg1, other = head_to_head(result, k)
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
    path = RESULTS / "plan_calibration.json"
    if not path.exists():
        return ["(no docs/results/scaling/plan_calibration.json yet: run "
                "`python -m benchmarks.throughput.plan_calibration --out docs` on two idle cores)"]  # fmt: skip
    from benchmarks.throughput.plan_calibration import markdown

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
        plot(result, RESULTS / f"scaling_{setting.key}.png", title=setting.title)
        results[setting.key] = result
    print("re-deriving the paper's speed-ups ...", flush=True)
    paper = paper_model()
    (RESULTS / "scaling.json").write_text(
        json.dumps(
            {"command": COMMAND, "settings": {k: r.to_dict() for k, r in results.items()}, "paper": paper}, indent=1
        )
    )
    (DOCS / "scaling.md").write_text(render(settings, results, paper))
    print(f"wrote {DOCS / 'scaling.md'}")


def reading(result: Plan) -> list[str]:
    """What the numbers of one setting say, computed from them."""
    by = {(p.variant.name, p.stages): p for p in result.predictions}
    ks = sorted({p.stages for p in result.predictions})
    lines = []
    # where throughput stops growing, and what paces the tick there
    fdg = [by[("fdg current/stored acc=m", k)] for k in ks if ("fdg current/stored acc=m", k) in by]
    top = max(p.samples_per_s for p in fdg)
    plateau = next(p for p in fdg if p.samples_per_s >= 0.95 * top)
    layers = result.profile.layers
    stage_s = [sum(lay.forward_s + lay.backward_s for lay in layers[a:b]) + sum(lay.step_s for lay in layers[a:b])
               / (plateau.micro_batches or 1) for a, b in zip(plateau.bounds, plateau.bounds[1:])]  # fmt: skip
    slowest = max(range(len(stage_s)), key=stage_s.__getitem__)
    count = plateau.bounds[slowest + 1] - plateau.bounds[slowest]
    what = f"one layer ({layers[plateau.bounds[slowest]].name}) that cannot be cut" if count == 1 else f"{count} layers"
    lines.append(
        f"- FDG's throughput reaches 95% of its maximum ({rate(top)} samples/s) at K = {plateau.stages}. There a tick "
        f"takes {plateau.time_per_micro_batch_s * 1e3:.2f} ms: its slowest stage computes {stage_s[slowest] * 1e3:.2f} "
        f"ms ({what}), and the exchange, the rest of the pipeline's coupling and the all-reduce add "
        f"{(plateau.time_per_micro_batch_s - stage_s[slowest]) * 1e3:.2f} ms "
        f"({plateau.inter_node_bytes_per_micro_batch / 1e6:.1f} MB per micro-batch cross between nodes); "
        f"{plateau.idle_fraction:.0%} of device time is idle."
    )
    # accumulation and the data-parallel all-reduce
    if result.dp > 1:
        k = ks[len(ks) // 2]
        one, acc = by.get(("fdg current/stored", k)), by.get(("fdg current/stored acc=m", k))
        if one and acc:
            lines.append(
                f"- With {result.dp} data-parallel replicas, FDG with a step per micro-batch all-reduces each stage's "
                f"gradients every tick: {one.allreduce_bytes_per_micro_batch / 1e6:,.0f} MB per rank per micro-batch "
                "at "
                f"K = {k}, against {acc.allreduce_bytes_per_micro_batch / 1e6:,.1f} MB with `accumulate` = the "
                f"{acc.micro_batches} micro-batches of the others "
                f"({one.samples_per_s / acc.samples_per_s:.2f}x the throughput). Under data parallelism, set "
                "`accumulate`."
            )
    # memory, in the middle of the range where 1F1B fits
    fitting = [k for k in ks if ("deepspeed 1f1b", k) in by and by[("deepspeed 1f1b", k)].fits] or ks
    k = fitting[len(fitting) // 2]
    stored, recomputed = by.get(("fdg current/stored", k)), by.get(("fdg current/recomputed", k))
    one_f = by.get(("deepspeed 1f1b", k))
    if stored and recomputed and one_f:
        lines.append(
            f"- Memory at K = {k}: FDG stored peaks at {_gb(stored.peak_memory)} GB per device, DeepSpeed's 1F1B at "
            f"{_gb(one_f.peak_memory)} GB, FDG recomputed at {_gb(recomputed.peak_memory)} GB (stage 0 holds "
            f"2(K-1) = {2 * (k - 1)} micro-batches under FDG, K = {k} under 1F1B)."
        )
    lines += falls(result)
    lines += interleaving_behind(result)
    unfit = [k for k in ks if ("fdg current/stored", k) in by and not by[("fdg current/stored", k)].fits
             and ("fdg current/recomputed", k) in by and by[("fdg current/recomputed", k)].fits]  # fmt: skip
    if unfit:
        lines.append(f"- At K = {_list(unfit)} FDG's stored activations exceed {_gb(result.memory_limit)} GB where "
                     "recomputed ones fit: recomputation is what lets FDG go that deep.")  # fmt: skip
    return lines


def busiest_port_s(result: Plan, p: Any) -> float:
    """Seconds per micro-batch that the busiest node's port spends sending (activations out, gradients back).

    Chunk c runs on rank c % K; its output goes to chunk c + 1 and the gradient of its input to c - 1.
    """
    placement = Placement(result.cluster, p.stages, p.dp)
    layers, chunks = result.profile.layers, len(p.bounds) - 1
    sent: dict[int, float] = {}
    for c in range(chunks - 1):  # the cut between chunk c and c + 1
        src, dst = c % p.stages, (c + 1) % p.stages
        if placement.crosses_nodes(src, dst):
            nbytes = layers[p.bounds[c + 1] - 1].activation_bytes
            for node in (placement.node(src), placement.node(dst)):  # the activation one way, its gradient back
                sent[node] = sent.get(node, 0.0) + nbytes * placement.senders_sharing_nic(src)
    return max(sent.values(), default=0.0) / result.cluster.inter_bandwidth


def falls(result: Plan) -> list[str]:
    """Where a schedule gets slower with more stages, and why (here: more bytes cross between nodes)."""
    by = {(p.variant.name, p.stages): p for p in result.predictions}
    ks = sorted({p.stages for p in result.predictions})
    groups: dict[tuple[int, int], list[tuple[Any, Any]]] = {}
    for name in SHOWN:
        computed = [by[(name, k)] for k in ks if (name, k) in by]
        for before, after in zip(computed, computed[1:]):
            if after.samples_per_s < 0.99 * before.samples_per_s:
                groups.setdefault((before.stages, after.stages), []).append((before, after))
    lines = []
    for (k0, k1), pairs in sorted(groups.items()):
        n0, n1 = (Placement(result.cluster, k, result.dp).nodes for k in (k0, k1))
        names = ", ".join(f"{b.variant.name} {rate(a.samples_per_s)} → {rate(b.samples_per_s)}" for a, b in pairs)
        text = f"- From K = {k0} to K = {k1} ({n0} → {n1} node{'s' if n1 > 1 else ''}) these fall: {names}."
        # the same cuts give the same traffic: say it once per distinct (bytes, port time)
        traffic: dict[tuple[str, str], list[str]] = {}
        for a, b in pairs:
            mb0, mb1 = (p.inter_node_bytes_per_micro_batch / 1e6 for p in (a, b))
            key = (f"{mb0:.1f} → {mb1:.1f} MB",
                   f"{busiest_port_s(result, a) * 1e3:.2f} → {busiest_port_s(result, b) * 1e3:.2f} ms")  # fmt: skip
            traffic.setdefault(key, []).append(f"{b.variant.name} {a.time_per_micro_batch_s * 1e3:.2f} → "
                                               f"{b.time_per_micro_batch_s * 1e3:.2f} ms")  # fmt: skip
        if all(b.inter_node_bytes_per_micro_batch > a.inter_node_bytes_per_micro_batch for a, b in pairs):
            parts = [f"{nbytes} per micro-batch cross between nodes, the busiest node's port sends for {port} of "
                     f"each micro-batch (time per micro-batch: {'; '.join(times)})"
                     for (nbytes, port), times in traffic.items()]  # fmt: skip
            text += (f" More bytes cross between nodes, through a node's {result.cluster.inter_bandwidth / 1e9:.0f} "
                     f"GB/s port rather than the {result.cluster.intra_bandwidth / 1e9:.0f} GB/s links inside it: "
                     f"{'; '.join(parts)}.")  # fmt: skip
        schedules = {b.variant.schedule for _, b in pairs}
        if "interleaved" in schedules:
            text += (" Interleaving sends every micro-batch around the ranks twice, so it crosses between nodes "
                     "at 2 x nodes - 1 cuts each way (one of them the wrap from the last rank back to the first), "
                     "not nodes - 1.")  # fmt: skip
        if "1f1b" in schedules:
            text += (" DeepSpeed's 1F1B sends block until received, so a transfer between nodes stalls both "
                     "neighbours, for the activation and again for the gradient.")  # fmt: skip
        if "fdg" in schedules:
            text += (" FDG sends an activation and a gradient across every cut at every tick, so a tick lasts at "
                     "least as long as the busiest port takes to send its share; a node with neighbours on both "
                     "sides sends both kinds through its one port.")  # fmt: skip
        lines.append(text)
    return lines


def busiest_rank_s(result: Plan, p: Any) -> float:
    """Forward + backward seconds per micro-batch of the busiest rank (chunk c runs on rank c % K)."""
    layers = result.profile.layers
    chunk = [sum(lay.forward_s + lay.backward_s for lay in layers[a:b]) for a, b in zip(p.bounds, p.bounds[1:])]
    return max(sum(chunk[r :: p.stages]) for r in range(p.stages))


def interleaving_behind(result: Plan) -> list[str]:
    """Where interleaved 1F1B is slower than plain 1F1B: the rank that holds the slowest chunk holds another too."""
    by = {(p.variant.name, p.stages): p for p in result.predictions}
    layers = result.profile.layers
    behind = []
    for k in sorted({p.stages for p in result.predictions}):
        inter, plain = by.get(("interleaved v=2", k)), by.get(("deepspeed 1f1b", k))
        if inter is None or plain is None or inter.samples_per_s >= plain.samples_per_s:
            continue
        behind.append((k, inter, plain, busiest_rank_s(result, inter), busiest_rank_s(result, plain)))
    if not behind:
        return []
    heaviest = max(layers, key=lambda lay: lay.forward_s + lay.backward_s)
    cases = "; ".join(f"K = {k}: {rate(i.samples_per_s)} vs {rate(p.samples_per_s)} samples/s, busiest rank "
                      f"{li * 1e3:.2f} vs {lp * 1e3:.2f} ms of compute per micro-batch"
                      for k, i, p, li, lp in behind)  # fmt: skip
    return [
        f"- Interleaved 1F1B is behind DeepSpeed's 1F1B at K = {_list([c[0] for c in behind])} ({cases}). Its 2K "
        f"chunks are balanced chunk by chunk, but rank r runs chunks r and r + K: the chunk of the heaviest layer "
        f"({heaviest.name}, {(heaviest.forward_s + heaviest.backward_s) * 1e3:.2f} ms, which cannot be cut) shares "
        "its rank with another chunk, so the busiest rank does more than 1F1B's slowest stage, and the smaller "
        "bubble does not make up for it. (Megatron-LM's interleaving by default puts equally many transformer "
        "layers in every chunk and the head on the last, which balances such a model worse still.)"
    ]


def ratios(result: Plan) -> dict[int, float]:
    """Per K where both fit: the best FDG mode's samples/s over the best other schedule's."""
    out = {}
    for k in _ks(result):
        fdg, _, other = head_to_head(result, k)
        if fdg is not None and other is not None:
            out[k] = fdg.samples_per_s / other.samples_per_s
    return out


def summary(settings: list[Setting], results: dict[str, Plan]) -> list[str]:
    """The break-even points of every setting in one list (why: :func:`why`, in the answer at the top)."""
    lines = []
    for setting in settings:
        result = results[setting.key]
        r = ratios(result)
        ones = []
        for k in r:  # every fitting FDG mode with a step per micro-batch, against the best other schedule
            other = head_to_head(result, k)[2]
            assert other is not None
            mine = [p for p in result.predictions if p.stages == k and p.fits and p.variant.schedule == "fdg"]
            ones += [p.samples_per_s / other.samples_per_s for p in mine if p.variant.accumulate == 1]
        ahead = [k for k, x in r.items() if x > 1.0]
        behind = [k for k, x in r.items() if x <= 1.0]
        best_k = max(r, key=r.__getitem__)
        worst_k = min(r, key=r.__getitem__)
        lines.append(
            f"- **{setting.short}**: FDG's best fitting mode is ahead of the best fitting other schedule at K = "
            f"{_list(ahead)} and level or behind at K = {_list(behind)}; from {r[worst_k]:.2f}x (K = {worst_k}) "
            f"to {r[best_k]:.2f}x (K = {best_k}). With a step per micro-batch (`accumulate: 1`) FDG's modes "
            f"reach {min(ones):.2f}x-{max(ones):.2f}x of it."
        )
    return lines


def why() -> list[str]:
    return [
        "Why, in the model's terms: the flushing schedules lose (K-1) slots per batch to their bubble (1F1B, "
        "GPipe), or a fraction of it (interleaved 1F1B, ZB-H1); FDG loses nothing to a flush and sends each "
        "message when it is made, but the round trip between its last two stages (the activation down, the last "
        "stage's forward and backward, the gradient up) must fit in one tick of stage K-2, so with balanced "
        "stages a transfer longer than half of stage K-2's all-reduce and step stays on the critical path; and it "
        "steps every `accumulate` ticks. So FDG gains most where the bubble "
        "is large and transfers are short (many stages, fast links, small activations), and least at small K, "
        "where ZB-H1 and interleaving already remove most of the bubble. With data parallelism `accumulate: 1` "
        "all-reduces every stage's gradients every tick, which the flushing schedules do once per batch: that is "
        "where FDG loses most. In memory, FDG's stage 0 holds 2(K-1) micro-batches in flight (stage input and "
        "saved activations) against 1F1B's K; recomputed activations keep only the 2(K-1) stage inputs and fit "
        "wherever anything fits."
    ]


def _vs(result: Plan, k: int) -> str:
    """One table row: the best FDG mode against the best other schedule at K = k."""
    fdg, _, other = head_to_head(result, k)
    name = lambda p: "nothing fits" if p is None else f"{p.variant.name}: {rate(p.samples_per_s)}"
    ratio = "–" if fdg is None or other is None else f"**{fdg.samples_per_s / other.samples_per_s:.2f}x**"
    return f"{k} | {name(fdg)} | {name(other)} | {ratio}"


def _net(result: Plan, k: int) -> str:
    """The answer's last cell: the best FDG mode's per-step ratio over the best other schedule's, divided by r."""
    fdg, _, other = head_to_head(result, k)
    if fdg is None or other is None:
        return "–"
    ratio, r = fdg.samples_per_s / other.samples_per_s, result.r(fdg)
    if r.known:
        return f"{r.net(ratio)}x (r = {r.text()})"
    if r.at_least is not None:
        return f"{r.net(ratio)}x (r {r.text()})"
    return f"unknown: r not measured (break-even r = {ratio:.2f})"


def calibration_error() -> tuple[float, float] | None:
    """The smallest and largest prediction error at K = 2 on this machine (rows not fitted), if measured."""
    path = RESULTS / "plan_calibration.json"
    if not path.exists():
        return None
    models = json.loads(path.read_text())["models"]
    errors = [row["error"] for m in models.values() for name, row in m["rows"].items() if name != "bp"]
    return (min(errors), max(errors)) if errors else None


def answer(settings: list[Setting], results: dict[str, Plan], paper: dict[str, Any]) -> list[str]:
    """The page's opening: FDG against the best other schedule at small, FDG's best and large K, then why."""
    lines = [
        "## The answer",
        "",
        "Predicted (not measured) samples/s of the whole job: the fastest FDG mode that fits the device memory "
        "against the fastest other schedule that fits (DeepSpeed 1F1B, GPipe, interleaved 1F1B, ZB-H1), at the "
        "smallest and the largest K where both fit, and at the K where FDG is fastest. The last column is the net "
        "speed-up to the same loss: the per-step ratio divided by FDG's token overhead r against backprop at the "
        "job's batch ([token-overhead.md](token-overhead.md)). Where r is not measured for the setting (family, "
        "optimizer, K, corrections auto, `accumulate`, the job's batch) it says so, with the break-even r: the "
        "per-step ratio, which r must stay below for FDG to reach the loss sooner.",
        "",
        "| setting | K | best FDG mode: samples/s | best other: samples/s | FDG / other per step | net: ÷ r |",
        "|---|---|---|---|---|---|",
    ]
    picks = []
    for setting in settings:
        result = results[setting.key]
        ks = _ks(result)
        fastest = max(ks, key=lambda k: getattr(head_to_head(result, k)[0], "samples_per_s", 0.0))
        r = ratios(result)
        for k in sorted({min(r), fastest, max(r)}):
            lines.append(f"| {setting.short} | {_vs(result, k)} | {_net(result, k)} |")
        ahead, behind = [k for k, x in r.items() if x > 1.0], [k for k, x in r.items() if x <= 1.0]
        where = (f"FDG ahead at K = {_list(ahead)}, level or behind at K = {_list(behind)}" if behind
                 else f"FDG ahead at every K where both fit ({_list(ahead)})")  # fmt: skip
        unfit = [k for k in ks if k not in r]
        if unfit:
            where += f"; at K = {_list(unfit)} not both fit"
        rec = result.recommendation
        pick = "nothing fits" if rec is None else (
            f"{rec.variant.name} at K = {rec.stages} x dp {rec.dp}, {rate(rec.samples_per_s)} samples/s "
            f"({result.speedup(rec):.1f}x backprop)")  # fmt: skip
        even = result.break_even()
        if rec is not None and even is not None and result.alternative is not None:
            alt = result.alternative
            pick += (f", conditional: FDG's r is not measured there, and it reaches the loss before {alt.variant.name} "
                     f"at K = {alt.stages} only if r < {even:.2f}")  # fmt: skip
        picks.append(f"- **{setting.short}**: {where}. The planner's pick: {pick}.")
    lines += ["", *picks, "", *why(), ""]
    wrn = paper["cifar"]["wrn_28_10"]["rows"]
    errs = [wrn[k]["speedup"] / wrn[k]["paper_speedup"] - 1 for k in wrn]
    trust = (
        f"How far to trust it: against the FDG paper's Table 6 (WRN-28-10, K = 2 … 4) the predicted speed-up "
        f"is {min(errs):+.0%} to {max(errs):+.0%} off the published one"
    )
    cal = calibration_error()
    if cal is not None:
        trust += (f"; against runs on this CPU machine at K = 2 the predicted samples/s are {cal[0]:+.1%} to "
                  f"{cal[1]:+.1%} off the measured (positive: optimistic)")  # fmt: skip
    lines += [trust + " (see Validation). Beyond K = 2 and off this machine nothing here is measured.", ""]
    return lines


def assumptions() -> list[str]:
    eff = Efficiency()
    cost = CostModel()
    lines = [
        "| GPU | peak dense FLOP/s (bf16 / fp32) | memory bandwidth | memory |",
        "|---|---|---|---|",
    ]
    for gpu in GPUS.values():
        bf16 = gpu.flops.get("bf16")
        half = "–" if bf16 is None else f"{bf16 / 1e12:.0f} T"
        lines.append(f"| {gpu.name} | {half} / {gpu.flops['fp32'] / 1e12:.1f} T "
                     f"| {gpu.memory_bandwidth / 1e12:.2f} TB/s | {gpu.memory / 1e9:.0f} GB |")  # fmt: skip
    lines += [
        "",
        f"Efficiency: matrix products and convolutions reach {eff.compute:.0%} of peak, everything else "
        f"{eff.memory:.0%} of the memory bandwidth; the optimizer step moves {eff.step_bytes_per_param:.0f} bytes per "
        f"parameter (Adam, mixed precision); weights, gradients and optimizer state take {cost.bytes_per_param:.0f} "
        f"bytes per parameter; ZB-H1's input gradient is {cost.input_fraction:.0%} of a backward and its weight "
        f"gradient keeps {cost.weight_grad_fraction:.0%} of the saved activations; FDG's stashed weights are copied at "
        "the GPU's memory bandwidth x its memory efficiency.",
        "",
        "| cluster | devices per node | inside a node (per device) | between nodes (per node) | memory |",
        "|---|---|---|---|---|",
    ]
    for c in CLUSTERS.values():
        inside = f"{c.intra_bandwidth / 1e9:.0f} GB/s, {c.intra_latency * 1e6:.0f} us"
        between = f"{c.inter_bandwidth / 1e9:.1f} GB/s, {c.inter_latency * 1e6:.0f} us"
        lines.append(f"| `{c.name}` | {c.gpus_per_node} | {inside} | {between} | {c.memory / 1e9:.0f} GB |")
    return lines


def paper_reading(paper: dict[str, Any]) -> list[str]:
    wrn, r56 = paper["cifar"]["wrn_28_10"]["rows"], paper["cifar"]["resnet56"]["rows"]
    im = paper["imagenet"]["256"]
    fast, slow = im[str(10e9)], im[str(3e9)]
    return [
        f"- WRN-28-10 (GPU-bound: 95% utilisation under BP): predicted {wrn[2]['speedup']:.2f}x / "
        f"{wrn[3]['speedup']:.2f}x / {wrn[4]['speedup']:.2f}x at K = 2 / 3 / 4 against Table 6's "
        f"{wrn[2]['paper_speedup']:.2f}x / {wrn[3]['paper_speedup']:.2f}x / {wrn[4]['paper_speedup']:.2f}x, and "
        f"the CIFAR-10 figures quoted in issue 13, {ISSUE_FIGURES['cifar10'][2]}x / {ISSUE_FIGURES['cifar10'][3]}x "
        "at K = 2 / 3 (from a version of the paper we could not read here; Table 6 is the authors' repository's). "
        "The shape (near-linear, slowly bending) is reproduced; the model is "
        f"{wrn[2]['speedup'] / wrn[2]['paper_speedup'] - 1:.0%} to "
        f"{wrn[4]['speedup'] / wrn[4]['paper_speedup'] - 1:.0%} optimistic: it has no per-tick cost for starting and "
        "joining the threads, and it takes the paper's stage splits as balanced as their FLOPs say.",
        f"- ResNet-56 (host-bound: 57% utilisation): predicted {r56[2]['speedup']:.2f}x / {r56[3]['speedup']:.2f}x / "
        f"{r56[4]['speedup']:.2f}x against Table 6's {r56[2]['paper_speedup']:.2f}x / {r56[3]['paper_speedup']:.2f}x / "
        f"{r56[4]['paper_speedup']:.2f}x: no speed-up, because all stages' kernel launches share one Python thread, "
        "which BP already kept busy. The model is more pessimistic than the table at K = 3, 4: the real threads "
        "overlap part of their host work (the GIL is released inside CUDA calls), which the model's one host "
        "lock does not allow.",
        f"- ResNet-101 on ImageNet (batch 256, the paper's splits): predicted {fast[2]:.2f}x at K = 2 against the "
        f"quoted {ISSUE_FIGURES['resnet101'][2]}x. Beyond that the serial copies decide: at 10 GB/s (PCIe 3.0 "
        f"peer-to-peer) the speed-up keeps growing ({fast[3]:.2f}x, {fast[4]:.2f}x, {fast[5]:.2f}x at K = 3, 4, 5); "
        f"at 3 GB/s (copies staged through host memory) it stops ({slow[3]:.2f}x, {slow[4]:.2f}x) and falls at K = 5 "
        f'({slow[5]:.2f}x) — the "communication-limited beyond 3" of the paper. Which of the two the authors\' '
        "machine had is not stated, so the model brackets it.",
    ]


def render(settings: list[Setting], results: dict[str, Plan], paper: dict[str, Any]) -> str:
    lines = [
        "# Scaling FDG beyond one machine: predictions for K = 2 … 64",
        "",
        *answer(settings, results, paper),
        "## What this page is",
        "",
        "Nothing here can run 64 GPUs, so this page predicts: `python -m fdg_schedule.plan` simulates, event by "
        "event, what every rank of FDG and of four other pipeline schedules does, from per-layer costs and a "
        "cluster, and recommends K, the split and the schedule that fit a memory limit. It is checked against "
        "closed forms and golden timelines (`tests/test_plan_simulate.py`), against runs on this machine, and "
        "against the FDG paper's published speed-ups.",
        "",
        f"Every number and picture on this page is regenerated by `{COMMAND}` (the calibration table by "
        "`python -m benchmarks.throughput.plan_calibration` on idle cores, which measures, then copying its JSON to "
        "`docs/results/scaling/plan_calibration.json`).",
        "",
        "## Using the planner",
        "",
        "```bash",
        "# an estimate from FLOPs for a named GPU, on a named cluster",
        "python -m fdg_schedule.plan --model resnet101 --gpu A100 --micro-batch 32 --cluster a100-100gbe",
        "# a measured layer profile (JSON, format fdg_schedule.profile/1), 2 replicas per stage, 40 GB per device",
        "python -m fdg_schedule.plan --profile profile.json --cluster h100-ib --dp 2 --memory-limit 40GB \\",
        "    --stages 2-16 --micro-batches 8 --json plan.json --plot plan.png",
        "# a traced FDG run (pipeline.fdg.trace): its stages re-timed under the other schedules",
        "python -m fdg_schedule.plan --trace fdg_trace --cluster cpu-gloo --stages 2",
        "# FDG's token overhead r measured on your job (docs/token-overhead.md): rank by time to the same loss",
        "python -m fdg_schedule.plan --model gpt-1.3b --gpu H100 --cluster h100-ib --token-overhead 1.4",
        "```",
        "",
        "```python",
        "from fdg_schedule.plan import CLUSTERS, GPUS, Variant, estimate_resnet, predict",
        "",
        'profile = estimate_resnet("resnet101", 32, GPUS["A100"])',
        'p = predict(profile, Variant("fdg", "current", "recomputed"), stages=8, cluster=CLUSTERS["a100-100gbe"])',
        "print(p.samples_per_s, p.bounds, p.memory_bytes)",
        "```",
        "",
        "Output per (schedule, K): time per micro-batch (FDG's tick), optimizer-step period, samples/s, speed-up "
        "over backprop, samples/s over the fastest fitting synchronous schedule at the same K (per step), the token "
        "overhead r and the net speed-up (per step ÷ r), idle fraction, peak memory per device, point-to-point bytes "
        "per micro-batch (and the part between nodes), all-reduce bytes per rank per micro-batch; then the "
        "recommendation, ranked by time to the same loss ([token-overhead.md](token-overhead.md): where FDG's r is "
        "not measured the pick is marked conditional, with the break-even r). Schedules: FDG in its "
        "four weights/activations modes with `accumulate` 1 and m, DeepSpeed's 1F1B, GPipe, interleaved 1F1B "
        "(Megatron, v = 2 chunks) and ZB-H1.",
        "",
        "## How it predicts",
        "",
        "- **Streams.** Each schedule is a list of actions per rank (forward, backward, input/weight-gradient "
        "halves, sends, receives, all-reduce, step; `fdg_schedule/plan/streams.py`), in the one alphabet of "
        "`fdg_schedule/sched/actions.py`. FDG's is the engine's own schedule (the actions the engine lowers to "
        "its instructions), DeepSpeed 1F1B's the step arithmetic of DeepSpeed's `TrainSchedule` restated "
        "torch-free (tested against DeepSpeed's generator); GPipe (Huang et al. 2019), interleaved 1F1B "
        "(Narayanan et al. 2021) and ZB-H1 (Qi et al. 2024) are their published orderings.",
        "- **Simulator.** Every rank runs its list in order; among all ranks the action that can start earliest "
        "runs next (`simulate.py`). A message holds its sender's link for bytes / bandwidth and arrives a latency "
        "later; links between nodes are shared by the replicas that use them at once. FDG sends each message right "
        "after the compute that made it (Note [each message when it exists] in fdg_schedule/exchange/comm.py), so a "
        "transfer overlaps whatever the receiver does before it needs it; "
        "DeepSpeed's 1F1B sends are blocking (a rendezvous, as `p2p.send` is); GPipe, interleaved and ZB-H1 send "
        "without blocking. Flushing schedules end every batch with an all-reduce, a step and a cross-stage "
        "collective; FDG is timed in steady state over whole accumulation periods.",
        "- **Split.** A dynamic program picks the contiguous cut whose slowest stage (compute, plus its output's "
        "transfer when it leaves the node) is fastest, among the cuts whose stages fit the memory limit with the "
        "schedule's own count of micro-batches in flight (FDG stage k: 2(K-1-k); 1F1B: min(K-k, m); GPipe: m).",
        "- **Memory** per device = weights, gradients and optimizer state + the peak of what the simulated ranks "
        "hold, with I a stage's input, A what autograd saves and W its weights per micro-batch in flight: FDG "
        "stored d·(I+A), stashed d·(I+A+W), recomputed d·I (+ d·W stashed) plus one A during a backward; 1F1B, "
        "GPipe and ZB-H1 n·(I+A) (`fdg_schedule/partitioning/stage_memory.py`, the model the partitioner "
        "shares, checked against engines' `held_bytes()` and the simulator).",
        "",
        "### Assumptions",
        "",
        *assumptions(),
        "",
        "## Validation",
        "",
        "### On this machine: K = 2, measured",
        "",
        "`benchmarks/throughput/plan_calibration.py` times every layer alone, fits the three constants below on runs "
        "it does "
        "not validate against, predicts FDG and DeepSpeed 1F1B (GAS 4) at K = 2, and measures them with "
        "`benchmarks/throughput/throughput.py`'s interleaved rounds on the planner's own splits. Constants: the link "
        "(ping-pong between two gloo ranks), the framework's time per forward/backward and per FDG tick "
        "(from a tiny transformer where they dominate), and per model the in-situ factor (layers chained in one "
        "backprop step run slower than alone, fitted on that model's BP row).",
        "",
        *calibration_section(),
        "",
        "### Against the FDG paper",
        "",
        "The authors' code drives all GPUs from one Python process, one thread per stage; after every tick the "
        "threads join and the main thread copies each activation and gradient to its neighbour, one after "
        'another. The planner\'s `Variant("fdg", threads=True)` models exactly that (a shared host thread, a '
        "join, serial copies over PCIe 3.0), calibrated only on the BP column of the authors' Table 6 (time per "
        "epoch and GPU utilisation: the first sets each model's FLOP efficiency, ResNet-56's sets the host time "
        f"per layer, {paper['host_s_per_layer'] * 1e3:.2f} ms per pass). The FDG columns are predicted, with the "
        "paper's own splits (`fdg_schedule.zoo.resnet.paper_split`).",
        "",
        *paper_section(paper),
        "",
        *paper_reading(paper),
        "",
        "## The settings",
        "",
        "Each setting plans K up to the layer count (every stage needs a layer; interleaving needs 2K). Flushing "
        "schedules run m = 4K micro-batches per batch (m = K in the last two settings: few micro-batches, a memory- "
        "or batch-limited job); FDG's `acc=m` steps as often as they do. ✗ marks a "
        "configuration no split fits into the device memory.",
        "",
    ]
    for setting in settings:
        lines += setting_section(setting, results[setting.key])
        lines += ["Reading it:", "", *reading(results[setting.key]), ""]
    lines += [
        "## Where FDG wins and where it loses",
        "",
        *summary(settings, results),
        "",
        "(Why: see the answer at the top.)",
        "",
    ]
    lines += [
        "## What the model leaves out",
        "",
        "- Kernel-level overlap of communication with compute inside a stage (NCCL streams), and contention "
        "between the pipeline's messages and the data-parallel all-reduce.",
        "- Stragglers, jitter and the per-tick cost of DeepSpeed's Python dispatch on GPUs (calibrated only on "
        "this CPU machine: a fraction of a millisecond per instruction, negligible against GPU-sized stages).",
        "- Convergence, except through the token overhead r: FDG's delayed gradients and 1F1B's large batches do "
        "not learn at the same rate per sample (docs/results/convergence/convergence.md). The ranking divides "
        "samples/s by r where it is measured ([token-overhead.md](token-overhead.md)); where it is not, the "
        "columns are samples per second only and the pick says it is conditional.",
        "- Interleaved 1F1B's split balances time (and the transfers between nodes) but not memory: what a chunk "
        "holds depends on the interleaving and is known only from the simulation, which then marks the split ✗ "
        "if it exceeds the limit. For that schedule ✗ means the split balanced for speed does not fit, not that "
        "no split would.",
        "- FLOP estimates are rooflines at a fixed efficiency; a layer profile measured on the target device "
        "(`--profile`) replaces them and is the planner's intended input.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
