"""Rank functions for tests/test_torch_pipelining.py: ScheduleFDG on real gloo ranks with a small MLP.

Every rank builds the whole model from one seed and keeps its stage's slice, so the ranks and
:func:`fdg_schedule.fdg_reference` (which gets all slices) start from the same weights.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

SIZE, DIM, HIDDEN, CLASSES = 6, 4, 8, 3  # micro-batch size, input width, hidden width, classes


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES),
    )  # fmt: skip


def stages(K: int, seed: int = 0) -> list[nn.Module]:
    """The model cut into K consecutive stages (K = 2 or 3)."""
    m = model(seed)
    cuts = {2: [(0, 4), (4, 7)], 3: [(0, 2), (2, 4), (4, 7)]}[K]
    return [copy.deepcopy(m[a:b]) for a, b in cuts]


def micro_batches(count: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(SIZE, DIM, generator=g), torch.randint(0, CLASSES, (SIZE,), generator=g)) for _ in range(count)
    ]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _state(module: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def build(rank: int, world: int, case: dict[str, Any]) -> tuple[Any, nn.Module, Any]:
    """This rank's stage, module and schedule: K = world / dp stages, replicas of a stage side by side."""
    from torch.distributed.pipelining import PipelineStage

    from fdg_schedule.torch_pipelining import ScheduleFDG

    dp = case.get("dp", 1)
    K = world // dp
    stage_index, replica = rank // dp, rank % dp
    pp_groups = [dist.new_group([s * dp + r for s in range(K)]) for r in range(dp)]
    dp_groups = [dist.new_group([s * dp + r for r in range(dp)]) for s in range(K)]
    module = stages(K, case.get("seed", 0))[stage_index]
    if case.get("scaled"):
        module = Scaled(module)
    if case.get("saboteur"):
        module = nn.Sequential(module, Saboteur(**case["saboteur"]))
    stage = PipelineStage(module, stage_index, K, torch.device("cpu"), group=pp_groups[replica])
    opt = make_optimizer(case.get("optimizer", "sgd"), module.parameters())
    scheduler = None
    if case.get("scheduler"):
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    schedule = ScheduleFDG(
        stage, case["n"], F.cross_entropy, opt, lr_scheduler=scheduler, clip_grad_norm=case.get("clip", 0.0),
        dp_group=dp_groups[stage_index] if dp > 1 else None, **case.get("fdg", {}),
    )  # fmt: skip
    return stage, module, schedule


def _batch(data: list[tuple[Tensor, Tensor]], call: int, n: int, replica: int, shard: bool) -> tuple[Tensor, Tensor]:
    part = data[call * n : (call + 1) * n]
    xs, ys = [x for x, _ in part], [y for _, y in part]
    if shard:  # replica r takes its half of every micro-batch
        half = SIZE // 2 if replica == 0 else SIZE - SIZE // 2
        start = 0 if replica == 0 else SIZE // 2
        xs, ys = [x[start : start + half] for x in xs], [y[start : start + half] for y in ys]
    return torch.cat(xs), torch.cat(ys)


class Scaled(nn.Module):
    """A stage whose output is multiplied by a keyword input ``scale``, one per micro-batch (as torchtitan passes
    ``attention_masks`` to every stage)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor, scale: Tensor | None = None) -> Tensor:
        out = self.inner(x)
        return out if scale is None else out * scale


class ScaledInTurn(nn.Module):
    """The reference's side of :class:`Scaled`: each forward takes the next micro-batch's scale (stored modes
    only, where every micro-batch is forwarded once per stage, in order)."""

    def __init__(self, inner: nn.Module, scales: list[Tensor]) -> None:
        super().__init__()
        self.inner, self.scales = inner, list(scales)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * self.scales.pop(0)


def scales(case: dict[str, Any]) -> list[Tensor]:
    """Micro-batch b's ``scale``: 0.5 + 0.1 b in every row."""
    steps = sum(c == "step" for c in plan(case))
    return [torch.full((SIZE, 1), 0.5 + 0.1 * b) for b in range(steps * case["n"])]


def plan(case: dict[str, Any]) -> list[str]:
    """The calls a case makes, in order: ``"step"`` (``n`` new micro-batches) or ``"drain"``."""
    return case.get("plan", ["step"] * case.get("calls", 3) + ["drain"])


def train(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The calls of :func:`plan` on this rank's stage.

    Returns this stage's state after every tick and the losses each call gave back."""
    stage, module, schedule = build(rank, world, case)
    states: list[dict[str, Tensor]] = []
    schedule.on_tick = lambda tick: states.append(_state(module))
    losses_per_call = run_plan(rank, stage, schedule, case, plan(case))
    if case.get("barrier", True):  # a rank ending undrained leaves sends to neighbours that may still be posting
        dist.barrier()
    return {"stage": stage.stage_index, "states": states, "losses": losses_per_call,
            "in_flight": schedule.in_flight_micro_batches()}  # fmt: skip


def run_plan(rank: int, stage: Any, schedule: Any, case: dict[str, Any], calls: list[str], first: int = 0) -> list:
    """Make ``calls``; the ``first`` step call reads the data's ``first``-th slice of n micro-batches."""
    dp = case.get("dp", 1)
    steps = sum(c == "step" for c in plan(case))
    data = micro_batches(steps * case["n"], case.get("data_seed", 1))
    losses_per_call: list[list[float]] = []
    call = first
    for what in calls:
        losses: list[Tensor] = []
        if what == "drain":
            schedule.drain(losses=losses)
        else:
            x, y = _batch(data, call, case["n"], rank % dp, case.get("shard", False))
            if case.get("bad") == "short_batch" and call == 1:
                x = x[:-1]  # the last micro-batch of the call is one row short
            if case.get("bad") == "float_labels" and call == 1:
                y = y.float()
            kwargs = (
                {"scale": torch.cat(scales(case)[call * case["n"] : (call + 1) * case["n"]])}
                if case.get("scaled")
                else {}
            )
            call += 1
            if stage.is_first:
                schedule.step(x, target=y if stage.is_last else None, losses=losses, **kwargs)
            elif stage.is_last:
                schedule.step(target=y, losses=losses, **kwargs)
            else:
                schedule.step(**kwargs)
        losses_per_call.append([float(v) for v in losses])
    return losses_per_call


def resume(rank: int, world: int, case: dict[str, Any], root: str, phase: str) -> dict[str, Any]:
    """``phase`` "save": the plan's first ``save_after`` calls, a DCP checkpoint, the rest; "load": a new
    schedule from the checkpoint, the rest. Returns the states after every tick and the losses of the rest."""
    from fdg_schedule.torch_pipelining import load_checkpoint, save_checkpoint

    stage, module, schedule = build(rank, world, case)
    calls, split = plan(case), case["save_after"]
    before, after = calls[:split], calls[split:]
    if phase == "save":
        run_plan(rank, stage, schedule, case, before)
        save_checkpoint(schedule, root)
    else:
        load_checkpoint(schedule, root)
    states: list[dict[str, Tensor]] = []
    schedule.on_tick = lambda tick: states.append(_state(module))
    losses = run_plan(rank, stage, schedule, case, after, first=sum(c == "step" for c in before))
    dist.barrier()
    return {"stage": stage.stage_index, "states": states, "losses": losses}


class Saboteur(nn.Module):
    """Identity until its ``trigger``-th forward on global rank ``rank``; then dies, raises or hangs."""

    def __init__(self, trigger: int, how: str, rank: int, hang_s: float = 30.0) -> None:
        super().__init__()
        self.trigger, self.how, self.rank, self.hang_s, self.calls = trigger, how, rank, hang_s, 0

    def forward(self, x: Tensor) -> Tensor:
        if dist.get_rank() != self.rank:
            return x
        self.calls += 1
        if self.calls == self.trigger:
            if self.how == "die":
                import os

                os._exit(3)
            if self.how == "raise":
                raise ValueError(f"boom in a layer of global rank {self.rank}")
            if self.how == "hang":
                time.sleep(self.hang_s)
        return x


def failure(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train with a saboteur (or a bad input); report how this rank ended and how long it took."""
    from fdg_schedule import FDGRuntimeError

    start = time.monotonic()
    try:
        train(rank, world, case)
    except (FDGRuntimeError, ValueError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def bad_arguments(rank: int, world: int, case: dict[str, Any]) -> str:
    """Build a schedule with a bad argument; every rank must refuse it (and none may wait on another)."""
    from fdg_schedule import FDGConfigError

    try:
        _, _, schedule = build(rank, world, case)
        if case.get("call_eval"):
            schedule.eval()
    except (FDGConfigError, ValueError, TypeError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


class StageChain(nn.Module):
    """tests/toy.py's ``Chain`` as a PipelineStage module: torch's stage passes a tuple activation as separate
    arguments, DeepSpeed's PipelineModule (and the reference) as one."""

    def __init__(self, funcs: list, start: int) -> None:
        super().__init__()
        import toy

        self.chain = toy.Chain(funcs, start)
        for name, child in list(self.chain.named_children()):  # state_dict keys as the pipeline module's ("6.weight")
            self.add_module(name, child)

    def forward(self, *xs: Tensor) -> Any:
        return self.chain(xs[0] if len(xs) == 1 else tuple(xs))


def against_engine(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed engine (tests/engine_workers.py) on tests/toy.py's model, then ScheduleFDG on the same stages
    and data in the same processes; each one's stage state after every call (and the drain)."""
    import engine_workers
    import toy
    from torch.distributed.pipelining import PipelineStage

    from fdg_schedule.torch_pipelining import ScheduleFDG

    engine = engine_workers.train(rank, world, [case])[0]
    parts, k, K, gas = engine["parts"], engine["stage_id"], case["stages"], case.get("gas", 3)
    module = StageChain(toy.layers(spec=False)[parts[k] : parts[k + 1]], parts[k])
    stage = PipelineStage(module, k, K, torch.device("cpu"))
    fdg = {key: case[key] for key in engine_workers.FDG_KEYS if key in case}
    opt = engine_workers.make_optimizer(case)(module.parameters())
    schedule = ScheduleFDG(stage, gas, toy.loss_fn, opt, clip_grad_norm=case.get("clip", 0.0), **fdg)
    data = toy.micro_batches(case["n"], 4)
    states = []
    for call in range(case["calls"]):
        part = data[call * gas : (call + 1) * gas]
        x, y = torch.cat([x for x, _ in part]), torch.cat([y for _, y in part])
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y)
        else:
            schedule.step()
        states.append({key: v.detach().clone() for key, v in module.chain.state_dict().items()})
    if case.get("drain"):
        schedule.drain()
        states.append({key: v.detach().clone() for key, v in module.chain.state_dict().items()})
    return {"stage": k, "engine": engine["states"], "torch": states}
