"""The tied-gradient sync of one stage: its copies of parameters tied across stages stay bit-identical.

Note [tied layers across stages]
    A ``TiedLayerSpec`` key whose layers sit on several stages (Megatron's input embedding on the
    first stage and output head on the last) gives each of those stages, its *owners* S (sorted
    ascending), a copy of the tied parameters (the spec's ``tied_weight_attr``, as DeepSpeed ties
    them). DeepSpeed keeps the copies equal with a blocking all-reduce of their gradients every
    step (``ReduceTiedGrads``), a lock across stages that FDG removes. Here instead, per tied
    parameter, with u and t counted on the global tick clock (``StageState.tick``, the t of the
    staleness corrections):

    1. contribution c_s(u): owner s's gradient on its copy from its backward at tick u (the last
       stage's loss backward included), averaged over the stage's data-parallel group; zero if the
       stage had no backward at u. It already carries β^(K-1-s) and 1/accumulate: contributions are
       summed as they are. n_s(u): the micro-batches it back-propagated at u (0 or 1).
    2. at tick u's exchange every owner sends (c_s(u), n_s(u)) to every other owner -- replica d of
       each owner stage to replica d of the others -- point to point, in the tick's one post.
    3. G(u) = c_{s_0}(u) + c_{s_1}(u) + ..., s_0 < s_1 < ..., on every owner alike (its own term
       from the local copy, the bits it sent): the same G everywhere, bit for bit.
    4. at tick t >= 1 (in practice at the end of tick t-1, after its exchange and the LR
       scheduler: nothing runs in between) every owner adds G(t-1) to its accumulator P and
       n(t-1) to its count; when t % accumulate == 0 and the count is > 0 it clips P by P's own
       norm (``gradient_clipping``), steps the copy with its *tied optimizer* (the stage
       optimizer's class and defaults, the lr of the stage optimizer's group 0 at that moment) and
       zeroes P and the count. The stage's own optimizer, clip norm and staleness corrections never
       see the tied parameters.
    5. a segment's last tick (a drain, or the end of the data) flushes: a count > 0 steps at once.

    The copies start equal (DeepSpeed broadcasts them when it builds the module), every owner
    applies the same P to the same weights with an optimizer of the same state, so the copies stay
    bit-identical at every tick. The delay of a tied gradient: owner s back-propagates micro-batch b
    at global tick tau (its forward's tick + d_s, d_s = 2(K-1-s)); the contribution joins P at tick
    tau + 1 and is applied at the first tied step t* = accumulate * ceil((tau + 1) / accumulate), so
    its delay, counted as d_s is, is d_s + (t* - tau) = d_s + 1 + (-(tau + 1) mod accumulate) ticks
    (d_s + 1 with accumulate 1: one tick more than the stage's other gradients). docs/fdg.md, "Tied
    layers across stages", is the user-facing definition; ``fdg_reference(..., ties=...)`` the judge.

bf16: the tied optimizer steps an fp32 master of each copy and writes it into the (bf16) module
weight. Its state is replicated on every data-parallel replica (not ZeRO-partitioned).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fdg_schedule.comm import PeerMessage
from fdg_schedule.config import FDGConfigError
from fdg_schedule.guards import read_host


@dataclasses.dataclass
class Tie:
    """One tied parameter as this stage holds it: its key and attribute, the owner stages and their ranks."""

    key: str
    attr: str
    owners: list[int]  # stages holding a copy, ascending
    ranks: list[int]  # the global rank of each owner with this rank's data-parallel index
    param: nn.Parameter  # this stage's copy (in the module)


def owners(module: Any) -> dict[str, list[int]]:
    """Every tie key of ``module`` (a ``PipelineModule``) whose layers sit on several stages: its stages, ascending.

    The same on every rank (read from the layer specs), also on stages that hold no copy.
    """
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    specs = getattr(module, "_layer_specs", [])
    stages: dict[str, set[int]] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            stages.setdefault(spec.key, set()).add(module.stage_owner(i))
    # a key whose copies are one module on one stage needs nothing: that stage's optimizer steps it
    return {key: sorted(found) for key, found in sorted(stages.items()) if len(found) > 1}


def find_ties(module: Any) -> list[Tie]:
    """The parameters of ``module`` (a ``PipelineModule``) this stage holds tied to a copy on another stage."""
    across = owners(module)
    ties = []
    for key, comm in sorted(getattr(module, "tied_comms", {}).items()):
        if key not in across:
            continue
        for attr in comm["weight_attr"]:
            param = module._recursive_getattr(module.tied_modules[key], attr)
            if not param.requires_grad:  # frozen: nothing to keep equal
                continue
            ties.append(Tie(key, attr, across[key], list(comm["ranks"]), param))
    return ties


def stages_of_only_tied_layers(module: Any) -> list[int]:
    """Stages whose layers (read from the specs, the same on every rank) hold parameters only through tied
    copies of a key spanning stages: a ``LayerSpec`` or a module with parameters gives a stage its own."""
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

    across = owners(module)
    specs = getattr(module, "_layer_specs", [])
    tied_only: dict[int, bool] = {}
    for i, spec in enumerate(specs):
        stage = module.stage_owner(i)
        if isinstance(spec, TiedLayerSpec):
            tied_only.setdefault(stage, spec.key in across)
        elif isinstance(spec, LayerSpec) or (isinstance(spec, nn.Module) and any(True for _ in spec.parameters())):
            tied_only[stage] = False
    return sorted(stage for stage, only in tied_only.items() if only)


def check_own_parameters(module: nn.Module, ties: Sequence[Tie]) -> None:
    """Refuse a stage whose only trainable parameters are tied copies: its own optimizer would have none."""
    tied = {id(t.param) for t in ties}
    if not any(p.requires_grad and id(p) not in tied for p in module.parameters()):
        stage = getattr(module, "stage_id", "?")
        raise FDGConfigError(
            f"stage {stage} holds only tied parameters ({sorted({t.key for t in ties})}), which FDG steps with a "
            "tied optimizer of their own, so the stage's optimizer would have no parameters; put a layer with "
            "parameters of its own on that stage (e.g. another partition_method), or untie the layers"
        )


def without_tied(model_parameters: Any, ties: Sequence[Tie], module: nn.Module) -> Any:
    """``model_parameters`` (None, parameters, or param-group dicts) without the tied parameters."""
    tied = {id(t.param) for t in ties}
    if model_parameters is None:
        return [p for p in module.parameters() if id(p) not in tied]
    params = list(model_parameters)
    if params and isinstance(params[0], dict):
        return [{**group, "params": [p for p in group["params"] if id(p) not in tied]} for group in params]
    return [p for p in params if id(p) not in tied]


def remove_from_optimizer(optimizer: torch.optim.Optimizer, ties: Sequence[Tie]) -> None:
    """Take the tied parameters out of a client optimizer built over the whole stage (and their state)."""
    tied = {id(t.param) for t in ties}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in tied]
    for t in ties:
        optimizer.state.pop(t.param, None)


def build_optimizer(basic: torch.optim.Optimizer, params: list[Tensor], where: str) -> torch.optim.Optimizer:
    """An optimizer of ``basic``'s class and defaults over ``params`` (the tied copies or their fp32 masters)."""
    kind = type(basic)
    try:
        return kind(params, **basic.defaults)
    except Exception as err:  # noqa: BLE001 - any constructor that does not take (params, **defaults)
        raise FDGConfigError(
            f"{where}: tied layers across stages need an optimizer of the stage's class for the tied parameters, "
            f"but {kind.__module__}.{kind.__qualname__}(params, **defaults) failed: {err}; use a torch-style "
            "optimizer whose constructor takes its defaults as keyword arguments, or untie the layers"
        ) from err


class _Copy:
    """One tied parameter on this stage: its tied optimizer, fp32 master, accumulator P and count."""

    def __init__(self, tie: Tie, stage_id: int, basic: torch.optim.Optimizer, where: str) -> None:
        self.tie = tie
        self.stage_id = stage_id
        p = tie.param
        # Note [tied layers across stages], bf16: the tied optimizer steps an fp32 master.
        self.master = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
        self.optimizer = build_optimizer(basic, [self.master], where)
        self.accumulated = torch.zeros(p.shape, dtype=torch.float32, device=p.device)  # P
        self.count = 0  # micro-batches in P
        self.contribution = torch.zeros_like(self.accumulated)  # c_s(u) of the tick in progress
        self.passes = torch.zeros(1, dtype=torch.int64)  # n_s(u), on the host (a control word)
        others = [(s, r) for s, r in zip(tie.owners, tie.ranks) if s != stage_id]
        self.received = {s: torch.empty_like(self.accumulated) for s, _ in others}
        self.received_passes = {s: torch.zeros(1, dtype=torch.int64) for s, _ in others}
        self.peers = others

    def take_gradient(self) -> Tensor:
        """After a backward: the copy's gradient in fp32 (zeros if it got none), taken out of the parameter."""
        p = self.tie.param
        grad = torch.zeros_like(self.accumulated) if p.grad is None else p.grad.detach().float()
        p.grad = None
        return grad

    def add_sum(self) -> None:
        """P += G(u), summed in ascending stage order; the count likewise (Note [tied layers across stages], 3-4)."""
        total: Tensor | None = None
        passes = 0
        for stage in self.tie.owners:
            term = self.contribution if stage == self.stage_id else self.received[stage]
            n = self.passes if stage == self.stage_id else self.received_passes[stage]
            total = term.clone() if total is None else total.add_(term)
            passes += read_host(n)[0]
        assert total is not None
        self.accumulated.add_(total)
        self.count += passes
        # New tensors: the ones just sent may still be in flight (isend does not copy).
        self.contribution = torch.zeros_like(self.accumulated)
        self.passes = torch.zeros(1, dtype=torch.int64)

    def step(self, lr: float, clip: float, guard: Callable[[Tensor], bool]) -> None:
        """One tied step on P (unless ``guard(norm of P)`` says no), then P and the count back to zero."""
        master = self.master
        master.grad = self.accumulated
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_([master], clip)
        else:
            norm = torch.nn.utils.get_total_norm([self.accumulated])
        if guard(norm):  # P is identical on every owner, so is its norm: all owners decide alike
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        master.grad = None
        self.accumulated = torch.zeros_like(self.accumulated)
        self.count = 0
        if master is not self.tie.param:
            with torch.no_grad():
                self.tie.param.data.copy_(master)


class TiedSync:
    """The tied-gradient sync of one stage (Note [tied layers across stages]); empty without cross-stage ties.

    Args:
        ties: this stage's tied parameters (:func:`find_ties`).
        stage_id: this stage.
        basic: the stage's (unwrapped) optimizer: the tied optimizers take its class and defaults.
        dp_group / dp_size: the stage's data-parallel group, over which each contribution is averaged.
        collective: a context bounding a collective of the data-parallel group (``Replicas.collective``).
        where: names the stage in errors.
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        stage_id: int,
        basic: torch.optim.Optimizer | None,
        dp_group: Any = None,
        dp_size: int = 1,
        collective: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
        where: str = "",
    ) -> None:
        self.copies: list[_Copy] = []
        if ties:
            if basic is None:
                raise FDGConfigError(
                    f"{where}: tied layers across stages need an optimizer; pass one to deepspeed.initialize"
                )
            self.copies = [_Copy(t, stage_id, basic, where) for t in ties]
        self.dp_group, self.dp_size = dp_group, dp_size
        self.collective = collective or (lambda what: contextlib.nullcontext())

    def __bool__(self) -> bool:
        return bool(self.copies)

    def params(self) -> list[nn.Parameter]:
        return [c.tie.param for c in self.copies]

    def after_backward(self) -> None:
        """Take this stage's tied gradients out of the backward just run, averaged over its data-parallel group."""
        grads = [c.take_gradient() for c in self.copies]
        if self.dp_size > 1:  # as DeepSpeed averages gradients; in fp32
            with self.collective("the tied-gradient all-reduce"):
                for g in grads:
                    dist.all_reduce(g, group=self.dp_group)
            for g in grads:
                g.div_(self.dp_size)
        for c, g in zip(self.copies, grads):
            c.contribution.add_(g)
            c.passes += 1

    def messages(self) -> list[PeerMessage]:
        """This tick's contributions to the other owners and the receives of theirs, in a fixed order."""
        out = []
        for c in self.copies:
            for stage, rank in c.peers:
                out.append(
                    PeerMessage(
                        peer=rank,
                        stage=stage,
                        sends=[c.contribution],
                        recvs=[c.received[stage]],
                        words_out=[c.passes],
                        words_in=[c.received_passes[stage]],
                    )
                )
        return out

    def apply(
        self, tick: int, accumulate: int, lr: float, clip: float, guard: Callable[[Tensor], bool], flush: bool = False
    ) -> None:
        """At the start of global tick ``tick``: P += G(tick - 1); a step every ``accumulate`` ticks (or ``flush``).

        ``guard(norm)``: the non-finite policy, given P's norm before clipping; False skips the step (P is dropped).
        """
        for c in self.copies:
            c.add_sum()
            if (tick % accumulate == 0 or flush) and c.count > 0:
                c.step(lr, clip, guard)

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """The tied copies look frozen inside: DeepSpeed's gradient reduce neither zero-fills nor all-reduces
        them (their gradients were taken after each backward; reducing an embedding-sized zero would cost)."""
        params = self.params()
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in params:
                p.requires_grad_(True)

    def capture(self) -> list[dict[str, Any]]:
        """P, the count, the tied optimizer's state and the fp32 master of each copy (for a checkpoint)."""
        return [
            {
                "key": c.tie.key,
                "attr": c.tie.attr,
                "accumulated": c.accumulated.clone(),
                "count": c.count,
                "optimizer": c.optimizer.state_dict(),
                "master": None if c.master is c.tie.param else c.master.detach().clone(),
            }
            for c in self.copies
        ]

    def restore(self, saved: list[dict[str, Any]] | None) -> None:
        """Undo :meth:`capture`; None (a checkpoint without it) starts P at zero with the weights as loaded."""
        if saved is None:
            self.reset()
            return
        names = [(s["key"], s["attr"]) for s in saved]
        if names != [(c.tie.key, c.tie.attr) for c in self.copies]:
            raise FDGConfigError(
                f"the checkpoint's tied parameters {names} are not this stage's "
                f"{[(c.tie.key, c.tie.attr) for c in self.copies]}; load it into the same model"
            )
        for c, s in zip(self.copies, saved):
            with torch.no_grad():
                c.accumulated.copy_(s["accumulated"])
                if s["master"] is not None and c.master is not c.tie.param:
                    c.master.copy_(s["master"])
                    c.tie.param.data.copy_(c.master)
            c.count = s["count"]
            c.optimizer.load_state_dict(s["optimizer"])
            c.contribution.zero_()
            c.passes.zero_()

    def reset(self) -> None:
        """P and counts to zero; fp32 masters re-read from the module weights (after weights were loaded)."""
        for c in self.copies:
            c.accumulated.zero_()
            c.count = 0
            c.contribution.zero_()
            c.passes.zero_()
            if c.master is not c.tie.param:
                with torch.no_grad():
                    c.master.copy_(c.tie.param)
