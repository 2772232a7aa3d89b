"""Throughput and memory of FDG against plain backprop and DeepSpeed's 1F1B, side by side, on this machine.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python benchmarks/throughput.py                  # ResNet-32 and a small transformer (10-20 min)
    python benchmarks/throughput.py --quick          # tiny models, no RSS runs: a smoke run (< 1 min idle)
    python benchmarks/throughput.py --repeats 0 --rss 2,3,4   # memory by K only (fresh processes)

Throughput: one process tree of K = 2 gloo ranks (one thread each) builds every variant of a model
once, warms each up, then runs them interleaved for ``--repeats`` rounds (the order rotates every
round, so drift on this shared machine falls on all variants alike):

    bp                  plain backprop on rank 0 (an nn.Sequential of the same layers), one step per micro-batch
    1f1b_m{2,4,8}       DeepSpeed's own PipelineEngine, K = 2, GAS = m, one step per m micro-batches
    fdg_{w}_{a}         FDG, K = 2, every weights/activations mode, one step per stage per tick
    dp2                 DeepSpeed data parallelism (a one-stage pipeline on 2 ranks), one step per micro-batch

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
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import os
import platform
import queue
import resource
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the package is in the repository root
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, before torch is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

STAGES = 2  # this machine has 2 cores: one per stage
MODES = [("current", "stored"), ("current", "recomputed"), ("stashed", "stored"), ("stashed", "recomputed")]
GAS_1F1B = (2, 4, 8)
LR, MOMENTUM, GRAD_SHRINK = 0.01, 0.9, 0.5
COMPUTE_KINDS = ("forward_s", "backward_s", "step_s", "reduce_s")

# model name -> size settings; "tiny" ones are for --quick and the smoke test
MODELS: dict[str, dict[str, Any]] = {
    "resnet32": dict(kind="resnet", depth=32, micro=32, image=32),
    "transformer": dict(kind="transformer", blocks=4, width=256, heads=4, seq=64, micro=16),
    "resnet8_tiny": dict(kind="resnet", depth=8, micro=8, image=16),
    "transformer_tiny": dict(kind="transformer", blocks=2, width=64, heads=4, seq=16, micro=8),
}
CLASSES = 10


# ---------------------------------------------------------------------------------------------------
# Models: flat layer lists that PipelineModule can cut anywhere


class MeanPoolHead(nn.Module):
    """LayerNorm, mean over the sequence, linear classifier: (batch, seq, width) -> (batch, classes)."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


def model_layers(model: str) -> list[Any]:
    """The LayerSpecs of ``model`` (same list for every variant)."""
    from deepspeed.pipe import LayerSpec

    from fdg_schedule.zoo.resnet import cifar_resnet_layers

    cfg = MODELS[model]
    if cfg["kind"] == "resnet":
        return cifar_resnet_layers(cfg["depth"], CLASSES, 3)
    width = cfg["width"]
    block = [
        LayerSpec(nn.TransformerEncoderLayer, width, cfg["heads"], 4 * width, 0.0, batch_first=True, norm_first=True)
        for _ in range(cfg["blocks"])
    ]
    return [*block, LayerSpec(MeanPoolHead, width, CLASSES)]


def fixed_data(model: str, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed synthetic micro-batches, cycled through (no data loading in the timings)."""
    cfg = MODELS[model]
    g = torch.Generator().manual_seed(0)
    if cfg["kind"] == "resnet":
        shape: tuple[int, ...] = (cfg["micro"], 3, cfg["image"], cfg["image"])
    else:
        shape = (cfg["micro"], cfg["seq"], cfg["width"])
    return [
        (torch.randn(shape, generator=g), torch.randint(0, CLASSES, (cfg["micro"],), generator=g)) for _ in range(count)
    ]


def layer_costs(model: str, repeats: int = 5) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each layer alone (best of ``repeats``), in one thread."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [spec.build() for spec in model_layers(model)]
    h = fixed_data(model, 1)[0][0]
    forward, backward = [], []
    for layer in layers:
        x = h.detach().requires_grad_(True)
        best_f = best_b = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = layer(x)
            t1 = time.perf_counter()
            out.sum().backward()
            t2 = time.perf_counter()
            best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
        forward.append(best_f)
        backward.append(best_b)
        h = out.detach()
    return forward, backward


def balanced_split(forward: list[float], backward: list[float], stages: int, recompute: bool = False) -> list[int]:
    """Stage boundaries that minimise the slowest stage's measured work per micro-batch.

    A stage's work is its layers' forward + backward; with ``recompute`` every stage but the last
    runs its forward twice (FDG ``activations="recomputed"``), which moves the best cut towards stage 0.
    """
    n = len(forward)

    def cost(a: int, b: int, last: bool) -> float:
        return sum(forward[a:b]) * (1 if last or not recompute else 2) + sum(backward[a:b])

    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        worst = max(cost(bounds[i], bounds[i + 1], i == stages - 1) for i in range(stages))
        if best is None or worst < best[0]:
            best = (worst, bounds)
    assert best is not None, f"cannot cut {n} layers into {stages} stages"
    return best[1]


def split_key(spec: dict[str, Any]) -> str:
    """Which split a variant uses: ``"<K>"``, or ``"<K>r"`` for FDG's recomputed modes."""
    return f"{spec['stages']}{'r' if spec.get('activations') == 'recomputed' else ''}"


# ---------------------------------------------------------------------------------------------------
# Variants


def variants(gas_fdg: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [dict(name="bp", kind="bp", stages=1, ranks=1, per_unit=1)]
    out += [dict(name=f"1f1b_m{m}", kind="1f1b", stages=STAGES, ranks=STAGES, gas=m, per_unit=m) for m in GAS_1F1B]
    out += [
        dict(name=f"fdg_{w}_{a}", kind="fdg", stages=STAGES, ranks=STAGES, gas=gas_fdg, per_unit=gas_fdg, weights=w,
             activations=a)
        for w, a in MODES
    ]  # fmt: skip
    out.append(dict(name="dp2", kind="dp", stages=1, ranks=2, gas=1, per_unit=1))
    return out


class PlainBP:
    """Backprop on one worker: the same layers in an nn.Sequential, an optimizer step per micro-batch."""

    def __init__(self, model: str) -> None:
        torch.manual_seed(0)
        self.module = nn.Sequential(*[spec.build() for spec in model_layers(model)])
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)
        self.data = itertools.cycle(fixed_data(model))
        self.stats: dict[str, float] = {k: 0.0 for k in COMPUTE_KINDS}
        self.stage_id = 0

    def unit(self) -> None:
        x, y = next(self.data)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(self.module(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.stats["forward_s"] += t1 - t0
        self.stats["backward_s"] += t2 - t1
        self.stats["step_s"] += t3 - t2


class DeepSpeedVariant:
    """A DeepSpeed pipeline engine (FDG, 1F1B or one-stage data parallel) on the fixed data."""

    def __init__(self, spec: dict[str, Any], model: str, parts: list[int]) -> None:
        import deepspeed

        import fdg_schedule  # noqa: F401  (a "schedule": "fdg" config now builds the FDG engine)
        from fdg_schedule.zoo.resnet import SplitPipelineModule, parts_method

        torch.manual_seed(0)
        cfg = MODELS[model]
        module = SplitPipelineModule(
            layers=model_layers(model),
            num_stages=spec["stages"],
            loss_fn=nn.CrossEntropyLoss(),
            partition_method=parts_method(parts),
        )
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": cfg["micro"],
            "gradient_accumulation_steps": spec["gas"],
            "gradient_clipping": 0.0,  # clipping would add a cross-stage all-reduce to 1F1B
            "steps_per_print": 10**9,
        }
        if spec["kind"] == "fdg":
            fdg = {"grad_shrink": GRAD_SHRINK, "weights": spec["weights"], "activations": spec["activations"]}
            config["pipeline"] = {"schedule": "fdg", "fdg": fdg}
        self.engine, *_ = deepspeed.initialize(
            model=module,
            config=config,
            optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
            model_parameters=module.parameters(),
        )
        self.module = module
        self.stage_id = self.engine.stage_id
        self.data = itertools.cycle(fixed_data(model))
        self.is_fdg = spec["kind"] == "fdg"
        self._stats: dict[str, float] = {}
        if not self.is_fdg:
            self._time_stock_instructions()

    @property
    def stats(self) -> dict[str, float]:
        return dict(self.engine.fdg_stats) if self.is_fdg else dict(self._stats)

    def unit(self) -> None:
        self.engine.train_batch(self.data)

    def _time_stock_instructions(self) -> None:
        """Time DeepSpeed's handlers by kind, through an instance copy of its instruction map."""
        from deepspeed.runtime.pipe import schedule as s

        kinds = {
            s.ForwardPass: "forward_s", s.BackwardPass: "backward_s", s.OptimizerStep: "step_s",
            s.ReduceGrads: "reduce_s", s.ReduceTiedGrads: "reduce_s", s.LoadMicroBatch: "load_s",
            s.SendActivation: "wait_s", s.RecvActivation: "wait_s", s.SendGrad: "wait_s", s.RecvGrad: "wait_s",
        }  # fmt: skip
        self._stats = {k: 0.0 for k in set(kinds.values())}
        table = dict(type(self.engine)._INSTRUCTION_MAP)
        for cls, kind in kinds.items():
            table[cls] = _timed(table[cls], self._stats, kind)
        self.engine._INSTRUCTION_MAP = table  # the dispatch loop reads self._INSTRUCTION_MAP


def _timed(fn: Callable[..., Any], stats: dict[str, float], kind: str) -> Callable[..., Any]:
    def timed(self: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(self, **kwargs)
        finally:
            stats[kind] += time.perf_counter() - start

    return timed


def build_variant(spec: dict[str, Any], model: str, splits: dict[str, list[int]]) -> PlainBP | DeepSpeedVariant | None:
    """This rank's part of ``spec`` (None: this rank sits the variant out)."""
    if spec["kind"] == "bp":
        return PlainBP(model) if dist.get_rank() == 0 else None
    parts = splits[split_key(spec)] if spec["stages"] > 1 else [0, len(model_layers(model))]
    return DeepSpeedVariant(spec, model, parts)


# ---------------------------------------------------------------------------------------------------
# Rank side: interleaved throughput


def throughput_worker(rank: int, world: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Build every variant, warm each up, run them interleaved, then count their held bytes.

    Returns this rank's per-window records and, per variant, its stage and held/saved bytes.
    """
    specs = plan["variants"]
    built = {spec["name"]: build_variant(spec, plan["model"], plan["splits"]) for spec in specs}
    for spec in specs:
        _window(built[spec["name"]], spec, plan["warmup"])
    windows = []
    for r in range(plan["repeats"]):
        shift = r % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            record = _window(built[spec["name"]], spec, plan["window"])
            windows.append({"repeat": r, "variant": spec["name"], **record})
            if rank == 0:
                print(f"  round {r} {spec['name']}: {record['micro_batches'] / record['wall_s']:.2f} micro-batches/s "
                      f"(load {record['load_before']:.1f})", flush=True)  # fmt: skip
    memory = {}
    for spec in specs:  # after the timings: the accounting hooks cost time
        dist.barrier()
        memory[spec["name"]] = held_or_saved(built[spec["name"]], spec, plan["memory_micro_batches"])
    stage = {name: (v.stage_id if v is not None else None) for name, v in built.items()}
    return {"rank": rank, "windows": windows, "stage_id": stage, "memory": memory}


def _window(variant: PlainBP | DeepSpeedVariant | None, spec: dict[str, Any], micro_batches: int) -> dict[str, Any]:
    """Run ``micro_batches`` (rounded up to whole units) of one variant after a barrier; time it."""
    units = max(1, -(-micro_batches // spec["per_unit"]))
    dist.barrier()
    load_before = os.getloadavg()[0]
    before = dict(variant.stats) if variant is not None else {}
    cpu_before = _cpu_seconds()
    start = time.perf_counter()
    if variant is not None:
        for _ in range(units):
            variant.unit()
    local_wall = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_before
    wall = torch.tensor([local_wall], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    after = dict(variant.stats) if variant is not None else {}
    return {
        "wall_s": wall.item(),
        "local_wall_s": local_wall,
        "micro_batches": units * spec["per_unit"],
        "stats": {k: after[k] - before.get(k, 0.0) for k in after},
        "cpu_s": cpu,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------------
# Rank side: memory of one variant alone


class SavedBytes:
    """Live bytes autograd has saved for backward (activations; weights and buffers excluded), and the peak."""

    def __init__(self, module: nn.Module) -> None:
        self.skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        self.live = 0
        self.peak = 0

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        return t if t.untyped_storage().data_ptr() in self.skip else _Counted(t, self)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Counted) else packed


class _Counted:
    __slots__ = ("tensor", "owner", "nbytes")

    def __init__(self, tensor: torch.Tensor, owner: SavedBytes) -> None:
        self.tensor, self.owner, self.nbytes = tensor, owner, tensor.numel() * tensor.element_size()
        owner.live += self.nbytes
        owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:  # the graph that saved it is gone
        self.owner.live -= self.nbytes


class HeldBytesObserver:
    """FDG observer: the largest ``held_bytes()`` / ``in_flight()`` seen at the end of a tick."""

    def __init__(self) -> None:
        self.held_max = 0
        self.in_flight_max = 0

    def on_instruction(self, engine: Any, cmd: Any, start: float, end: float) -> None:
        if type(cmd).__name__ == "AdvanceTick":
            self.held_max = max(self.held_max, engine.held_bytes())
            self.in_flight_max = max(self.in_flight_max, engine.in_flight())

    def on_call_end(self, engine: Any, seconds: float) -> None:
        pass


def held_or_saved(variant: PlainBP | DeepSpeedVariant | None, spec: dict[str, Any], micro_batches: int) -> dict:
    """Train ``micro_batches`` more and report the most bytes held for backward on this rank.

    FDG: ``engine.held_bytes()`` at every tick end (saved activations, stage inputs, weight
    snapshots) and ``in_flight()``. BP and DeepSpeed's engines: the peak of live autograd-saved
    activations (what 1F1B keeps between a micro-batch's forward and its backward).
    """
    if variant is None:
        return {}
    units = max(2, -(-micro_batches // spec["per_unit"]))
    if isinstance(variant, DeepSpeedVariant) and variant.is_fdg:
        observer = HeldBytesObserver()
        variant.engine.observers.append(observer)
        for _ in range(units):
            variant.unit()
        variant.engine.observers.remove(observer)
        return {"held_max": observer.held_max, "in_flight_max": observer.in_flight_max}
    saved = SavedBytes(variant.module)
    with saved.hooks():
        for _ in range(units):
            variant.unit()
    return {"saved_peak": saved.peak}


def memory_worker(rank: int, world: int, plan: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Build one variant in this fresh process, train a few micro-batches, report RSS and held bytes."""
    import psutil

    variant = build_variant(spec, plan["model"], plan["splits"])
    result: dict[str, Any] = {"rank": rank, "stage_id": None, "rss_build": psutil.Process().memory_info().rss}
    if variant is not None:
        result["stage_id"] = variant.stage_id
        result.update(held_or_saved(variant, spec, plan["memory_micro_batches"]))
    dist.barrier()
    result["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    return result


# ---------------------------------------------------------------------------------------------------
# Process trees (spawned ranks, file:// rendezvous, a deadline)


def run_ranks(worker: Callable[..., Any], world: int, args: tuple, deadline_s: float) -> list[Any]:
    """``worker(rank, world, *args)`` on ``world`` fresh processes; results in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(worker, rank, world, init_file, results, args)) for rank in range(world)
        ]
        for p in procs:
            p.start()
        done: dict[int, Any] = {}
        end = time.monotonic() + deadline_s
        try:
            while len(done) < world:
                try:
                    status, rank, payload = results.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > end:
                        missing = sorted(set(range(world)) - set(done))
                        raise RuntimeError(f"ranks {missing} did not finish within {deadline_s:.0f} s") from None
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                    if dead:
                        raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                    continue
                if status == "error":
                    raise RuntimeError(f"rank {rank} raised:\n{payload}")
                done[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    return [done[r] for r in range(world)]


def _entry(worker: Callable[..., Any], rank: int, world: int, init_file: str, results: Any, args: tuple) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip
    try:
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        torch.set_num_threads(1)
        deepspeed.init_distributed(
            dist_backend="gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, verbose=False
        )
        results.put(("ok", rank, worker(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put(("error", rank, traceback.format_exc()))


# ---------------------------------------------------------------------------------------------------
# Summary


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(plan: dict[str, Any], ranks: list[dict[str, Any]], memory: dict[str, list[dict[str, Any]]]) -> dict:
    """Per variant: samples/s, paired ratios, efficiency, stage balance, memory."""
    specs = {s["name"]: s for s in plan["variants"]}
    micro = MODELS[plan["model"]]["micro"]
    rows: dict[str, dict[str, Any]] = {}
    per_repeat: dict[str, dict[int, float]] = {name: {} for name in specs}
    for name, spec in specs.items():
        rank0 = [w for w in ranks[0]["windows"] if w["variant"] == name]
        samples_per_s, efficiency, compute, wait, other, cpu, share, loads = [], [], [], [], [], [], [], []
        for i, w0 in enumerate(rank0):
            windows = [[x for x in r["windows"] if x["variant"] == name][i] for r in ranks]
            used = [w for w, r in zip(windows, ranks) if r["stage_id"][name] is not None]
            samples = w0["micro_batches"] * micro * (spec["ranks"] if spec["kind"] == "dp" else 1)
            rate = samples / w0["wall_s"]
            samples_per_s.append(rate)
            per_repeat[name][w0["repeat"]] = rate
            stage_compute = [sum(w["stats"].get(k, 0.0) for k in COMPUTE_KINDS) for w in used]
            efficiency.append(sum(stage_compute) / (len(used) * w0["wall_s"]))
            compute.append([c / w0["micro_batches"] for c in stage_compute])
            wait.append([w["stats"].get("wait_s", 0.0) / w0["micro_batches"] for w in used])
            other.append(
                [(w["local_wall_s"] - c - w["stats"].get("wait_s", 0.0)) / w0["micro_batches"]
                 for w, c in zip(used, stage_compute)]
            )  # fmt: skip
            cpu.append([w["cpu_s"] for w in windows])
            share.append([w["cpu_s"] / w["local_wall_s"] for w in used])
            loads.append((w0["load_before"], w0["load_after"]))
        stages = len(compute[0])
        rows[name] = {
            "kind": spec["kind"],
            "samples_per_s": _spread(samples_per_s),
            "samples_per_s_all": samples_per_s,
            "efficiency": _spread(efficiency),
            "stage_compute_s_per_micro_batch": [statistics.median(c[s] for c in compute) for s in range(stages)],
            "stage_wait_s_per_micro_batch": [statistics.median(c[s] for c in wait) for s in range(stages)],
            # the rest of each rank's own wall time: dispatch, exchange posting, data, Python
            "stage_other_s_per_micro_batch": [statistics.median(c[s] for c in other) for s in range(stages)],
            "cpu_s_per_rank_per_window": [statistics.median(c[r] for c in cpu) for r in range(len(ranks))],
            # CPU seconds a rank got per second of its wall time: < 1 while waiting or descheduled
            "cpu_share_per_stage": [statistics.median(c[s] for c in share) for s in range(stages)],
            "load_avg_1min": loads,
            "optimizer_steps_per_micro_batch": 1.0 / spec["gas"] if spec["kind"] == "1f1b" else 1.0,
        }
    baseline_1f1b = "1f1b_m4" if "1f1b_m4" in per_repeat else None
    for name, row in rows.items():
        for key, base in (("ratio_vs_bp", "bp"), ("ratio_vs_1f1b_m4", baseline_1f1b)):
            if base is None or base not in per_repeat:
                continue
            paired = [per_repeat[name][r] / per_repeat[base][r] for r in per_repeat[name] if r in per_repeat[base]]
            row[key] = _spread(paired)
        row["speedup_over_k"] = row["ratio_vs_bp"]["median"] / specs[name]["ranks"] if "ratio_vs_bp" in row else None
        in_process = sorted(
            ({"stage_id": r["stage_id"][name], "rank": r["rank"], **r["memory"][name]} for r in ranks
             if r["stage_id"][name] is not None),
            key=lambda m: (m["stage_id"], m["rank"]),
        )  # fmt: skip
        fresh = memory.get(name) or [{} for _ in in_process]
        row["memory"] = [
            {**m, **{k: v for k, v in f.items() if k.startswith("rss")}} for m, f in zip(in_process, fresh)
        ]
        row["split"] = plan["splits"].get(split_key(specs[name])) if specs[name]["stages"] > 1 else None
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: one throughput table per model, then memory by K."""
    lines = [
        f"Measured {report['date']} on {report['machine']}, engine {report['engine']}; command:",
        "",
        f"    {report['command']}",
        "",
        f"Load average (1 min) at start {report['load_start'][0]:.2f}, at end {report['load_end'][0]:.2f}; "
        f"{report['seconds']:.0f} s in all.",
        "",
    ]
    for model, result in report["models"].items():
        cfg = MODELS[model]
        lines += [
            f"### {model} (micro-batch {cfg['micro']}, {report['repeats']} rounds of {report['window']} "
            "micro-batches per variant)",
            "",
            "| variant | split | samples/s median [min–max] | ×BP | ×1F1B m=4 | efficiency | compute ms/µb "
            "| wait ms/µb | other ms/µb | CPU share | peak RSS MB | ΔRSS MB | held (FDG) / saved (others) MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [_row(name, row) for name, row in result["variants"].items()]
        loads = [load for row in result["variants"].values() for pair in row["load_avg_1min"] for load in pair]
        lines += ["", f"Load average (1 min) during the windows: {min(loads):.2f}–{max(loads):.2f}.", ""]
    for model, result in report.get("memory_by_stages", {}).items():
        lines += [
            f"### {model}: memory per stage by K (fresh processes)",
            "",
            "| variant | K | held (FDG) / saved (others) MB | ΔRSS MB |",
            "|---|---|---|---|",
        ]
        for k, per_variant in result.items():
            for name, mem in per_variant.items():
                held = _slash([m.get("held_max", m.get("saved_peak", 0)) for m in mem], 2**-20)
                rss = _slash([m["rss_peak"] - m["rss_build"] for m in mem], 2**-20, 0)
                lines.append(f"| {name} | {k} | {held} | {rss} |")
        lines.append("")
    return "\n".join(lines)


def _row(name: str, row: dict[str, Any]) -> str:
    """One table row; per-stage values are "stage 0 / stage 1"."""
    sps = row["samples_per_s"]
    mem = row["memory"] or []
    rss = [m for m in mem if "rss_peak" in m]
    cells = [
        name,
        "–" if row.get("split") is None else ",".join(map(str, row["split"])),
        f"{sps['median']:.1f} [{sps['min']:.1f}–{sps['max']:.1f}]",
        _ratio(row, "ratio_vs_bp"),
        _ratio(row, "ratio_vs_1f1b_m4"),
        f"{row['efficiency']['median']:.1%}",
        _slash(row["stage_compute_s_per_micro_batch"], 1e3),
        _slash(row["stage_wait_s_per_micro_batch"], 1e3),
        _slash(row["stage_other_s_per_micro_batch"], 1e3),
        _slash(row["cpu_share_per_stage"], 1.0, 2),
        _slash([m["rss_peak"] for m in rss], 2**-20, 0),
        _slash([m["rss_peak"] - m["rss_build"] for m in rss], 2**-20, 0),
        _slash([m.get("held_max", m.get("saved_peak", 0)) for m in mem], 2**-20),
    ]
    return "| " + " | ".join(cells) + " |"


def _ratio(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return "–"
    return f"{row[key]['median']:.2f} [{row[key]['min']:.2f}–{row[key]['max']:.2f}]"


def _slash(values: list[float], scale: float, digits: int = 1) -> str:
    return " / ".join(f"{v * scale:.{digits}f}" for v in values) if values else "–"


# ---------------------------------------------------------------------------------------------------
# Main


def measure_memory(plan: dict[str, Any], specs: list[dict[str, Any]], deadline_s: float) -> dict[str, list[dict]]:
    """Each variant alone in a fresh process tree; per stage (stage order) its memory record."""
    out = {}
    for spec in specs:
        records = run_ranks(memory_worker, spec["ranks"], (plan, spec), deadline_s)
        used = [r for r in records if r["stage_id"] is not None]
        out[spec["name"]] = sorted(used, key=lambda r: (r["stage_id"], r["rank"]))
        print(f"  memory {spec['name']} K={spec['stages']}: done", flush=True)
    return out


def engine_version() -> str:
    """Where the engine comes from: the commit, and whether fdg_schedule/ differs from it."""
    import subprocess

    import fdg_schedule

    if Path(fdg_schedule.__file__).resolve().parents[1] != ROOT:
        return f"fdg_schedule from {Path(fdg_schedule.__file__).parent}"

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "fdg_schedule")
    return f"{commit}{' + uncommitted changes in fdg_schedule/' if dirty else ''}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds, no RSS runs: a smoke run")
    parser.add_argument("--models", default=None, help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (0: memory runs only)")
    parser.add_argument("--window", type=int, default=None, help="micro-batches per variant per round")
    parser.add_argument("--warmup", type=int, default=None, help="micro-batches per variant before timing")
    parser.add_argument("--fdg-gas", type=int, default=None, help="FDG ticks per train_batch() call")
    parser.add_argument("--rss", default=None, help="K values for fresh-process memory runs, e.g. 2 or 2,3,4 ('' none)")
    parser.add_argument("--memory-micro-batches", type=int, default=8, help="micro-batches per memory count")
    parser.add_argument("--variants", default=None, help="comma-separated subset of variant names")
    parser.add_argument(
        "--parts", default="", help="fixed splits, e.g. 'resnet32:2=0,6,18;resnet32:2r=0,5,18' (2r: FDG recomputed)"
    )
    parser.add_argument("--engine-note", default="", help="text recorded next to the engine version")
    parser.add_argument("--out", default=str(ROOT / "out" / "throughput"))
    parser.add_argument("--deadline", type=float, default=3600, help="seconds per process tree")
    args = parser.parse_args(argv)
    # A SIGTERM becomes SystemExit, so run_ranks' cleanup kills the ranks instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    quick = args.quick
    models = (args.models or ("resnet8_tiny,transformer_tiny" if quick else "resnet32,transformer")).split(",")
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    window = args.window or (8 if quick else 16)
    warmup = args.warmup or (4 if quick else 8)
    fdg_gas = args.fdg_gas or (4 if quick else 8)
    rss_stages = [int(k) for k in (args.rss if args.rss is not None else ("" if quick else "2")).split(",") if k]
    specs = variants(fdg_gas)
    if args.variants:
        specs = [s for s in specs if s["name"] in args.variants.split(",")]
    command = "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python " + " ".join(
        [os.path.relpath(__file__, ROOT), *(sys.argv[1:] if argv is None else argv)]
    )
    print(f"command: {command}", flush=True)
    started = time.monotonic()
    report: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "engine": " ".join(filter(None, [engine_version(), args.engine_note])),
        "load_start": os.getloadavg(),
        "repeats": repeats,
        "window": window,
        "warmup": warmup,
        "fdg_gas": fdg_gas,
        "data": "synthetic fixed tensors, cycled (data loading excluded)",
        "models": {},
        "memory_by_stages": {},
    }
    for model in models:
        forward, backward = layer_costs(model)
        splits = {}
        for k in {STAGES, *rss_stages}:
            splits[str(k)] = balanced_split(forward, backward, k)
            splits[f"{k}r"] = balanced_split(forward, backward, k, recompute=True)
        for item in filter(None, args.parts.split(";")):  # "[model:]key=bounds"
            key, bounds = item.split("=")
            only, _, key = key.rpartition(":")
            if only in ("", model):
                splits[key] = [int(b) for b in bounds.split(",")]
        plan = dict(model=model, splits=splits, variants=specs, repeats=repeats, window=window, warmup=warmup,
                    memory_micro_batches=args.memory_micro_batches)  # fmt: skip
        costs_ms = [round((f + b) * 1e3, 2) for f, b in zip(forward, backward)]
        print(f"{model}: layer forward+backward {costs_ms} ms, splits {splits}", flush=True)
        ranks: list[dict[str, Any]] = []
        if repeats:
            ranks = run_ranks(throughput_worker, STAGES, (plan,), args.deadline)
        by_stages = {}
        for k in rss_stages:
            pipes = (
                specs if k == STAGES else [dict(s, stages=k, ranks=k) for s in specs if s["kind"] in ("fdg", "1f1b")]
            )
            by_stages[str(k)] = measure_memory(plan, pipes, args.deadline)
        if ranks:
            report["models"][model] = {
                "layer_forward_s": forward,
                "layer_backward_s": backward,
                "splits": splits,
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


if __name__ == "__main__":
    main()
