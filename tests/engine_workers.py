"""Rank-side code of the distributed engine tests: build real DeepSpeed pipeline engines and train.

Kept free of ``fdg_schedule`` imports at module level so a worker can run stock DeepSpeed with the
package never imported.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import toy
from deepspeed.pipe import PipelineModule

# The pipeline.fdg keys a test case may set (the same keys build the reference's FDGConfig).
FDG_KEYS = (
    "grad_shrink", "weights", "activations", "accumulate", "delay_lr_ticks", "predict_decay", "delay_momentum",
    "delay_momentum_peak_lr", "predict_horizon", "delay_momentum_raise", "predict_scale", "predict_momentum",
    "staleness_every",
    "check_every", "nonfinite", "transport", "corrections", "host_memory",
)  # fmt: skip


def ds_config(case: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": case.get("micro", 4),
        "gradient_accumulation_steps": case.get("gas", 3),
        "gradient_clipping": case.get("clip", 0.0),
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if case.get("schedule", "fdg") == "fdg":
        fdg = {k: case[k] for k in FDG_KEYS if k in case}
        cfg["pipeline"] = {"schedule": "fdg", "fdg": fdg}
    elif case.get("schedule") == "1f1b":
        cfg["pipeline"] = {"schedule": "1f1b"}
    if case.get("zero"):
        cfg["zero_optimization"] = {"stage": case["zero"]}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if case.get("grad_accum_dtype"):  # bf16 + ZeRO-1 with fp32 accumulation: DeepSpeed's BF16_Optimizer
        cfg["data_types"] = {"grad_accum_dtype": case["grad_accum_dtype"]}
    if case.get("wall_clock"):  # DeepSpeed's timers: started by its output hooks, printed every step
        cfg["wall_clock_breakdown"] = True
        cfg["steps_per_print"] = 1
    if case.get("flops_file"):  # DeepSpeed's flops profiler, at one tick
        cfg["flops_profiler"] = {"enabled": True, "profile_step": 4, "output_file": case["flops_file"]}
    if case.get("cosine_steps"):  # DeepSpeed's WarmupCosineLR: a run of that many scheduler steps
        cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": case["cosine_steps"]}}
    if case.get("warmup"):
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": case["lr"], "warmup_num_steps": case["warmup"]},
        }
    return cfg


def make_optimizer(case: dict[str, Any]):
    lr = case.get("lr", 0.1)
    if case.get("optimizer", "sgd") == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr * 0.1)
    if case.get("optimizer") == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr * 0.1, weight_decay=0.01)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def shard(batch: tuple[torch.Tensor, torch.Tensor], dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    n = x.shape[0] // dp
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


def build(case: dict[str, Any], world: int, import_fdg: bool = True):
    if import_fdg:
        import fdg_schedule  # noqa: F401  (selects the engine from the config)
    # Without the import: DeepSpeed's own initialize, also where the installed start-up hook wrapped it.
    stock = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
    initialize = deepspeed.initialize if import_fdg else stock
    stages = case["stages"]
    if case.get("tied"):  # an embedding tied to the head ("three": and a key with a copy on 3 stages)
        layers = toy.tied_layers(three_owners=case["tied"] == "three")
    else:
        layers = toy.layers(batch_norm=case.get("batch_norm", False), dropout=case.get("dropout"))
    model = PipelineModule(
        layers=layers,
        num_stages=stages,
        loss_fn=toy.loss_fn,
        partition_method="uniform",
        activation_checkpoint_interval=case.get("checkpoint_interval", 0),
    )
    kwargs: dict[str, Any] = {}
    dp = world // stages
    data = [shard(b, model._grid.data_parallel_id, dp) for b in toy.micro_batches(case["n"], 4 * dp)]
    if case.get("bf16"):  # DeepSpeed expects first-stage inputs in the training precision
        data = [(x.to(torch.bfloat16), y) for x, y in data]
    if case.get("training_data"):
        kwargs["training_data"] = torch.utils.data.TensorDataset(
            torch.cat([x for x, _ in toy.micro_batches(case["n"], 4 * dp)]),
            torch.cat([y for _, y in toy.micro_batches(case["n"], 4 * dp)]),
        )
    if case.get("ds_optimizer"):
        ds_cfg = ds_config(case)
        if case["ds_optimizer"] is True:
            ds_cfg["optimizer"] = {"type": "SGD", "params": {"lr": case.get("lr", 0.1), "momentum": 0.9}}
        elif case["ds_optimizer"] in toy.DS_OPTIMIZERS:  # Muon (its Muon and Adam halves), Lion
            name = case["ds_optimizer"]
            ds_cfg["optimizer"] = {"type": name, "params": dict(toy.DS_OPTIMIZERS[name])}
            if name == "Lion":  # DeepSpeed has no CPU FusedLion: its CPU Lion runs offloaded
                ds_cfg["zero_optimization"] = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
        else:  # another type DeepSpeed builds ("Adam": FusedAdam on the CPU)
            ds_cfg["optimizer"] = {"type": case["ds_optimizer"], "params": {"lr": case.get("lr", 0.1) * 0.1}}
        engine, *_ = initialize(model=model, config=ds_cfg, model_parameters=model.parameters(), **kwargs)
    else:
        params: Any = model.parameters()
        if case.get("param_groups"):  # two groups, the second with weight decay; the tied copies at inner slots
            ps = list(model.parameters())
            params = [{"params": ps[1::2]}, {"params": ps[0::2], "weight_decay": 0.1}]
        engine, *_ = initialize(
            model=model,
            config=ds_config(case),
            optimizer=make_optimizer(case),
            model_parameters=params,
            **kwargs,
        )
    return engine, model, data


class _Warnings(logging.Handler):
    """DeepSpeed's logger's warnings while installed (``with _Warnings() as w: ...; w.messages``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Warnings:
        from deepspeed.utils import logger

        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        from deepspeed.utils import logger

        logger.removeHandler(self)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stage's weights and buffers, in fp32, in host memory (compared with the reference there)."""
    host = torch.device("cpu")
    return {
        k: (v.detach().float() if v.is_floating_point() else v.detach()).to(host, copy=True)
        for k, v in model.state_dict().items()
    }


def _optimizer_state(engine: Any, model: torch.nn.Module) -> dict[str, dict[str, Any]] | None:
    """Every parameter's optimizer state by name, the tied copies' from their tied optimizer under FDG. Under a
    bf16/ZeRO-1 wrapper each parameter's slice of the flat state ("fp32": its fp32 weight; "step": its group's;
    a collective of the data-parallel group)."""
    copies = {id(c.tie.param): c for c in getattr(getattr(engine, "_tied", None), "copies", [])}
    wrapped = engine.optimizer is not engine.basic_optimizer
    if wrapped:  # link each parameter's slice of the flat state (DeepSpeed does it at its first step, not a load)
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in model.named_parameters():
        c = copies.get(id(p))
        group = next((g for g in engine.optimizer.param_groups if wrapped or any(q is p for q in g["params"])), None)
        if c is not None:
            state = dict(c.optimizer.state.get(c.master, {}))
            group = c.optimizer.param_groups[0]
            if wrapped:
                state["fp32"] = c.master
        elif wrapped:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            index = next(i for i, g in enumerate(_flat_groups(engine.optimizer)) if any(q is p for q in g))
            group = engine.optimizer.param_groups[index]
            flat = engine.optimizer.optimizer.state.get(group["params"][0], {})
            state = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq") if k in flat}
            state["fp32"] = safe_get_full_fp32_param(p)
            if "step" in flat:
                state["step"] = flat["step"]
        else:
            state = dict(engine.optimizer.state.get(p, {}))
        settings = None if group is None else {k: v for k, v in group.items() if k != "params"}
        state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
        out[name] = {"state": state, "settings": settings}
    return out


def _flat_groups(wrapper: Any) -> list[list[torch.Tensor]]:
    """The parameters of each param group of DeepSpeed's bf16 or ZeRO-1 wrapper."""
    return getattr(wrapper, "bf16_groups", None) or wrapper.bit16_groups


def train(rank: int, world: int, cases: list[dict[str, Any]], import_fdg: bool = True) -> list[dict[str, Any]]:
    """Train each case; record the stage's weights and returned loss after every call."""
    out = []
    for case in cases:
        with toy.newton_schulz_dtype(case):
            out.append(_train_one(case, world, import_fdg))
    return out


def _train_one(case: dict[str, Any], world: int, import_fdg: bool) -> dict[str, Any]:
    torch.manual_seed(1234)
    engine, model, data = build(case, world, import_fdg)
    it = iter(data)
    states, losses, staleness = [], [], []
    for call in range(case["calls"]):
        if case.get("training_data"):
            losses.append(engine.train_batch().item())
        else:
            losses.append(engine.train_batch(it).item())
        if case.get("drain_each_call"):
            engine.drain()
        states.append(_state(model))
        staleness.append(getattr(engine, "fdg_stats", {}).get("staleness"))
        if case.get("eval_between") and call == 1:
            engine.eval_batch(iter(toy.micro_batches(case.get("gas", 3), 4 * (world // case["stages"]), seed=9)))
    if case.get("drain"):
        losses.append(engine.drain().item())
        states.append(_state(model))
    return {
        "engine": type(engine).__name__,
        "parts": model.parts,
        "stage_id": engine.stage_id,
        "dp_id": model._grid.data_parallel_id,
        "states": states,
        "losses": losses,
        "staleness": staleness,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "lr": engine.get_lr()[0] if engine.lr_scheduler is not None else None,
        "in_flight": getattr(engine, "in_flight", lambda: None)(),
        "grad_norm": engine.get_global_grad_norm(),
        "running_timers": [n for n in engine.engine_timers.active_timers() if engine.timers(n).started_],
        "links": _links(engine),
    }


def _links(engine: Any) -> list[str]:
    """The sides on which an FDG stage has a shared-memory link (Note [shared-memory transport])."""
    exchange = getattr(engine, "_exchange", None)
    return [] if exchange is None else sorted(side for side, link in exchange.links.items() if link is not None)


# -- collective tracing -------------------------------------------------------------------------

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "barrier", "reduce", "all_to_all_single", "gather", "scatter")  # fmt: skip


def trace_collectives(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train a few calls, then record every collective (and its group's ranks) in steady state."""
    engine, model, data = build(case, world, import_fdg=case.get("schedule", "fdg") == "fdg")
    it = iter(data)
    for _ in range(2):  # fill
        engine.train_batch(it)
    seen: list[tuple[str, list[int]]] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def traced(*args, **kwargs):
            group = kwargs.get("group")
            ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
            seen.append((name, ranks))
            return fn(*args, **kwargs)

        return traced

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        for _ in range(2):
            engine.train_batch(it)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    dp_group = dist.get_process_group_ranks(model._grid.get_data_parallel_group())
    return {"seen": seen, "dp_group": dp_group, "stage_id": engine.stage_id}


def bad_config(rank: int, world: int, case: dict[str, Any], tied_layers: bool | str = False) -> dict[str, Any]:
    """Try to build an engine that must be refused; report the error and how long it took."""
    import fdg_schedule

    start = time.monotonic()
    try:
        if tied_layers == "only":  # stage 0 holds nothing but the tied embedding
            from deepspeed.pipe import TiedLayerSpec

            emb = TiedLayerSpec("emb", toy.TiedWeight, toy.IN, toy.HIDDEN, 11)
            head = TiedLayerSpec("emb", toy.TiedWeight, toy.IN, toy.HIDDEN, 11, forward_fn=toy.head)
            layers = [emb, torch.tanh, toy.SeededLinear(toy.HIDDEN, toy.HIDDEN, 2), head]
            model = PipelineModule(layers=layers, num_stages=2, loss_fn=toy.loss_fn, partition_method="uniform")
        elif tied_layers:
            from deepspeed.pipe import TiedLayerSpec

            tied = TiedLayerSpec("emb", toy.SeededLinear, toy.IN, toy.IN, 1)
            layers = [tied, toy.SeededLinear(toy.IN, toy.IN, 2), tied, toy.SeededLinear(toy.IN, 3, 3)]
            model = PipelineModule(layers=layers, num_stages=2, loss_fn=toy.loss_fn, partition_method="uniform")
        else:
            model = PipelineModule(layers=toy.layers(), num_stages=case["stages"], loss_fn=toy.loss_fn)
        cfg = case["config"]
        deepspeed.initialize(model=model, config=cfg, optimizer=make_optimizer({}), model_parameters=model.parameters())
    except fdg_schedule.FDGConfigError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


# -- checkpoints ----------------------------------------------------------------------------------


def resume(rank: int, world: int, cases: list[dict[str, Any]], root: str, phase: str) -> list[dict[str, Any]]:
    """phase "straight": train, save at tick T without draining, keep training.
    phase "resumed": a new process loads the checkpoint, restarts the data at micro-batch T, trains."""
    from fdg_schedule import DataExhausted

    out = []
    for i, case in enumerate(cases):
        torch.manual_seed(1234)
        engine, model, data = build(case, world)
        data = data[: case.get("limit", len(data))]  # "limit": the data ends after that many micro-batches
        save_dir = f"{root}/case{i}"
        before, after = case["calls_before"], case["calls_after"]
        module_only: dict[str, Any] = {}
        save_warnings: list[str] = []
        if phase == "straight":
            it = iter(data)
            for _ in range(before):
                engine.train_batch(it) if not case.get("training_data") else engine.train_batch()
            with _Warnings() as saved:
                engine.save_checkpoint(save_dir, drain=case.get("drain_save", False))
            save_warnings = saved.messages
            after_load = _state(model)  # the weights at the save, which the resumed run loads
        else:
            torch.manual_seed(999)  # the resumed run must not depend on the process's own RNG
            if case.get("module_only_first"):  # weights only: nothing in flight, RNG and data untouched
                rng = torch.get_rng_state()
                engine.load_checkpoint(save_dir, load_module_only=True)
                rng_kept = torch.equal(rng, torch.get_rng_state())
                module_only = {"state": _state(model), "in_flight": engine.in_flight(),
                               "read": engine.micro_batches_read, "rng_kept": rng_kept}  # fmt: skip
            engine.load_checkpoint(save_dir)
            after_load = _state(model)
            if module_only:
                module_only["full_state"] = _state(model)
            it = iter(data[engine.micro_batches_read :])  # the user restarts the data at micro-batch T
        losses, exhausted = [], False
        for _ in range(after):
            try:
                losses.append(
                    engine.train_batch(it).item() if not case.get("training_data") else engine.train_batch().item()
                )
            except DataExhausted as ended:
                losses.append(float(ended.loss))
                exhausted = True
                break
        losses.append(engine.drain().item())
        out.append({"state": _state(model), "losses": losses, "global_steps": engine.global_steps,
                    "stage_id": engine.stage_id, "exhausted": exhausted, "module_only": module_only,
                    "after_load": after_load, "save_warnings": save_warnings})  # fmt: skip
    return out


def swap(rank: int, world: int, case: dict[str, Any], save_dir: str, phase: str) -> dict[str, Any]:
    """Save with one schedule / stage count, load with another; report weights and errors."""
    import fdg_schedule

    torch.manual_seed(1234)
    engine, model, data = build(case, world)
    it = iter(data)
    if phase == "save":
        for _ in range(2):
            engine.train_batch(it)
        with _Warnings() as saved:
            if case.get("drain_save") and case.get("schedule") == "fdg":
                engine.save_checkpoint(save_dir, drain=True)
            else:
                engine.save_checkpoint(save_dir)
        fdg_state = getattr(engine, "fdg_state", None)
        return {"state": _state(model), "engine": type(engine).__name__, "optim": _optimizer_state(engine, model),
                "optimizer": type(engine.optimizer).__name__, "save_warnings": saved.messages,
                "tick": None if fdg_state is None else fdg_state.tick,
                "delta": None if fdg_state is None else fdg_state.corrections.capture()}  # fmt: skip
    error = None
    try:
        engine.load_checkpoint(save_dir)
    except fdg_schedule.FDGConfigError as err:
        error = str(err)
        engine.load_checkpoint(save_dir, load_optimizer_states=False, load_lr_scheduler_states=False)
    except Exception as err:  # noqa: BLE001 - stock DeepSpeed's own refusal (1F1B), reported
        if case.get("schedule") != "1f1b":
            raise
        error = f"{type(err).__name__}: {err}"
        engine.load_checkpoint(save_dir, load_optimizer_states=False, load_lr_scheduler_states=False)
    state, optim = _state(model), _optimizer_state(engine, model)
    fdg_state = getattr(engine, "fdg_state", None)  # what an FDG job continues with: tick and delta
    tick = None if fdg_state is None else fdg_state.tick
    delta = None if fdg_state is None else fdg_state.corrections.capture()
    engine.train_batch(it)  # and it trains on
    after = _state(model)
    return {"state": state, "error": error, "engine": type(engine).__name__, "stage_id": engine.stage_id,
            "optimizer": type(engine.optimizer).__name__,
            "optim": optim, "after": after,
            "tick": tick, "delta": delta}  # fmt: skip


# -- failures -------------------------------------------------------------------------------------


class Saboteur(torch.nn.Module):
    """Identity until its ``trigger``-th forward, then dies, raises, hangs (sleeps ``hang_s``) or returns inf
    (only on ``ranks``)."""

    def __init__(self, trigger: int, how: str, ranks: list[int] | None = None, hang_s: float = 30.0) -> None:
        super().__init__()
        self.trigger, self.how, self.calls, self.ranks, self.hang_s = trigger, how, 0, ranks, hang_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ranks is not None and dist.get_rank() not in self.ranks:
            return x
        self.calls += 1
        if self.calls == self.trigger:
            if self.how == "die":
                import os

                os._exit(3)
            if self.how == "raise":
                raise ValueError("boom in a layer of stage 1")
            if self.how == "hang":
                time.sleep(self.hang_s)
        if self.how == "inf" and self.calls >= self.trigger:
            return x * float("inf")
        return x


def failure(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """K=2 (world/2 data-parallel replicas); stage 1 misbehaves at its ``trigger``-th forward (on
    ``ranks`` only, when given); replica r reads ``lengths[r]`` micro-batches. Report how this rank ended."""
    import fdg_schedule

    layers = toy.layers()
    saboteur = Saboteur(case["trigger"], case["how"], case.get("ranks"), case.get("hang_s", 30.0))
    layers.insert(8, saboteur)  # on the last stage, before the output layer
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=toy.loss_fn, partition_method="uniform")
    cfg = ds_config({"gas": 2, "grad_shrink": 0.5, "transport": case.get("transport", "process_group")})
    cfg["pipeline"]["fdg"].update(timeout=case.get("timeout", 60), nonfinite=case.get("nonfinite", "error"))
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=make_optimizer({}),
                                      model_parameters=model.parameters())  # fmt: skip
    it = iter(toy.micro_batches(case.get("lengths", {}).get(model._grid.data_parallel_id, 40), 4))
    start = time.monotonic()
    try:
        for _ in range(case.get("calls", 6)):
            engine.train_batch(it)
    except (fdg_schedule.FDGRuntimeError, ValueError, fdg_schedule.DataExhausted) as err:
        error = f"{type(err).__name__}: {err}" if isinstance(err, StopIteration) else str(err)
        return {"error": error, "seconds": time.monotonic() - start, "stage_id": engine.stage_id}
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"error": None, "skipped": engine.fdg_stats["skipped"], "steps": engine.fdg_stats["steps"],
            "finite": finite, "stage_id": engine.stage_id, "skipped_steps": engine.skipped_steps}  # fmt: skip


def data_end(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train until the data iterator runs out; every rank must end with DataExhausted, drained."""
    from fdg_schedule import DataExhausted

    engine, model, data = build(case, world)
    it = iter(data[: case["limit"]])
    calls = 0
    try:
        while True:
            engine.train_batch(it)
            calls += 1
    except DataExhausted as ended:
        last_loss = float(ended.loss)
    return {"state": _state(model), "calls": calls, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "in_flight": engine.in_flight(), "last_loss": last_loss,
            "stage_id": engine.stage_id, "parts": model.parts}  # fmt: skip


BAD_INPUT_TIMEOUT_S = 5  # pipeline.fdg.timeout of bad_input: how long the neighbour of the failing rank waits


def bad_input(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Run a K=2 job with one bad input; report the error each rank ended with."""
    import fdg_schedule

    start = time.monotonic()
    case = {"stages": 2, "n": 8, "gas": 2, "bf16": kind == "bf16_inputs"}
    try:
        cfg = ds_config(case)
        cfg["pipeline"]["fdg"]["timeout"] = BAD_INPUT_TIMEOUT_S
        layers = toy.layers()
        if kind == "more_stages_than_layers":
            layers = [toy.SeededLinear(toy.IN, toy.CLASSES, 1)]
        if kind == "no_grad_activation":  # stage 0 holds a frozen layer: its output does not require grad
            frozen = toy.SeededLinear(toy.IN, toy.HIDDEN, 1).requires_grad_(False)
            layers = [frozen, torch.tanh, toy.SeededLinear(toy.HIDDEN, toy.CLASSES, 2)]
        if kind == "batch_size_mismatch":
            cfg["train_batch_size"] = 16
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=toy.loss_fn, partition_method="uniform")
        engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=make_optimizer({}),
                                          model_parameters=model.parameters())  # fmt: skip
        data = toy.micro_batches(8, 4)
        if kind == "labels_dtype":
            data = [(x, y.float()) for x, y in data]
        if kind == "bf16_inputs":
            data = [(x.float(), y) for x, y in data]
        if kind == "shape_change":
            data[3] = (data[3][0][:3], data[3][1][:3])
        it = iter(data)
        for _ in range(3):
            engine.train_batch() if kind == "no_data" else engine.train_batch(it)
    except (fdg_schedule.FDGConfigError, fdg_schedule.FDGRuntimeError, AssertionError) as err:
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def soak(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Many ticks on a repeating data set: record what is held for delayed backward and the RSS."""
    import resource

    from deepspeed.utils import RepeatingLoader

    engine, model, data = build(case, world)
    it = iter(RepeatingLoader(data))
    held, in_flight, rss = [], [], []
    for _ in range(case["ticks"] // case["gas"]):
        engine.train_batch(it)
        held.append(engine.held_bytes())
        in_flight.append(engine.in_flight())
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB, peak so far
    return {"held": held, "in_flight": in_flight, "rss_kib": rss, "stage_id": engine.stage_id,
            "ticks": engine.global_steps}  # fmt: skip


def interrupted_save(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """Save once, then die on rank 1 in the middle of the second save; rank 0 must not move `latest`."""
    import os

    engine, model, data = build({"stages": 2, "n": 16, "gas": 2}, world)
    it = iter(data)
    engine.train_batch(it)
    engine.save_checkpoint(save_dir, tag="first")
    engine.train_batch(it)
    if rank == 1:
        model.save_state_dict = lambda *args, **kwargs: os._exit(5)  # killed while writing its layer files
    try:
        engine.save_checkpoint(save_dir, tag="second")
    except Exception as err:  # noqa: BLE001 - the neighbour vanished mid-save
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}


# -- host reads during ticks ------------------------------------------------------------------------

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


def host_reads(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill the pipeline, then record every host read of a tensor made inside the next calls' ticks.

    Every method in HOST_READS is patched on ``torch.Tensor`` while ``_exec_schedule`` runs (the
    ticks; not the call's end, where the flags are read). ``guards.read_host`` -- the exchange's one
    sanctioned read, of the control word in host memory -- is counted separately with what it read.
    Not recorded: reads of torch optimizers' ``step`` counters, which torch keeps in host memory on
    every device (unless ``capturable``) precisely so that reading them never synchronises.
    """
    out = []
    for case in cases:
        torch.manual_seed(1234)
        engine, model, data = build(case, world)
        it = iter(data)
        for _ in range(2):  # fill: the first tick's header is exchanged once
            engine.train_batch(it)
        out.append({**_recorded_calls(engine, it, case.get("measured_calls", 2)), "stage_id": engine.stage_id})
    return out


def _copy_target(args: tuple, kwargs: dict[str, Any]) -> torch.device | None:
    """The device a ``Tensor.to(...)`` call copies to (None: a dtype change only)."""
    target = kwargs.get("device")
    if target is None and args:
        target = args[0].device if torch.is_tensor(args[0]) else args[0]
    return torch.device(target) if isinstance(target, (torch.device, str, int)) else None


def _recorded_calls(engine: Any, it: Any, calls: int) -> dict[str, Any]:
    """Also recorded: every ``Tensor.to`` to the stage's device, from host memory, in FDG's or DeepSpeed's code,
    without ``non_blocking=True`` (on a GPU each waits for the stage's queue; on the CPU the same calls are made,
    as no-op copies). Not recorded: torch's own (its clipping moves norms between devices: on a GPU, device
    tensors to the device)."""
    import os
    import sys
    import traceback

    from fdg_schedule.exchange import comm

    host_kept = {id(s["step"]) for s in engine.optimizer.state.values() if torch.is_tensor(s.get("step"))}
    recording = [False]
    seen: list[tuple[str, str]] = []
    control_words: list[tuple[tuple[int, ...], str]] = []
    originals = {name: getattr(torch.Tensor, name) for name in (*HOST_READS, "to")}

    def wrap(name, fn):
        def recorded(self, *args, **kwargs):
            if name == "to":
                blocking = not (kwargs.get("non_blocking") or True in args[1:])
                caller = sys._getframe(1).f_code.co_filename.split(os.sep)
                ours = "fdg_schedule" in caller or "deepspeed" in caller
                if recording[0] and ours and blocking and self.is_cpu and _copy_target(args, kwargs) == engine.device:
                    seen.append(("to", "".join(traceback.format_stack(limit=8)[:-1])))
            elif recording[0] and id(self) not in host_kept:
                seen.append((name, "".join(traceback.format_stack(limit=8)[:-1])))
            return fn(self, *args, **kwargs)

        return recorded

    sanctioned = comm.read_host

    def read_control_word(t):
        control_words.append((tuple(t.shape), str(t.dtype)))
        recording[0] = False
        try:
            return sanctioned(t)
        finally:
            recording[0] = True

    run_ticks = engine._exec_schedule

    def ticks_recorded(plan):
        recording[0] = True
        try:
            run_ticks(plan)
        finally:
            recording[0] = False

    engine._exec_schedule = ticks_recorded
    comm.read_host = read_control_word
    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        ticks_before = engine.global_steps
        for _ in range(calls):
            engine.train_batch(it)
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        comm.read_host = sanctioned
    return {"seen": seen, "control_words": control_words, "ticks": engine.global_steps - ticks_before}


def auto_resume_refused(rank: int, world: int, saved: dict[str, Any], loaded: dict[str, Any], root: str) -> str:
    """Train ``saved`` one call and save; build ``loaded`` and load that checkpoint: the error raised ("" if none)."""
    import fdg_schedule

    engine, _, data = build(saved, world)
    engine.train_batch(iter(data))
    engine.save_checkpoint(root)
    engine, _, _ = build(loaded, world)
    try:
        engine.load_checkpoint(root)
    except fdg_schedule.FDGConfigError as err:
        return str(err)
    return ""


# -- waits between calls ----------------------------------------------------------------------------


def waits_between_calls(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Note [no wait between calls]: count the exchange's blocking operations inside and outside the ticks.

    After two calls that fill the pipeline, each further call is split at the dispatch loop (``_exec_schedule``):
    ``inside`` counts ``NeighbourExchange.waits`` while the ticks run, ``outside`` everything else from the end of
    one call's ticks to the start of the next call's (the call's end, the caller's loop, the next call's start).
    """
    out = []
    for case in cases:
        torch.manual_seed(1234)
        engine, _, data = build(case, world)
        it = iter(data)
        for _ in range(2):
            engine.train_batch(it)
        exchange = engine._exchange
        inside, marks = [0], [exchange.waits]
        run_ticks = engine._exec_schedule

        def counted(plan, run_ticks=run_ticks, exchange=exchange, inside=inside, marks=marks):
            marks.append(exchange.waits)  # the end of the previous call's ticks up to here: outside
            run_ticks(plan)
            inside[0] += exchange.waits - marks[-1]
            marks.append(exchange.waits)

        engine._exec_schedule = counted
        for _ in range(case.get("measured_calls", 3)):
            engine.train_batch(it)
        marks.append(exchange.waits)
        outside = sum(b - a for a, b in zip(marks[0::2], marks[1::2]))
        from fdg_schedule.base import host_memory

        out.append({"stage_id": engine.stage_id, "transport": exchange.transport, "inside": inside[0],
                    "outside": outside, "host_memory": host_memory.describe(), "lent": exchange.lent,
                    "still_lent": sorted(exchange._lent)})  # fmt: skip
    return out


def start_warnings(rank: int, world: int, case: dict[str, Any]) -> list[str]:
    """Build ``case``'s engine: the warnings ``fdg_schedule``'s loggers gave on this rank while it started."""
    log = logging.getLogger("fdg_schedule")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        build(case, world)
    finally:
        log.removeHandler(handler)
    return seen
