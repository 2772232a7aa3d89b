"""Throughput and memory of FDG against plain backprop and DeepSpeed's 1F1B, side by side, on this machine.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.throughput                  # ResNet-32 and a small transformer (10-20 min)
    python -m benchmarks.throughput.throughput --quick          # tiny models, no RSS runs: a smoke run (< 1 min idle)
    python -m benchmarks.throughput.throughput --repeats 0 --rss 2,3,4   # memory by K only (fresh processes)
    python -m benchmarks.throughput.throughput --models plainconv --fdg-gas 1,4,16 --window 32 --repeats 7 --rss '' \
        --variants 1f1b_m4,halves,fdg_current_stored_g1,fdg_current_stored_g4,fdg_current_stored_g16,\
fdg_current_stored_shm_g1,fdg_current_stored_shm_g4,fdg_current_stored_shm_g16
                                                                    # FDG by calls and transport (issue 62)
    python -m benchmarks.throughput.throughput --models ttl_lm --optimizer muon ...
                                                                    # every variant steps Muon (issue 63)

Throughput: one process tree of K = 2 gloo ranks (one thread each) builds every variant of a model
once, warms each up, then runs them interleaved for ``--repeats`` rounds (the order rotates every
round, so drift on this shared machine falls on all variants alike):

    bp                  plain backprop on rank 0 (an nn.Sequential of the same layers), one step per micro-batch
    1f1b_m{2,4,8}       DeepSpeed's own PipelineEngine, K = 2, GAS = m, one step per m micro-batches
    fdg_{w}_{a}         FDG, K = 2, every weights/activations mode, one step per stage per tick, over the process
                        group; with several --fdg-gas values each is run once per value, fdg_{w}_{a}_g{GAS}
    dp2                 DeepSpeed data parallelism (a one-stage pipeline on 2 ranks), one step per micro-batch
    fdg_stashed_stored_{delay_lr,predict,both}
                        the staleness corrections (docs/staleness.md) on FDG stashed/stored, only when named in
                        --variants: what each costs next to fdg_stashed_stored
    fdg_current_{stored,recomputed}_shm
                        FDG with pipeline.fdg.transport "shm" (the neighbours' messages through shared memory,
                        not gloo), only when named in --variants
    halves, halves_recomputed
                        the machine's ceiling, only when named: FDG's stages in plain torch, one per rank, both at
                        once, in FDG's stored (recomputed) order on its stored (recomputed) split; every FDG
                        variant is reported against halves, a recomputed one against halves_recomputed too

Optimizer (``--optimizer``, the same for every variant and for the layer profile that balances the splits):
``sgd`` (the default: SGD with momentum, lr 0.01, no clipping), or ``adamw`` / ``muon`` as the time-to-loss runs
build them (benchmarks/common/optimizers.py: AdamW lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1;
DeepSpeed's Muon, ``{"type": "Muon"}`` for the DeepSpeed engines; both clip at 1.0). FDG steps each stage every
micro-batch and 1F1B m = 4 every fourth, so a ratio holds only for the optimizer it was measured with; the
report records it. ``python -m benchmarks.throughput.ttl_ratios`` turns such runs into the time-to-loss
analysis' ratio file.

Every round gives each variant the same number of micro-batches of the same size. Inputs are
synthetic, fixed tensors (data loading is excluded). Wall time is taken from the outside (the slowest
rank, after a barrier); per-stage compute comes from FDG's own ``fdg_stats`` and, for DeepSpeed's
engines, from timers wrapped around their instruction handlers on the instance. FDG is measured in
steady state: its pipeline fills during warm-up and never flushes.

Memory: after the timed rounds every variant trains a few more micro-batches while the bytes it holds
for backward are counted (``engine.held_bytes()`` for FDG, live autograd-saved activations for BP,
1F1B and DP). With ``--rss K,...`` every variant also runs alone in a fresh process tree per K (so
peak RSS belongs to it): RSS after building and peak RSS while training, per stage.

Output: ``<out>/throughput.json`` and ``<out>/throughput.md`` (tables) and the command that made them.

Splits: the library profiles the model's layers on this machine (one thread, the benchmark's
optimizer; :func:`fdg_schedule.partitioning.profile.profile_layers`) and balances each pipeline variant for its
own schedule and modes (:func:`fdg_schedule.partitioning.partition.balanced_partition`); the ``*_by_params``
variants run DeepSpeed's default "parameters" split of the same model, side by side. The report keeps
the profile and each split's predicted per-stage time next to the measured one.

The benchmark's parts: ``bench_models.py`` (models), ``throughput_variants.py`` (variants),
``throughput_measure.py`` (the rank side: timing windows and
memory), ``throughput_report.py`` (summary and Markdown); this file runs them and writes the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, before torch is imported

import torch  # noqa: E402

from benchmarks.common import optimizers  # noqa: E402
from benchmarks.common.bench_models import MODELS  # noqa: E402
from benchmarks.common.layer_profile import model_profile  # noqa: E402
from benchmarks.common.provenance import engine_version  # noqa: E402
from benchmarks.common.throughput_report import markdown, summarize  # noqa: E402
from benchmarks.common.throughput_variants import STAGES, split_key, split_objective, variants  # noqa: E402
from benchmarks.throughput.throughput_measure import memory_worker, throughput_worker  # noqa: E402
from fdg_schedule.base import host_memory  # noqa: E402
from fdg_schedule.partitioning.partition import balanced_partition, evaluate_partition, parameter_split  # noqa: E402
from fdg_schedule.partitioning.profile import ModelProfile  # noqa: E402
from fdg_schedule.tools.launch import run  # noqa: E402


def model_splits(profile: ModelProfile, specs: list[dict[str, Any]], stage_counts: set[int]) -> dict[str, Any]:
    """Per split key (``throughput_variants.split_key``): its boundaries and predicted stage times."""
    keys = {split_key(dict(s, stages=k)) for s in specs if s["kind"] in ("fdg", "1f1b", "halves") for k in stage_counts}
    out = {}
    for key in sorted(keys):
        stages, objective = int(re.match(r"\d+", key).group()), split_objective(key)  # type: ignore[union-attr]
        if key.endswith("p"):
            parts = parameter_split(profile, stages)
            assert parts is not None, "the model has no trainable parameters to split by"
            plan = evaluate_partition(profile, parts, objective)
        else:
            plan = balanced_partition(profile, stages, objective)
        out[key] = {
            "parts": plan.parts,
            "predicted_s": [s.time_s for s in plan.stages],
            "for": plan.objective.describe(),
        }
    return out


def measure_memory(plan: dict[str, Any], specs: list[dict[str, Any]], deadline_s: float) -> dict[str, list[dict]]:
    """Each variant alone in a fresh process tree; per stage (stage order) its memory record."""
    out = {}
    for spec in specs:
        records = run(memory_worker, spec["ranks"], plan, spec, deadline_s=deadline_s)
        used = [r for r in records if r["stage_id"] is not None]
        out[spec["name"]] = sorted(used, key=lambda r: (r["stage_id"], r["rank"]))
        print(f"  memory {spec['name']} K={spec['stages']}: done", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds, no RSS runs: a smoke run")
    parser.add_argument("--models", default=None, help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (0: memory runs only)")
    parser.add_argument("--window", type=int, default=None, help="micro-batches per variant per round")
    parser.add_argument("--warmup", type=int, default=None, help="micro-batches per variant before timing")
    parser.add_argument(
        "--fdg-gas",
        default=None,
        help="FDG ticks per train_batch() call, or several comma-separated (e.g. 1,4,16: each FDG variant once per "
        "value, named fdg_..._g<N>; give a --window every value divides, so each times the same micro-batches)",
    )
    parser.add_argument("--rss", default=None, help="K values for fresh-process memory runs, e.g. 2 or 2,3,4 ('' none)")
    parser.add_argument("--memory-micro-batches", type=int, default=8, help="micro-batches per memory count")
    parser.add_argument("--variants", default=None, help="comma-separated subset of variant names")
    parser.add_argument(
        "--parts",
        default="",
        help="fixed splits, e.g. 'resnet32:2=0,6,18;resnet32:2r=0,5,18' (keys: throughput_variants.split_key)",
    )
    parser.add_argument(
        "--freed-memory",
        choices=("retain", "system"),
        default="retain",
        help="retain: every process keeps freed memory (fdg_schedule.base.host_memory); system: glibc's default",
    )
    parser.add_argument(
        "--bind-cores",
        action="store_true",
        help="pin rank r (all its threads) to core r, as deepspeed --bind_cores_to_rank",
    )
    parser.add_argument(
        "--optimizer",
        default="sgd",
        help="the optimizer every variant steps, and the layer profile times: sgd (SGD with momentum, no clipping), "
        "adamw or muon (as the time-to-loss runs build them, clipping 1.0; benchmarks/common/optimizers.py)",
    )
    parser.add_argument("--engine-note", default="", help="text recorded next to the engine version")
    parser.add_argument(
        "--render",
        metavar="JSON",
        default=None,
        help="no run: summarize an earlier run's raw windows again with this checkout's report code",
    )
    parser.add_argument("--out", default=str(ROOT / "out" / "throughput"))
    parser.add_argument("--deadline", type=float, default=3600, help="seconds per process tree")
    args = parser.parse_args(argv)
    # A SIGTERM becomes SystemExit, so the launcher's cleanup kills the ranks instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.render:
        return render(Path(args.render))
    try:
        optimizer = optimizers.check(args.optimizer)
    except ValueError as error:
        parser.error(str(error))
    quick = args.quick
    models = (args.models or ("resnet8_tiny,transformer_tiny" if quick else "resnet32,transformer")).split(",")
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    window = args.window or (8 if quick else 16)
    warmup = args.warmup or (4 if quick else 8)
    gases = [int(g) for g in args.fdg_gas.split(",")] if args.fdg_gas else [4 if quick else 8]
    fdg_gas: int | list[int] = gases[0] if len(gases) == 1 else gases
    if any(window % g for g in gases):
        parser.error(f"--window {window} is not a multiple of every --fdg-gas {gases}: the variants would time "
                     "different micro-batches")  # fmt: skip
    rss_stages = [int(k) for k in (args.rss if args.rss is not None else ("" if quick else "2")).split(",") if k]
    specs = variants(fdg_gas)
    if args.variants:
        unknown = sorted(set(args.variants.split(",")) - {s["name"] for s in specs})
        if unknown:  # a misspelt name would silently drop its variant from the run
            parser.error(f"--variants names {unknown}, which this run does not have (with --fdg-gas {args.fdg_gas}): "
                         f"choose from {[s['name'] for s in specs]}")  # fmt: skip
        specs = [s for s in specs if s["name"] in args.variants.split(",")]
    else:  # the staleness corrections' variants run when named
        specs = [s for s in specs if not s.get("optional")]
    command = f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} OMP_NUM_THREADS=1 python -m " + shlex.join(
        ["benchmarks.throughput.throughput", *(sys.argv[1:] if argv is None else argv)]
    )  # quoted: an empty --rss '' stays in the command
    print(f"command: {command}", flush=True)
    if args.freed_memory == "retain":  # before the profile: its layer times then exclude the page faults too
        host_memory.retain_freed_memory()
    started = time.monotonic()
    report: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}",
        "engine": " ".join(filter(None, [engine_version(), args.engine_note])),
        "load_start": os.getloadavg(),
        "repeats": repeats,
        "window": window,
        "warmup": warmup,
        "fdg_gas": fdg_gas,
        "optimizer": optimizer,
        "optimizer_settings": optimizers.settings(optimizer),
        "host_memory": host_memory.describe(),
        "bind_cores": args.bind_cores,
        "data": "synthetic fixed tensors, cycled (data loading excluded)",
        "models": {},
        "memory_by_stages": {},
    }
    for model in models:
        profile = model_profile(model, optimizer)
        predicted = model_splits(profile, specs, {STAGES, *rss_stages})
        splits = {key: split["parts"] for key, split in predicted.items()}
        for item in filter(None, args.parts.split(";")):  # "[model:]key=bounds"
            key, bounds = item.split("=")
            only, _, key = key.rpartition(":")
            if only in ("", model):
                splits[key] = [int(b) for b in bounds.split(",")]
                given = evaluate_partition(profile, splits[key], split_objective(key))
                predicted[key] = {
                    "parts": given.parts,
                    "predicted_s": [s.time_s for s in given.stages],
                    "for": "--parts",
                }
        plan = dict(
            model=model,
            splits=splits,
            predicted=predicted,
            variants=specs,
            repeats=repeats,
            window=window,
            warmup=warmup,
            memory_micro_batches=args.memory_micro_batches,
            host_memory=args.freed_memory,
            bind_cores=args.bind_cores,
            optimizer=optimizer,
        )
        costs_ms = [round((c.forward_s + c.backward_s) * 1e3, 2) for c in profile.layers]
        print(f"{model}: layer forward+backward {costs_ms} ms, splits {splits}", flush=True)
        ranks: list[dict[str, Any]] = []
        if repeats:
            ranks = run(throughput_worker, STAGES, plan, deadline_s=args.deadline)
        by_stages = {}
        for k in rss_stages:
            pipes = (
                specs if k == STAGES else [dict(s, stages=k, ranks=k) for s in specs if s["kind"] in ("fdg", "1f1b")]
            )
            by_stages[str(k)] = measure_memory(plan, pipes, args.deadline)
        if ranks:
            report["models"][model] = {
                "profile": profile.to_dict(),
                "splits": splits,
                "predicted": predicted,
                "variants": summarize(plan, ranks, by_stages.get(str(STAGES), {})),
                "raw": ranks,
            }
        if by_stages:
            report["memory_by_stages"][model] = by_stages
        print(f"{model} done after {time.monotonic() - started:.0f} s", flush=True)
    report["load_end"] = os.getloadavg()
    report["seconds"] = time.monotonic() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(report, indent=1))
    (out / "throughput.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    print(f"wrote {out / 'throughput.json'} and {out / 'throughput.md'}", flush=True)
    return report


def render(path: Path) -> dict[str, Any]:
    """An earlier run's report, summarized again from its raw windows by this checkout's report code.

    Rewrites ``throughput.json`` (every raw window kept) and ``throughput.md`` in place; the report
    records which code summarized it. Fresh-process memory is kept as that run measured it.
    """
    report = json.loads(path.read_text())
    for model, result in report["models"].items():
        names = set(result["variants"])
        plan = {
            "model": model,
            "splits": result["splits"],
            "predicted": result["predicted"],
            "variants": [s for s in variants(report["fdg_gas"]) if s["name"] in names],
        }
        memory = {name: row["memory"] for name, row in result["variants"].items()}
        result["variants"] = summarize(plan, result["raw"], memory)
    report["summarized_by"] = engine_version()
    path.write_text(json.dumps(report, indent=1))
    (path.parent / "throughput.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return report


if __name__ == "__main__":
    main()
