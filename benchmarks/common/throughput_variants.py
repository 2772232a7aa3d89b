"""The models and variants the throughput benchmark compares, as each rank builds them.

Models (``bench_models.py``) are flat layer lists ``PipelineModule`` can cut anywhere, fed fixed
synthetic data; variants are plain backprop (``bp``), DeepSpeed's 1F1B, FDG in every mode and
DeepSpeed data parallelism. Pipelines are split by the library's balanced partitioner
(:mod:`fdg_schedule.partitioning.partition`), each for its own schedule and modes; the ``*_by_params`` variants
use DeepSpeed's default ``partition_method="parameters"`` split instead, for the comparison.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from benchmarks.common import optimizers
from benchmarks.common.bench_models import MODELS, build_layers, fixed_data, loss_fn, model_layers
from benchmarks.common.optimizers import LR, MOMENTUM  # noqa: F401  (the benchmark's SGD, as its scripts read it)
from fdg_schedule.exchange.shm_link import Link, message_bytes

STAGES = 2  # this machine has 2 cores: one per stage
TIMEOUT = timedelta(seconds=120)  # the plain halves' waits on each other
MODES = [("current", "stored"), ("current", "recomputed"), ("stashed", "stored"), ("stashed", "recomputed")]
GAS_1F1B = (2, 4, 8)
GRAD_SHRINK = 0.5
COMPUTE_KINDS = ("forward_s", "backward_s", "step_s", "reduce_s")
BY_PARAMS = "_by_params"  # name suffix of the variants split by DeepSpeed's "parameters" method
BY_PARAMS_OF = ("1f1b_m4", "fdg_current_stored")  # the variants also run on that split
# The staleness corrections (docs/staleness.md) on FDG stashed/stored, run only when named in --variants:
# what each costs in time and memory next to the same mode without it.
CORRECTED = "fdg_stashed_stored"  # the mode the corrections' variants add to
CORRECTIONS = {
    "delay_lr": {"delay_lr_ticks": 1024},
    "predict": {"predict_decay": 0.9},
    "both": {"delay_lr_ticks": 1024, "predict_decay": 0.9},
}


def split_key(spec: dict[str, Any]) -> str:
    """Which split a variant uses: ``"<K>"`` FDG stored, ``"<K>r"`` FDG recomputed, ``"<K>m<GAS>"`` 1F1B
    with GAS micro-batches per step (each balanced for that objective); a trailing ``"p"``: DeepSpeed's
    "parameters" split instead (predicted for the same objective)."""
    if spec["kind"] == "1f1b":
        key = f"{spec['stages']}m{spec['gas']}"
    else:
        key = f"{spec['stages']}{'r' if spec.get('activations') == 'recomputed' else ''}"
    return key + ("p" if spec.get("split") == "parameters" else "")


def split_objective(key: str) -> Any:
    """The :class:`fdg_schedule.partitioning.partition.Objective` of a split key (its time is predicted for it)."""
    from fdg_schedule.partitioning.partition import Objective

    key = key.removesuffix("p")
    if "m" in key:
        return Objective(schedule="1f1b", micro_batches=int(key.split("m")[1]))
    return Objective(activations="recomputed" if key.endswith("r") else "stored")


HALVES = "halves"
HALVES_RECOMPUTED = "halves_recomputed"  # the same ceiling for FDG's recomputed modes, on their own split
SHM = "_shm"  # name suffix of the FDG variants whose neighbours exchange through shared memory
BOUND = "_bound"
BOUND_OF = ("bp", "1f1b_m4", "fdg_current_stored")


def gas_suffix(gas: int, gas_fdg: int | list[int]) -> str:
    """The name suffix of an FDG variant run at ``gas`` ticks per call: none with one ``--fdg-gas``, ``_g<gas>``
    with several (``fdg_current_stored_g4``)."""
    return "" if isinstance(gas_fdg, int) or len(gas_fdg) == 1 else f"_g{gas}"


def variants(gas_fdg: int | list[int]) -> list[dict[str, Any]]:
    """Every variant the benchmark knows; ``gas_fdg``: FDG's ticks per ``train_batch()`` call, or several (each
    FDG variant then runs once per value, named with :func:`gas_suffix`)."""
    gases = [gas_fdg] if isinstance(gas_fdg, int) else list(gas_fdg)
    out: list[dict[str, Any]] = [dict(name="bp", kind="bp", stages=1, ranks=1, per_unit=1)]
    out += [dict(name=f"1f1b_m{m}", kind="1f1b", stages=STAGES, ranks=STAGES, gas=m, per_unit=m) for m in GAS_1F1B]
    out += [
        dict(name=f"fdg_{w}_{a}{gas_suffix(g, gas_fdg)}", kind="fdg", stages=STAGES, ranks=STAGES, gas=g, per_unit=g,
             weights=w, activations=a)
        for g in gases for w, a in MODES
    ]  # fmt: skip
    out.append(dict(name="dp2", kind="dp", stages=1, ranks=2, gas=1, per_unit=1))
    # the machine's own ceiling, in the same processes and rounds: FDG's stages in plain torch (run when named)
    out.append(dict(name=HALVES, kind="halves", stages=STAGES, ranks=STAGES, per_unit=1, optional=True))
    # the same in FDG's recomputed order on the recomputed split: every stage but the last forwards twice
    out.append(
        dict(name=HALVES_RECOMPUTED, kind="halves", stages=STAGES, ranks=STAGES, per_unit=1, activations="recomputed",
             optional=True)
    )  # fmt: skip
    # the same, plus FDG's exchange: each tick ends posting the boundary tensor to the neighbour, the next waits for it
    out.append(
        dict(name=HALVES + "_exchange", kind="halves", stages=STAGES, ranks=STAGES, per_unit=1, exchange=True,
             optional=True)
    )  # fmt: skip
    # the same exchange through shared memory instead of gloo's TCP: what a transport off the compute core would save
    out.append(
        dict(name=HALVES + "_shm", kind="halves", stages=STAGES, ranks=STAGES, per_unit=1, exchange="shm",
             optional=True)
    )  # fmt: skip
    # FDG's per-tick messages through shared memory instead of gloo (pipeline.fdg.transport "shm"; run when named)
    out += [
        dict(
            spec,
            name=f"fdg_current_{spec['activations']}{SHM}{gas_suffix(spec['gas'], gas_fdg)}",
            transport="shm",
            optional=True,
        )
        for spec in list(out)
        if spec["kind"] == "fdg" and spec["weights"] == "current"
    ]
    plain = next(spec for spec in out if spec["name"] == CORRECTED + gas_suffix(gases[0], gas_fdg))  # the first GAS
    out += [
        dict(plain, name=f"{CORRECTED}_{name}", corrections=keys, optional=True) for name, keys in CORRECTIONS.items()
    ]
    out += [
        dict(spec, name=spec["name"] + BY_PARAMS, split="parameters") for spec in out if spec["name"] in BY_PARAMS_OF
    ]
    # each rank and all its threads on one core of its own during the variant's windows (deepspeed's
    # --bind_cores_to_rank), paired round by round with the same variant unbound
    out += [
        dict(spec, name=spec["name"] + BOUND, bind_cores=True, optional=True)
        for spec in out
        if spec["name"] in BOUND_OF
    ]
    return out


class PlainBP:
    """Backprop on one worker: the same layers in an nn.Sequential, an optimizer step per micro-batch."""

    def __init__(self, model: str, optimizer: str = "sgd") -> None:
        torch.manual_seed(0)
        device = get_accelerator().current_device_name()  # the host on the CPU accelerator
        self.module = nn.Sequential(*build_layers(model)).to(device)
        self.loss_fn = loss_fn(model)
        self.optimizer_name = optimizer
        self.optimizer = optimizers.build(optimizer, self.module)
        self.data = itertools.cycle([(x.to(device), y.to(device)) for x, y in fixed_data(model)])
        self.stats: dict[str, float] = {k: 0.0 for k in COMPUTE_KINDS}
        self.stage_id = 0

    def unit(self) -> None:
        x, y = next(self.data)
        t0 = time.perf_counter()
        loss = self.loss_fn(self.module(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizers.clip(self.optimizer_name, self.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.stats["forward_s"] += t1 - t0
        self.stats["backward_s"] += t2 - t1
        self.stats["step_s"] += t3 - t2


class PlainHalves:
    """FDG's stages without a pipeline: each rank trains its stage of the FDG stored split in plain torch.

    Stage k < K-1 runs FDG's tick order: it back-propagates the forward of 2(K-1-k) ticks before with
    a fixed gradient (its activations held in flight meanwhile), steps, and forwards the newest
    micro-batch; the last stage trains on the activations the earlier layers give the fixed
    micro-batches. Nothing is exchanged and no rank waits for another, so a window's samples/s is
    what the two busy cores allow FDG's stages with no engine, no communication and no lock-step.

    ``recompute``: FDG's recomputed order instead (``activations: "recomputed"``): stage k < K-1 holds its
    input only, forwards with gradients enabled and drops the graph (Note [the recomputed forward runs as
    the first did]), and reruns the forward on the held input right before the delayed backward.

    ``exchange``: each tick also ends posting a tensor of the boundary activation's shape to the
    neighbour and receiving one (one ``batch_isend_irecv``, as the engine's tick), and the next tick
    waits for both first (``wait_s``): FDG's exchange and lock-step without its engine. ``"shm"``:
    the same messages through the library's shared-memory link (``pipeline.fdg.transport: "shm"``: no transport
    thread, one copy each way). ``optimizer``: which one each stage steps (:mod:`benchmarks.common.optimizers`),
    clipped by the stage's own norm as FDG clips.
    """

    def __init__(
        self,
        model: str,
        parts: list[int],
        exchange: bool | str = False,
        recompute: bool = False,
        optimizer: str = "sgd",
    ) -> None:
        torch.manual_seed(0)
        device = get_accelerator().current_device_name()
        self.stage_id = dist.get_rank()
        layers = build_layers(model)
        start, stop = parts[self.stage_id], parts[self.stage_id + 1]
        self.module = nn.Sequential(*layers[start:stop]).to(device)
        self.last = self.stage_id == STAGES - 1
        self.delay = 2 * (STAGES - 1 - self.stage_id)
        self.recompute = recompute
        self.loss_fn = loss_fn(model)
        self.optimizer_name = optimizer
        self.optimizer = optimizers.build(optimizer, self.module)
        earlier = nn.Sequential(*layers[:start]).to(device)
        with torch.no_grad():  # what this stage receives for each fixed micro-batch
            data = [(earlier(x.to(device)), y.to(device)) for x, y in fixed_data(model)]
        self.data = itertools.cycle(data)
        self.held: list[torch.Tensor] = []
        self.grad: torch.Tensor | None = None
        self.stats: dict[str, float] = {k: 0.0 for k in (*COMPUTE_KINDS, "wait_s")}
        # exchange: the boundary activation's shape both ways (activation down, its gradient up), as FDG's tick
        boundary = next(self.data)[0] if self.stage_id else earlier_boundary(layers, parts, data[0][0])
        self.buffers = (boundary.clone(), torch.empty_like(boundary)) if exchange else None
        self.works: list[Any] = []
        self.link = shared_memory_link(boundary) if exchange == "shm" else None
        self.ticks = 0

    def unit(self) -> None:
        if self.buffers is not None:
            start = time.perf_counter()
            for work in self.works:  # the neighbour's previous tick has posted
                work.wait()
            if self.link is not None and self.ticks:  # the neighbour's previous tick has sent
                self.link.receive([self.buffers[1]], TIMEOUT)
            self.stats["wait_s"] += time.perf_counter() - start
        x, y = next(self.data)
        t0 = time.perf_counter()
        if self.last:
            loss = self.loss_fn(self.module(x.detach().requires_grad_()), y)  # its input's gradient too, as sent
            t1 = time.perf_counter()
            loss.backward()
        else:
            t1 = t0
            if len(self.held) == self.delay:
                out = self.held.pop(0)
                if self.recompute:  # the held input's forward again, on the current weights
                    out = self.module(out)
                if self.grad is None:
                    self.grad = torch.full_like(out, 1e-4)
                out.backward(self.grad)
        t2 = time.perf_counter()
        optimizers.clip(self.optimizer_name, self.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if not self.last:
            if self.recompute:  # as the engine's recomputed forward: the input is held, the graph dropped
                with torch.enable_grad():
                    self.module(x).detach()
                self.held.append(x)
            else:  # as the engine's stored forward: the weights are read live at backward time
                with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    self.held.append(self.module(x))
            self.stats["forward_s"] += time.perf_counter() - t3
        self.stats["forward_s"] += t1 - t0
        self.stats["backward_s"] += t2 - t1
        self.stats["step_s"] += t3 - t2
        if self.buffers is not None:
            peer = 1 - self.stage_id
            send, recv = self.buffers
            self.ticks += 1
            if self.link is not None:
                self.link.send([send], TIMEOUT)
                return
            self.works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
            )


def shared_memory_link(like: torch.Tensor) -> Link:
    """The library's shared-memory link between the two ranks (Note [shared-memory transport]), slots the size of
    ``like``: rank 0 creates it, rank 1 joins it with the token and slot size rank 0 broadcasts."""
    created = Link.create(message_bytes([like])) if dist.get_rank() == 0 else None
    setup = torch.zeros(2, dtype=torch.int64) if created is None else torch.tensor([created.token, created.capacity])
    dist.broadcast(setup, 0)
    return created or Link.join(int(setup[0]), int(setup[1]), TIMEOUT)


def earlier_boundary(layers: list[Any], parts: list[int], x: torch.Tensor) -> torch.Tensor:
    """What the first stage sends: its layers' output on ``x`` (no autograd)."""
    with torch.no_grad():
        return nn.Sequential(*layers[: parts[1]])(x)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class DeepSpeedVariant:
    """A DeepSpeed pipeline engine (FDG, 1F1B or one-stage data parallel) on the fixed data, stepping ``optimizer``
    (:mod:`benchmarks.common.optimizers`: a client optimizer, or DeepSpeed's own from its config block for Muon)."""

    def __init__(
        self, spec: dict[str, Any], model: str, parts: list[int], host_memory: str = "retain", optimizer: str = "sgd"
    ) -> None:
        import deepspeed

        import fdg_schedule  # noqa: F401  (a "schedule": "fdg" config now builds the FDG engine)
        from fdg_schedule.zoo.resnet import SplitPipelineModule, parts_method

        torch.manual_seed(0)
        cfg = MODELS[model]
        module = SplitPipelineModule(
            layers=model_layers(model),
            num_stages=spec["stages"],
            loss_fn=loss_fn(model),
            partition_method=parts_method(parts),
        )
        # sgd: no clipping (it would add a cross-stage all-reduce to 1F1B); adamw / muon clip at 1.0 as the runs do
        entries, client = optimizers.deepspeed_entries(optimizer)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": cfg["micro"],
            "gradient_accumulation_steps": spec["gas"],
            **entries,
            "steps_per_print": 10**9,
        }
        if spec["kind"] == "fdg":
            fdg = {"grad_shrink": GRAD_SHRINK, "weights": spec["weights"], "activations": spec["activations"]}
            fdg.update(spec.get("corrections", {}))
            # named, not "auto": the variants without "_shm" are the process group's (Note [the fastest transport
            # by default]); the engine's host memory follows the benchmark's --freed-memory, process-wide alike
            fdg["transport"] = spec.get("transport", "process_group")
            fdg["host_memory"] = host_memory
            config["pipeline"] = {"schedule": "fdg", "fdg": fdg}
        self.engine, *_ = deepspeed.initialize(
            model=module,
            config=config,
            optimizer=client,
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
        """Time DeepSpeed's handlers by kind, through the package's public hook (``dispatch.observe``)."""
        from deepspeed.runtime.pipe import schedule as s

        from fdg_schedule.base.dispatch import observe

        kinds = {
            s.ForwardPass: "forward_s", s.BackwardPass: "backward_s", s.OptimizerStep: "step_s",
            s.ReduceGrads: "reduce_s", s.ReduceTiedGrads: "reduce_s", s.LoadMicroBatch: "load_s",
            s.SendActivation: "wait_s", s.RecvActivation: "wait_s", s.SendGrad: "wait_s", s.RecvGrad: "wait_s",
        }  # fmt: skip
        stats = self._stats = {k: 0.0 for k in set(kinds.values())}

        def count(view: Any, cmd: Any, start: float, end: float) -> None:
            kind = kinds.get(type(cmd))
            if kind is not None:
                stats[kind] += end - start

        observe(self.engine, count)


Variant = PlainBP | PlainHalves | DeepSpeedVariant


def build_variant(
    spec: dict[str, Any], model: str, splits: dict[str, list[int]], host_memory: str = "retain", optimizer: str = "sgd"
) -> Variant | None:
    """This rank's part of ``spec`` (None: this rank sits the variant out); ``host_memory``: what the benchmark's
    processes do with freed memory ("retain" or "system"), which FDG's engine is told too; ``optimizer``: the one
    every variant steps (:mod:`benchmarks.common.optimizers`)."""
    if spec["kind"] == "bp":
        return PlainBP(model, optimizer) if dist.get_rank() == 0 else None
    if spec["kind"] == "halves":
        recompute = spec.get("activations") == "recomputed"
        exchange = spec.get("exchange", False)
        return PlainHalves(model, splits[split_key(spec)], exchange=exchange, recompute=recompute, optimizer=optimizer)
    parts = splits[split_key(spec)] if spec["stages"] > 1 else [0, len(model_layers(model))]
    return DeepSpeedVariant(spec, model, parts, host_memory, optimizer)
