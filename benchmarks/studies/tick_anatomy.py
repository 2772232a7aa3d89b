"""Where an FDG tick's time goes against the plain-torch halves of the same split: per instruction, per cause.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.studies.tick_anatomy --model plainconv --rounds 6 --window 24   # about 3 min

One process tree of K = 2 gloo ranks (one thread each), as the throughput benchmark's: every variant is
built once, warmed up, then timed in interleaved windows whose order rotates each round. Variants:
``halves`` (the FDG stored split's stages in plain torch, no exchange: the ceiling), ``halves_exchange``
and ``halves_shm`` (the same plus one exchange of the boundary's shape per tick, gloo / shared memory),
``fdg`` and ``fdg_shm`` (FDG current/stored, K = 2, ``accumulate`` 4). For the FDG variants every
instruction is timed through the public hook (:func:`fdg_schedule.base.dispatch.observe`), and inside
them the stage module's own forward (``PipelineModule.forward``) and autograd's backward
(``torch.autograd.backward``), so that each instruction splits into the layers' compute and what the
engine and DeepSpeed add around it. Per window and rank the process's and the main thread's CPU time
(the difference is other threads: gloo's transport), page faults and context switches are read.

Output: a Markdown table per variant and rank, ms per tick (median over rounds), and the raw windows
as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import rank_process  # noqa: E402
from benchmarks.common.rank_process import prepare_process  # noqa: E402
from benchmarks.common.throughput_variants import DeepSpeedVariant, PlainHalves  # noqa: E402

FDG: dict[str, dict[str, str]] = {
    "fdg": {},
    "fdg_shm": {"transport": "shm"},
    "fdg_bound": {},
    "fdg_shm_bound": {"transport": "shm"},
}
HALVES: dict[str, bool | str] = {"halves": False, "halves_exchange": True, "halves_shm": "shm", "halves_bound": False}
BOUND = "_bound"  # every thread of rank r on core r during the variant's windows, unbound otherwise


def thread_schedstat() -> tuple[float, float]:
    """The calling thread's seconds on a CPU and seconds runnable but waiting for one (Linux schedstat)."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def thread_cpu_id() -> int:
    """The CPU the calling thread last ran on (field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


class Inner:
    """Seconds inside the stage module's forward and inside autograd's backward, on this rank."""

    def __init__(self) -> None:
        self.seconds = collections.defaultdict[str, float](float)
        self.active = False
        backward = torch.autograd.backward

        def timed_backward(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return backward(*args, **kwargs)
            finally:
                if self.active:
                    self.seconds["autograd_backward"] += time.perf_counter() - start
                    self.seconds["autograd_backward_cpu"] += time.thread_time() - cpu

        torch.autograd.backward = timed_backward  # Tensor.backward looks it up here too

    def time_forward(self, module: Any) -> None:
        forward = module.forward

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return forward(*args, **kwargs)
            finally:
                if self.active:
                    self.seconds["module_forward"] += time.perf_counter() - start
                    self.seconds["module_forward_cpu"] += time.thread_time() - cpu

        module.forward = timed_forward  # an instance attribute: nn.Module.__call__ finds it first


class InstructionClock:
    """An FDG engine's observer: wall and main-thread CPU seconds per instruction, each tick's busy and wait time."""

    def __init__(self, inner: Inner) -> None:
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.boundary = 0.0  # wall seconds of each call outside its instructions (Note [no wait between calls])
        self.call_started: float | None = None
        self.first: float | None = None  # the first instruction's start in the current call
        self.wall: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.cpu: collections.defaultdict[str, float] = collections.defaultdict(
            float
        )  # main-thread CPU since the previous one ended
        self.last: tuple[float, float] | None = None  # the previous instruction's end: wall, main-thread CPU
        self.dispatch_gap = 0.0
        self.ticks: list[tuple[float, float, int]] = []  # per tick: busy s, wait s, the CPU it ended on
        self.busy = self.wait = 0.0

    def __call__(self, view: Any, cmd: Any, start: float, end: float) -> None:
        cpu = time.thread_time()
        if not self.inner.active:
            return
        name = type(cmd).__name__
        if self.first is None:
            self.first = start
        self.wall[name] += end - start
        if self.last is not None:
            self.dispatch_gap += start - self.last[0]
            self.cpu[name] += cpu - self.last[1]
        self.last = (end, cpu)
        if name in ("WaitGrad", "WaitActivation"):
            self.wait += end - start
        else:
            self.busy += end - start
        if name == "AdvanceTick":  # one tick: its instructions' time less the waits, and its waits
            self.ticks.append((self.busy, self.wait, thread_cpu_id()))
            self.busy = self.wait = 0.0

    def call(self, unit: Any) -> None:
        """Run one ``train_batch()`` call; add its time outside the instructions (set-up before the first, the
        call's end after the last: the non-finite check, the loss, monitors) to :attr:`boundary`."""
        self.first = None
        start = time.perf_counter()
        unit()
        end = time.perf_counter()
        if self.inner.active and self.first is not None and self.last is not None:
            self.boundary += (self.first - start) + (end - self.last[0])

    def record(self) -> dict[str, Any]:
        return {
            "call_boundary_s": self.boundary,
            "instructions": dict(self.wall),
            "instruction_cpu": dict(self.cpu),
            "ticks_busy_wait_s": list(self.ticks),
            "dispatch_gap_s": self.dispatch_gap,
        }


def build(plan: dict[str, Any], inner: Inner) -> dict[str, tuple[Any, InstructionClock | None]]:
    """Every variant of this rank, with its instruction clock (FDG only)."""
    from fdg_schedule.base import dispatch

    built: dict[str, tuple[Any, InstructionClock | None]] = {}
    for name, exchange in HALVES.items():
        halves = PlainHalves(plan["model"], plan["parts"], exchange=exchange)
        inner.time_forward(halves.module)
        built[name] = (halves, None)
    for name, extra in FDG.items():
        spec = dict(kind="fdg", stages=2, gas=plan["gas"], weights="current", activations="stored", **extra)
        variant = DeepSpeedVariant(spec, plan["model"], plan["parts"], plan["host_memory"])
        clock = InstructionClock(inner)
        dispatch.observe(variant.engine, clock)
        inner.time_forward(variant.module)
        built[name] = (variant, clock)
    return built


def window(name: str, built: tuple[Any, InstructionClock | None], ticks: int, inner: Inner, cores: Any) -> dict:
    variant, clock = built
    gas = plan_gas(variant)
    units = ticks // gas
    cores.bind(name.endswith(BOUND))
    dist.barrier()
    inner.seconds.clear()
    if clock is not None:
        clock.reset()
    before, usage, sched = dict(variant.stats), rank_process.usage(), thread_schedstat()
    inner.active = True
    start = time.perf_counter()
    for _ in range(units):
        clock.call(variant.unit) if clock is not None else variant.unit()
    local = time.perf_counter() - start
    inner.active = False
    after, usage_after, sched_after = dict(variant.stats), rank_process.usage(), thread_schedstat()
    wall = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    record: dict[str, Any] = {
        "variant": name,
        "ticks": units * gas,
        "wall_s": wall.item(),
        "local_wall_s": local,
        "stats": {k: after[k] - before.get(k, 0.0) for k in after},
        "usage": {k: usage_after[k] - usage[k] for k in usage},
        "inner": dict(inner.seconds),
        "main_on_cpu_s": sched_after[0] - sched[0],
        "main_runnable_waiting_s": sched_after[1] - sched[1],
    }
    if clock is not None:
        record.update(clock.record())
    return record


def plan_gas(variant: Any) -> int:
    return int(variant.engine.gradient_accumulation_steps()) if hasattr(variant, "engine") else 1


def worker(rank: int, world: int, plan: dict[str, Any]) -> dict[str, Any]:
    cores = prepare_process(rank, {"host_memory": plan["host_memory"]})
    inner = Inner()
    built = build(plan, inner)
    names = list(built)
    for name in names:
        window(name, built[name], plan["warmup"], inner, cores)
    windows = []
    for r in range(plan["rounds"]):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            record = window(name, built[name], plan["window"], inner, cores)
            windows.append({"round": r, **record})
            if rank == 0:
                rate = record["ticks"] / record["wall_s"]
                print(f"  round {r} {name}: {rate:.2f} ticks/s", flush=True)
    stage = {name: v.stage_id for name, (v, _) in built.items()}
    return {"rank": rank, "stage": stage, "windows": windows}


def per_tick_ms(windows: list[dict[str, Any]], get: Any) -> float:
    return statistics.median(1e3 * get(w) / w["ticks"] for w in windows)


KINDS = ("step", "exchange", "wait", "load", "reduce")


def stat_ms(windows: list[dict[str, Any]], kind: str) -> float:
    return per_tick_ms(windows, lambda w: w["stats"].get(f"{kind}_s", 0.0))


def _tick_and_dispatch(w: dict[str, Any]) -> float:
    """A window's ``AdvanceTick`` time and the gaps between instructions inside its calls (the calls' edges apart)."""
    inside = w["dispatch_gap_s"] - w.get("call_boundary_s", 0.0)
    return w["instructions"].get("AdvanceTick", 0.0) + max(0.0, inside)


def table(ranks: list[dict[str, Any]], micro: int) -> str:
    rows = []
    names = list(dict.fromkeys(w["variant"] for w in ranks[0]["windows"]))
    ceiling = statistics.median(
        w["ticks"] * micro / w["wall_s"] for w in ranks[0]["windows"] if w["variant"] == "halves"
    )
    head = (
        "| variant | rank | samples/s | x halves | wall/tick | compute | fwd (module) | bwd (autograd) | step "
        "| exchange | wait | load | reduce | tick+dispatch | call boundary | other threads CPU | kernel CPU "
        "| faults/tick | invol. sw/tick |"
    )
    rows.append(head)
    rows.append("|" + "---|" * head.count("|")[:-1] if False else "|" + "---|" * (head.count("|") - 1))
    for name in names:
        for r in ranks:
            ws = [w for w in r["windows"] if w["variant"] == name]
            rate = statistics.median(w["ticks"] * micro / w["wall_s"] for w in ws)
            ms = functools.partial(per_tick_ms, ws)
            compute = ms(lambda w: sum(w["stats"].get(k, 0.0) for k in ("forward_s", "backward_s", "step_s")))
            fwd = ms(lambda w: w["stats"].get("forward_s", 0.0))
            bwd = ms(lambda w: w["stats"].get("backward_s", 0.0))
            inner_f = ms(lambda w: w["inner"].get("module_forward", 0.0))
            inner_b = ms(lambda w: w["inner"].get("autograd_backward", 0.0))
            other_threads = ms(lambda w: w["usage"]["user_s"] + w["usage"]["sys_s"] - w["usage"]["main_thread_s"])
            rest = boundary = "-"
            if "instructions" in ws[0]:  # the gaps between instructions inside calls; the calls' own edges apart
                rest = f"{ms(_tick_and_dispatch):.2f}"
                boundary = f"{ms(lambda w: w.get('call_boundary_s', 0.0)):.2f}"
            rows.append(
                f"| {name} | {r['rank']} | {rate:.1f} | {rate / ceiling:.3f} | {ms(lambda w: w['local_wall_s']):.2f} "
                f"| {compute:.2f} | {fwd:.2f} ({inner_f:.2f}) | {bwd:.2f} ({inner_b:.2f}) "
                f"| {' | '.join(f'{stat_ms(ws, kind):.2f}' for kind in KINDS)} "
                f"| {rest} | {boundary} | {other_threads:.2f} | {ms(lambda w: w['usage']['sys_s']):.2f} "
                f"| {per_tick_ms(ws, lambda w: w['usage']['minor_faults']) / 1e3:.0f} "
                f"| {per_tick_ms(ws, lambda w: w['usage']['involuntary_switches']) / 1e3:.1f} |"
            )
    return "\n".join(rows)


def cpu_table(ranks: list[dict[str, Any]]) -> str:
    """Per variant and rank, ms per tick of main-thread CPU (split into the layers' forward, autograd's backward
    and the rest), other threads' CPU, and wall time the main thread did not run (blocked or descheduled)."""
    head = (
        "| variant | rank | wall | main-thread CPU | layers' forward | autograd backward | rest of main thread "
        "| other threads | wall - main CPU | of which runnable, waiting for a CPU |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in list(dict.fromkeys(w["variant"] for w in ranks[0]["windows"])):
        for r in ranks:
            ws = [w for w in r["windows"] if w["variant"] == name]
            ms = functools.partial(per_tick_ms, ws)
            main = ms(lambda w: w["usage"]["main_thread_s"])
            fwd = ms(lambda w: w["inner"].get("module_forward_cpu", 0.0))
            bwd = ms(lambda w: w["inner"].get("autograd_backward_cpu", 0.0))
            rest = ms(lambda w: w["usage"]["main_thread_s"] - w["inner"].get("module_forward_cpu", 0.0)
                      - w["inner"].get("autograd_backward_cpu", 0.0))  # fmt: skip
            other = ms(lambda w: w["usage"]["user_s"] + w["usage"]["sys_s"] - w["usage"]["main_thread_s"])
            idle = ms(lambda w: w["local_wall_s"] - w["usage"]["main_thread_s"])
            queued = ms(lambda w: w["main_runnable_waiting_s"])
            rows.append(f"| {name} | {r['rank']} | {ms(lambda w: w['local_wall_s']):.2f} | {main:.2f} | {fwd:.2f} "
                        f"| {bwd:.2f} | {rest:.2f} | {other:.2f} | {idle:.2f} | {queued:.2f} |")  # fmt: skip
    for name in FDG:
        for r in ranks:
            ws = [w for w in r["windows"] if w["variant"] == name]
            kinds = sorted(ws[0]["instruction_cpu"])
            cells = ", ".join(
                f"{k} {per_tick_ms(ws, lambda w, k=k: w['instruction_cpu'].get(k, 0.0)):.2f}" for k in kinds
            )
            rows.append(f"\n{name} rank {r['rank']}, main-thread CPU ms per tick by instruction: {cells}")
    return "\n".join(rows)


def lockstep(ranks: list[dict[str, Any]]) -> str:
    """Per FDG variant, ms per tick: the slower rank's mean busy time (what it would take alone), the mean
    of the slower rank's busy time tick by tick (the lock-step pays every tick's slower rank: jitter), and the
    measured tick (the rest: the messages' latency on the critical path, the dispatch loop, the call's end)."""
    lines = []
    for name in FDG:
        alone, jitter, tick, same = [], [], [], []
        for i, w0 in enumerate(w for w in ranks[0]["windows"] if w["variant"] == name):
            w1 = [w for w in ranks[1]["windows"] if w["variant"] == name][i]
            b0 = [t[0] for t in w0["ticks_busy_wait_s"]]
            b1 = [t[0] for t in w1["ticks_busy_wait_s"]]
            same.append(
                statistics.fmean(a[2] == b[2] for a, b in zip(w0["ticks_busy_wait_s"], w1["ticks_busy_wait_s"]))
            )
            n = min(len(b0), len(b1))
            alone.append(1e3 * max(statistics.fmean(b0[:n]), statistics.fmean(b1[:n])))
            jitter.append(1e3 * statistics.fmean(max(a, b) for a, b in zip(b0[:n], b1[:n])))
            tick.append(1e3 * w0["wall_s"] / w0["ticks"])
        a, j, t = (statistics.median(x) for x in (alone, jitter, tick))
        lines.append(
            f"{name}: slower rank alone {a:.2f} ms, tick by tick {j:.2f} ms (jitter +{j - a:.2f}), measured tick "
            f"{t:.2f} ms (latency, dispatch, call end +{t - j:.2f}); both ranks' main threads on the same CPU at a "
            f"tick's end: {statistics.median(same):.0%} of ticks"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common.bench_models import MODELS
    from fdg_schedule.tools.launch import run

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="plainconv")
    parser.add_argument("--parts", default=None, help="the split, e.g. 0,14,29 (default: the balanced FDG split)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=int, default=24, help="ticks per variant per round (a multiple of --gas)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--gas", type=int, default=4)
    parser.add_argument("--host-memory", choices=("retain", "system"), default="retain")
    parser.add_argument("--out", default="out/tick_anatomy")
    args = parser.parse_args(argv)
    if args.parts:
        parts = [int(p) for p in args.parts.split(",")]
    else:
        from benchmarks.common.layer_profile import model_profile
        from fdg_schedule.partitioning.partition import Objective, balanced_partition

        parts = balanced_partition(model_profile(args.model), 2, Objective()).parts
    print(f"{args.model}: parts {parts}", flush=True)
    plan = dict(model=args.model, parts=parts, rounds=args.rounds, window=args.window, warmup=args.warmup,
                gas=args.gas, host_memory=args.host_memory)  # fmt: skip
    ranks = run(worker, 2, plan, deadline_s=3600)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(ranks, MODELS[args.model]["micro"]) + "\n\n" + cpu_table(ranks) + "\n\n" + lockstep(ranks)
    (out / "tick_anatomy.json").write_text(json.dumps({"plan": plan, "ranks": ranks}, indent=1))
    (out / "tick_anatomy.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
