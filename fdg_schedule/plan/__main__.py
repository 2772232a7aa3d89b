"""``python -m fdg_schedule.plan``: predict every schedule at K = 2 ... 64 for a model on a cluster and recommend one.

    # a FLOP estimate for a named GPU, on a named cluster
    python -m fdg_schedule.plan --model resnet101 --gpu A100 --micro-batch 32 --cluster a100-100gbe
    # a measured profile (fdg_schedule.partitioning.profile JSON), two replicas per stage, 40 GB per device
    python -m fdg_schedule.plan --profile profile.json --cluster h100-ib --dp 2 --memory-limit 40GB
    # a traced FDG run: its stages re-timed under the other schedules
    python -m fdg_schedule.plan --trace fdg_trace --cluster cpu-gloo --stages 2

    # FDG's token overhead r measured on your job (python -m fdg_schedule.plan.token_overhead): rank by time to loss
    python -m fdg_schedule.plan --model gpt-1.3b --gpu H100 --cluster h100-ib --token-overhead 1.4

Prints a Markdown table (time per micro-batch, step, samples/s, speed-up over backprop, per step over the
fastest synchronous schedule, the token overhead r and the net speed-up, idle fraction, peak memory, traffic)
and the recommendation, ranked by time to the same loss (docs/token-overhead.md); ``--json`` and ``--plot``
save them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from fdg_schedule.plan import costs
from fdg_schedule.plan.cluster import CLUSTERS, Cluster, parse_bandwidth, parse_size, parse_time
from fdg_schedule.plan.flops import GPUS, TRANSFORMERS, Efficiency, estimate_resnet, estimate_transformer, gpu_named
from fdg_schedule.plan.overheads import Overheads, parse_token_overhead
from fdg_schedule.plan.predict import SCHEDULES, CostModel, Variant
from fdg_schedule.plan.recommend import OBJECTIVES, plan, plot, table
from fdg_schedule.zoo.resnet_shapes import NAMES as RESNETS  # torch-free; estimate_resnet imports the zoo

DEFAULT_STAGES = "2,3,4,6,8,12,16,24,32,48,64"
FDG_MODES = ("current/stored", "current/recomputed", "stashed/stored", "stashed/recomputed")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fdg_schedule.plan", description=(__doc__ or "").split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    src = p.add_argument_group("model (one of --profile, --trace, --model)")
    src.add_argument("--profile", help="per-layer profile JSON (fdg_schedule.partitioning.profile format)")
    src.add_argument("--trace", help="merged trace.json or trace directory of a pipeline.fdg.trace run")
    src.add_argument("--model", help=f"estimate from FLOPs: {', '.join(RESNETS + tuple(TRANSFORMERS))}")
    src.add_argument("--gpu", help=f"with --model: {', '.join(GPUS)}")
    src.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    src.add_argument("--micro-batch", type=int, default=None, help="with --model: samples per micro-batch")
    src.add_argument("--image", type=int, default=None, help="with a ResNet: image side (default 32 CIFAR, 224)")
    src.add_argument("--efficiency", type=float, default=Efficiency.compute, help="fraction of peak FLOP/s reached")
    src.add_argument("--memory-efficiency", type=float, default=Efficiency.memory, help="fraction of memory bandwidth")
    src.add_argument("--activation-bytes", default="", help="with --trace: each stage's output bytes, comma-separated")
    src.add_argument("--save-profile", help="write the profile used (e.g. the estimate) to this JSON")
    net = p.add_argument_group("cluster (a preset, and overrides)")
    net.add_argument("--cluster", default="h100-ib", help=f"preset: {', '.join(CLUSTERS)}")
    net.add_argument("--gpus-per-node", type=int, default=None)
    net.add_argument("--intra-bandwidth", default=None, help="per device inside a node, e.g. 300GB/s")
    net.add_argument("--intra-latency", default=None, help="e.g. 5us")
    net.add_argument("--inter-bandwidth", default=None, help="per node to other nodes, e.g. 100Gb/s")
    net.add_argument("--inter-latency", default=None, help="e.g. 10us")
    job = p.add_argument_group("job")
    job.add_argument("--stages", default=DEFAULT_STAGES, help="K values: 2,4,8 or 2-64 (default: %(default)s)")
    job.add_argument("--dp", type=int, default=1, help="data-parallel replicas of every stage")
    job.add_argument("--gpus", type=int, default=None, help="device budget: only K with K x dp <= this")
    job.add_argument("--memory-limit", default=None, help="per device, e.g. 80GB (default: the cluster's device)")
    job.add_argument("--micro-batches", default="4K", help="per batch for 1F1B/GPipe/ZB: an integer or nK (n x K)")
    job.add_argument("--schedules", default=",".join(SCHEDULES), help="from " + ", ".join(SCHEDULES))
    job.add_argument("--fdg-modes", default=",".join(FDG_MODES), help="weights/activations pairs to plan")
    job.add_argument("--fdg-accumulate", default="1,m", help="FDG accumulate values: integers, m = --micro-batches")
    job.add_argument("--chunks", type=int, default=2, help="interleaved 1F1B: model chunks per device")
    job.add_argument("--bytes-per-param", type=float, default=CostModel.bytes_per_param,
                     help="weights + gradients + optimizer state per parameter")  # fmt: skip
    job.add_argument(
        "--copy-bandwidth",
        default=None,
        help="device memory bandwidth for FDG's stashed weight copies (default: the --gpu's, or 1TB/s)",
    )
    job.add_argument("--objective", default="throughput", choices=OBJECTIVES)
    loss = p.add_argument_group("time to loss (FDG's token overhead r; docs/token-overhead.md)")
    loss.add_argument(
        "--token-overhead",
        default=None,
        help="r for FDG: a number (e.g. 1.4) or the JSON of python -m fdg_schedule.plan.token_overhead --json "
        "(default: the shipped measurements for the setting below, else unknown)",
    )
    loss.add_argument(
        "--family",
        default=None,
        help="model family of the shipped measurements (default: --model's: gpt, llama, resnet)",
    )
    loss.add_argument(
        "--optimizer", default="adamw", help="of the shipped measurements (default: %(default)s, the cost model's Adam)"
    )
    loss.add_argument(
        "--corrections",
        default="auto",
        help="FDG's corrections, for the shipped measurements: auto (rule v2), auto-v1, auto-v2, none, or the keys "
        "joined by + (default: %(default)s, docs/staleness.md's recommendation)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", help="write every prediction and the recommendation to this JSON")
    out.add_argument("--plot", help="draw throughput and memory against K to this PNG")
    return p


class UsageError(ValueError):
    pass


def parse_stages(text: str) -> list[int]:
    try:
        values: list[int] = []
        for part in text.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-"))
                values += range(lo, hi + 1)
            else:
                values.append(int(part))
    except ValueError:
        raise UsageError(f"--stages {text!r} is not a list of integers; write e.g. 2,4,8 or 2-64") from None
    bad = [k for k in values if k < 2]
    if bad:
        raise UsageError(f"--stages must be integers >= 2 (K = 1 is backprop, always reported), got {bad}")
    return sorted(set(values))


def parse_micro_batches(text: str) -> Callable[[int], int]:
    try:
        if text.endswith("K"):
            factor = int(text[:-1] or 1)
            if factor >= 1:
                return lambda k: factor * k
        elif int(text) >= 1:
            fixed = int(text)
            return lambda k: fixed
    except ValueError:
        pass
    raise UsageError(f"--micro-batches {text!r} must be an integer >= 1 or nK (n x K), e.g. 8 or 4K")


def variants(args: argparse.Namespace) -> list[Variant]:
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise UsageError(f"--schedules: unknown {unknown}; known: {list(SCHEDULES)}")
    out: list[Variant] = []
    if "fdg" in schedules:
        modes = [m for m in args.fdg_modes.split(",") if m]
        bad = [m for m in modes if m not in FDG_MODES]
        if bad:
            raise UsageError(f"--fdg-modes: unknown {bad}; known: {list(FDG_MODES)}")
        accumulate: list[int | None] = []
        for a in args.fdg_accumulate.split(","):
            if a == "m":
                accumulate.append(None)
            elif a.isdigit() and int(a) >= 1:
                accumulate.append(int(a))
            else:
                raise UsageError(f"--fdg-accumulate {a!r} must be an integer >= 1 or m")
        for a in accumulate:
            for mode in modes:
                weights, activations = mode.split("/")
                out.append(Variant("fdg", weights, activations, accumulate=a))
    if args.chunks < 1:
        raise UsageError(f"--chunks must be >= 1, got {args.chunks}")
    out += [Variant(s, chunks=args.chunks) for s in schedules if s != "fdg"]
    return out


def cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster not in CLUSTERS:
        raise UsageError(f"--cluster {args.cluster!r} is not a preset; known: {sorted(CLUSTERS)} (override "
                         "fields with --gpus-per-node, --intra-bandwidth, ...)")  # fmt: skip
    base = CLUSTERS[args.cluster]
    changes: dict[str, object] = {}
    if args.gpus_per_node is not None:
        changes["gpus_per_node"] = args.gpus_per_node
    for flag, field, parse in (
        ("intra_bandwidth", "intra_bandwidth", parse_bandwidth),
        ("inter_bandwidth", "inter_bandwidth", parse_bandwidth),
        ("intra_latency", "intra_latency", parse_time),
        ("inter_latency", "inter_latency", parse_time),
    ):
        value = getattr(args, flag)
        if value is not None:
            changes[field] = parse(value, "--" + flag.replace("_", "-"))
    if changes:
        changes["name"] = f"{base.name} (modified)"
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def model_profile(args: argparse.Namespace) -> costs.ModelProfile:
    given = [flag for flag in ("profile", "trace", "model") if getattr(args, flag)]
    if len(given) != 1:
        raise UsageError(f"give exactly one of --profile, --trace, --model (got {['--' + g for g in given] or 'none'})")
    if args.profile:
        return costs.load_profile(args.profile)
    if args.trace:
        from fdg_schedule.observability import timeline

        sizes = [parse_size(s, "--activation-bytes") for s in args.activation_bytes.split(",") if s]
        trace = timeline.load(args.trace)
        return costs.profile_from_trace(trace, activation_bytes=sizes, source=str(args.trace))
    if not args.gpu:
        raise UsageError(f"--model {args.model} needs --gpu (one of {sorted(GPUS)}) to turn FLOPs into seconds")
    gpu = gpu_named(args.gpu)
    if not 0 < args.efficiency <= 1 or not 0 < args.memory_efficiency <= 1:
        raise UsageError(f"--efficiency and --memory-efficiency must be in (0, 1], got {args.efficiency} and "
                         f"{args.memory_efficiency}")  # fmt: skip
    eff = Efficiency(compute=args.efficiency, memory=args.memory_efficiency)
    if args.model in RESNETS:
        return estimate_resnet(args.model, args.micro_batch or 32, gpu, args.dtype, args.image, eff)
    if args.model in TRANSFORMERS:
        return estimate_transformer(TRANSFORMERS[args.model], args.micro_batch or 1, gpu, args.dtype, eff)
    raise UsageError(f"--model {args.model!r} is unknown; known: {', '.join(RESNETS + tuple(TRANSFORMERS))} "
                     "(or measure it and pass --profile)")  # fmt: skip


def overheads(args: argparse.Namespace) -> Overheads:
    """Where FDG's r comes from: ``--token-overhead``, else the shipped table for the named setting."""
    value, recorded = (None, None) if args.token_overhead is None else parse_token_overhead(args.token_overhead)
    family = args.family
    if family is None and args.model:
        family = "resnet" if args.model in RESNETS or args.model.startswith("wrn") else args.model.split("-")[0]
    return Overheads(value, recorded, family, args.optimizer, args.corrections)


def copy_bandwidth(args: argparse.Namespace, profile: costs.ModelProfile) -> float:
    """``--copy-bandwidth``, else the estimated GPU's memory bandwidth at its efficiency, else the default."""
    if args.copy_bandwidth is not None:
        return parse_bandwidth(args.copy_bandwidth, "--copy-bandwidth")
    gpu, eff = profile.meta.get("gpu"), profile.meta.get("efficiency")
    if gpu and eff:
        return float(gpu["memory_bandwidth"]) * float(eff["memory"])
    return CostModel.copy_bandwidth


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        if args.dp < 1:
            raise UsageError(f"--dp must be >= 1, got {args.dp}")
        if args.micro_batch is not None and args.micro_batch < 1:
            raise UsageError(f"--micro-batch must be >= 1, got {args.micro_batch}")
        stages = parse_stages(args.stages)
        micro_batches = parse_micro_batches(args.micro_batches)
        chosen = variants(args)
        net = cluster(args)
        limit = None if args.memory_limit is None else parse_size(args.memory_limit, "--memory-limit")
        profile = model_profile(args)
        sources = overheads(args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        p.error(str(error))
    if args.save_profile:
        Path(args.save_profile).write_text(json.dumps(costs.profile_to_dict(profile), indent=1))
    if args.trace and max(stages) > len(profile.layers):
        stages = [k for k in stages if k <= len(profile.layers)]
        print(f"a trace gives one layer per traced stage: planning K in {stages} only", file=sys.stderr)
    try:
        model = CostModel(bytes_per_param=args.bytes_per_param, copy_bandwidth=copy_bandwidth(args, profile))
    except ValueError as error:
        p.error(str(error))
    result = plan(
        profile, net, stages, chosen, args.dp, micro_batches, limit, model, args.gpus, args.objective, sources
    )
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
