"""The rank side of the throughput benchmark: every variant timed in interleaved windows, and its memory."""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from benchmarks.common import rank_process
from benchmarks.common.optimizers import CLIP
from benchmarks.common.rank_process import prepare_process
from benchmarks.common.throughput_variants import DeepSpeedVariant, Variant, build_variant


def throughput_worker(rank: int, world: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Build every variant, warm each up, run them interleaved, then count their held bytes.

    Returns this rank's per-window records and, per variant, its stage and held/saved bytes.
    """
    cores = prepare_process(rank, plan)
    specs = plan["variants"]
    freed, optimizer = plan.get("host_memory", "system"), plan.get("optimizer", "sgd")
    built = {spec["name"]: build_variant(spec, plan["model"], plan["splits"], freed, optimizer) for spec in specs}
    for spec in specs:
        cores.bind(spec.get("bind_cores", False))
        _window(built[spec["name"]], spec, plan["warmup"])
    windows = []
    for r in range(plan["repeats"]):
        shift = r % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            cores.bind(spec.get("bind_cores", False))
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
    stepped = {name: stepped_by(v) for name, v in built.items() if v is not None}
    return {"rank": rank, "windows": windows, "stage_id": stage, "memory": memory, "optimizer": stepped}


def stepped_by(variant: Variant) -> dict[str, Any]:
    """What this rank's part of a variant stepped: the optimizer's class (DeepSpeed's unwrapped) and the gradient
    clipping it ran with."""
    if isinstance(variant, DeepSpeedVariant):
        engine = variant.engine
        return {"class": type(engine.basic_optimizer).__name__, "gradient_clipping": engine.gradient_clipping()}
    return {"class": type(variant.optimizer).__name__, "gradient_clipping": CLIP[variant.optimizer_name]}


def _window(variant: Variant | None, spec: dict[str, Any], micro_batches: int) -> dict[str, Any]:
    """Run ``micro_batches`` (rounded up to whole units) of one variant after a barrier; time it."""
    units = max(1, -(-micro_batches // spec["per_unit"]))
    dist.barrier()
    load_before = os.getloadavg()[0]
    before = dict(variant.stats) if variant is not None else {}
    usage_before = rank_process.usage()
    get_accelerator().synchronize()  # on a GPU: the window holds exactly its own kernels (no-op on CPU)
    start = time.perf_counter()
    if variant is not None:
        for _ in range(units):
            variant.unit()
    get_accelerator().synchronize()
    local_wall = time.perf_counter() - start
    usage = {k: v - usage_before[k] for k, v in rank_process.usage().items()}
    wall = torch.tensor([local_wall], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    after = dict(variant.stats) if variant is not None else {}
    return {
        "wall_s": wall.item(),
        "local_wall_s": local_wall,
        "micro_batches": units * spec["per_unit"],
        "stats": {k: after[k] - before.get(k, 0.0) for k in after},
        "cpu_s": usage["user_s"] + usage["sys_s"],
        "usage": usage,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


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
    """FDG observer: the largest ``held_bytes`` / ``in_flight`` its view shows at the end of a tick."""

    def __init__(self) -> None:
        self.held_max = 0
        self.in_flight_max = 0

    def on_instruction(self, view: Any, cmd: Any, start: float, end: float) -> None:
        if type(cmd).__name__ == "AdvanceTick":
            self.held_max = max(self.held_max, view.held_bytes)
            self.in_flight_max = max(self.in_flight_max, view.in_flight)

    def on_call_end(self, view: Any, seconds: float) -> None:
        pass


def held_or_saved(variant: Variant | None, spec: dict[str, Any], micro_batches: int) -> dict:
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
        delta = variant.engine.fdg_state.corrections.delta or []  # the weight prediction's δ (fp32)
        return {
            "held_max": observer.held_max,
            "in_flight_max": observer.in_flight_max,
            "delta_bytes": sum(d.numel() * d.element_size() for d in delta),
        }
    saved = SavedBytes(variant.module)
    with saved.hooks():
        for _ in range(units):
            variant.unit()
    return {"saved_peak": saved.peak}


def memory_worker(rank: int, world: int, plan: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Build one variant in this fresh process, train a few micro-batches, report RSS and held bytes."""
    import psutil

    prepare_process(rank, plan)
    variant = build_variant(
        spec, plan["model"], plan["splits"], plan.get("host_memory", "system"), plan.get("optimizer", "sgd")
    )
    result: dict[str, Any] = {"rank": rank, "stage_id": None, "rss_build": psutil.Process().memory_info().rss}
    if variant is not None:
        result["stage_id"] = variant.stage_id
        result.update(held_or_saved(variant, spec, plan["memory_micro_batches"]))
    dist.barrier()
    result["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    return result
