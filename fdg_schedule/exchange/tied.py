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
       optimizer's class, with the hyperparameters and, at that moment, the lr of the stage
       optimizer's param group the copy was taken out of) and
       zeroes P and the count. The stage's own optimizer, clip norm and staleness corrections never
       see the tied parameters.
    5. a segment's last tick (a drain, or the end of the data) flushes: a count > 0 steps at once.

    The copies start equal (DeepSpeed broadcasts them when it builds the module), every owner
    applies the same P to the same weights with an optimizer of the same state, so the copies stay
    bit-identical at every tick. The delay of a tied gradient: owner s back-propagates micro-batch b
    at global tick tau (its forward's tick + d_s, d_s = 2(K-1-s)); the contribution joins P at tick
    tau + 1 and is applied at the first tied step t* = accumulate * ceil((tau + 1) / accumulate), so
    its delay, counted as d_s is, is d_s + (t* - tau) = d_s + 1 + (-(tau + 1) mod accumulate) ticks
    (d_s + 1 with accumulate 1: one tick more than the stage's other gradients). docs/fdg-reference.md, "Tied
    layers across stages", is the user-facing definition; ``fdg_reference(..., ties=...)`` the judge.

bf16 and fp16: the tied optimizer steps an fp32 master of each copy and writes it into the (bf16 / fp16)
module weight. Its state is replicated on every data-parallel replica (not ZeRO-partitioned).

Note [tied steps run eager]
    DeepSpeed's Muon runs its update through ``torch.compile`` (``muon_update``), and a compiled
    function is recompiled with symbolic shapes once it sees a second shape. Each owner's process
    steps its own matrices before and in between, so the same tied step ran a static-shape kernel
    on one owner and a dynamic-shape one on another. Where the Newton-Schulz iteration runs in fp16
    (a GPU; a CPU with fp16 matmuls: DeepSpeed's ``ns_compute_dtype``) the two kernels round
    differently, and the copies drifted apart by about 1e-4 of the update per step. Every tied step
    therefore runs under ``torch.compiler.set_stance("force_eager")``: the same eager kernels on the
    same bits on every owner, whatever else each process compiled. The stage's own steps stay compiled.

Note [tied layers under fp16]
    Owners back-propagate different micro-batches, made with different loss scales (Note [loss scale
    per stage] in fdg_schedule/precision/loss_scale.py), so a contribution leaves unscaled: in step 1 above,
    c_s(u) = (the fp16 gradient in fp32, averaged over the data-parallel group) * (1/S), S the scale
    owner s's backward at u was made with (the last stage: the scale its loss was multiplied by; any
    other: the scale that came with its input gradient). P and G are then in the loss's own units on
    every owner, whatever the scales. An overflow:
    - a contribution that is not finite is an overflow of its owner's own step that covers the same
      backward pass (the stage's next step; as DeepSpeed's check covers the tied copies in 1F1B): that
      step is skipped and the owner's scale lowered, exactly as for an overflow in its own gradients;
    - it is still sent and summed, so P is not finite on every owner alike: the tied step that would
      apply it is skipped on every owner (P and its count dropped, counted in ``skipped``), without
      the ``nonfinite`` policy (an overflow is expected under fp16; at the minimum scale the owner's
      own step reports it).
    The reference states the same rule (Note [tied layers across stages, the reference]).

Note [tied optimizer state in checkpoints]
    1F1B's stage optimizer holds each tied copy in its param groups; FDG's holds it in the copy's
    tied optimizer. So that one checkpoint serves both schedules exactly, an FDG stage whose
    optimizer DeepSpeed does not wrap (fp32, no ZeRO) saves and loads with the copies put back in
    the stage optimizer at their *slots* -- (group, index) as DeepSpeed builds 1F1B's optimizer,
    from the client optimizer or ``model_parameters`` -- carrying their tied optimizer's state
    (:meth:`TiedSync.in_stage_optimizer`): DeepSpeed's optimizer file is then byte for byte the
    layout 1F1B writes and reads. Under a bf16 / ZeRO-1 wrapper the file is flat and FDG translates
    it (Note [tied copies in flat optimizer files] in :mod:`fdg_schedule.exchange.flat_state`); the copies'
    own state also stays in FDG's per-stage file (their step, which a flat file cannot hold). When a
    param group held only tied copies (DeepSpeed drops the group FDG leaves empty: the layouts
    differ) the copies' state lives only in FDG's file and 1F1B's optimizer state does not load into
    FDG (refused with the fix); the copies step with that group's settings at group 0's lr.

Long because the tied sync is one protocol (contributions, their exchange, the sum, the tied step, the flush,
checkpoints): split, each part would need the others' state and Note [tied layers across stages] to be read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fdg_schedule.base import optim
from fdg_schedule.base.config import FDGConfigError
from fdg_schedule.base.guards import read_host
from fdg_schedule.exchange import flat_state
from fdg_schedule.exchange.comm import PeerMessage

_P = TypeVar("_P", bound=Tensor)


@dataclasses.dataclass
class Tie:
    """One tied parameter as this stage holds it: its key and attribute, the owner stages and their ranks."""

    key: str
    attr: str
    owners: list[int]  # stages holding a copy, ascending
    ranks: list[int]  # the global rank of each owner with this rank's data-parallel index
    param: nn.Parameter  # this stage's copy (in the module)
    slot: tuple[int, int] | None = None  # (group, index) in 1F1B's stage optimizer (take_out)
    flat_index: int = 0  # its index among that group's trainable parameters (1F1B's flat buffer)
    group: int | None = None  # the group in FDG's stage optimizer (None: it held only tied copies)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # that group's settings, as given


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


def has_own_parameters(layer: Any) -> bool:
    """Whether a layer gives its stage trainable parameters of its own: a ``LayerSpec`` that is not tied, or a
    module with parameters (a ``TiedLayerSpec`` is a ``LayerSpec``: it does not)."""
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

    if isinstance(layer, TiedLayerSpec):
        return False
    return isinstance(layer, LayerSpec) or (isinstance(layer, nn.Module) and any(True for _ in layer.parameters()))


def stages_of_only_tied_layers(module: Any) -> list[int]:
    """Stages whose layers (read from the specs, the same on every rank) hold parameters only through tied
    copies of a key spanning stages: a ``LayerSpec`` or a module with parameters gives a stage its own."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    across = owners(module)
    specs = getattr(module, "_layer_specs", [])
    tied_only: dict[int, bool] = {}
    for i, spec in enumerate(specs):
        stage = module.stage_owner(i)
        if isinstance(spec, TiedLayerSpec):
            tied_only.setdefault(stage, spec.key in across)
        elif has_own_parameters(spec):
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


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings (lr, betas, weight decay, ...) without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def _as_list(params: Any) -> list[Any]:
    return [params] if isinstance(params, Tensor) else list(params)


def take_out(ties: Sequence[Tie], optimizer: Any, model_parameters: Any, module: nn.Module) -> Any:
    """``model_parameters`` without the tied copies, which also leave a client ``optimizer`` (and its state).

    Notes each copy's slot, (group, index) in the stage optimizer DeepSpeed would build for 1F1B --
    the client optimizer's groups, else ``model_parameters`` (None: the module's parameters; a list of
    parameters: one group; param-group dicts) -- Note [tied optimizer state in checkpoints].
    """
    tied = {id(t.param): t for t in ties}
    if model_parameters is None:
        given: list[Any] = list(module.parameters())
    else:
        given = list(model_parameters)
    as_groups = bool(given) and isinstance(given[0], dict)
    if as_groups:
        given = [{**group, "params": _as_list(group["params"])} for group in given]
    client = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    if client is not None:
        groups = [dict(g, params=list(g["params"])) for g in client.param_groups]
    else:
        groups = given if as_groups else [{"params": given}]
    # DeepSpeed drops empty param groups: count the groups each schedule's optimizer keeps.
    kept_1f1b = kept_fdg = 0
    for group in groups:
        params = group["params"]
        own = [p for p in params if id(p) not in tied]
        for i, p in enumerate(params):
            if id(p) in tied:
                t = tied[id(p)]
                t.slot, t.group, t.settings = (kept_1f1b, i), (kept_fdg if own else None), hyperparameters(group)
                t.flat_index = sum(1 for q in params[:i] if q.requires_grad and q.numel() > 0)
        kept_1f1b += bool(params)
        kept_fdg += bool(own)
    if client is not None:
        for group in client.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in tied]
        for t in ties:
            client.state.pop(t.param, None)
    if as_groups:
        return [{**group, "params": [p for p in group["params"] if id(p) not in tied]} for group in given]
    return [p for p in given if id(p) not in tied]


def build_optimizer(
    basic: torch.optim.Optimizer, params: list[Tensor], settings: dict[str, Any], where: str
) -> torch.optim.Optimizer:
    """An optimizer of ``basic``'s class and construction over ``params`` (the tied copies or their fp32 masters),
    with ``settings`` (those of the param group the copies were taken out of) over the defaults: a step of it
    is the step ``basic`` takes on a parameter of that group (Note [tied layers across stages])."""
    kind = type(basic)
    try:
        optimizer = kind([{**settings, "params": params}], **constructor_arguments(basic))
    except Exception as err:  # noqa: BLE001 - any constructor that does not take (params, **defaults)
        raise FDGConfigError(
            f"{where}: tied layers across stages need an optimizer of the stage's class for the tied parameters, "
            f"but {kind.__module__}.{kind.__qualname__}(params, **defaults) failed: {err}; use a torch-style "
            "optimizer whose constructor takes its defaults as keyword arguments, or untie the layers"
        ) from err
    optim.pure_steps(optimizer)  # Note [FusedAdam's step on the CPU]
    return optimizer


def constructor_arguments(basic: torch.optim.Optimizer) -> dict[str, Any]:
    """The keyword arguments that build another optimizer stepping as ``basic`` does: its defaults that its
    constructor takes (torch's AdamW keeps ``decoupled_weight_decay`` there but does not take it), and the
    settings DeepSpeed's optimizers keep outside them (FusedAdam's ``adam_w_mode``; Muon's Adam half)."""
    kind = type(basic)
    signature = inspect.signature(kind.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values()):
        arguments = dict(basic.defaults)
    else:
        arguments = {k: v for k, v in basic.defaults.items() if k in signature}
    from deepspeed.ops.adam import FusedAdam

    if isinstance(basic, FusedAdam):
        arguments.update(adam_w_mode=bool(basic.adam_w_mode), set_grad_none=basic.set_grad_none)
    muon = sys.modules.get("deepspeed.runtime.zero.muon.muon_optimizer")  # imported when DeepSpeed built Muon
    if muon is not None and isinstance(basic, muon.MuonWithAuxAdam):
        aux = basic.aux_optimizer
        arguments.update(adam_w_mode=basic.adam_w_mode, fallback_to_inline=aux is None)
        if aux is not None:
            arguments.update(adam_optimizer=type(aux), adam_optimizer_kwargs=constructor_arguments(aux))
    return arguments


def flat_layouts(wrapper: Any) -> list[flat_state.FlatGroup] | None:
    """The flat-buffer layout of each param group of DeepSpeed's bf16 or ZeRO-1 wrapper (None: not one of those,
    or a layout FDG does not translate -- ZeRO's ``round_robin_gradients`` reorders the parameters)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(wrapper, BF16_Optimizer):
        groups, lean, alignments = wrapper.bf16_groups, False, [1] * len(wrapper.bf16_groups)
    elif isinstance(wrapper, DeepSpeedZeroOptimizer) and not wrapper.partition_gradients:
        if wrapper.round_robin_gradients:
            return None
        groups, lean = wrapper.round_robin_bit16_groups, True
        sizes = [g[0].element_size() if g else 4 for g in groups]
        alignments = [16 // math.gcd(16, size) if wrapper.parameter_alignment else 1 for size in sizes]
    else:
        return None
    names = getattr(wrapper, "param_names", {})
    layouts = []
    for i, group in enumerate(groups):
        dp = dist.get_world_size(group=wrapper.real_dp_process_group[i])
        layout = flat_state.FlatGroup(
            tuple(p.numel() for p in group), tuple(names.get(p, f"param{j}") for j, p in enumerate(group)),
            dp, alignments[i], lean,
        )  # fmt: skip
        padding = getattr(wrapper, "round_robin_bit16_padding", [list(layout.paddings)] * len(groups))[i]
        if list(layout.paddings) != list(padding):  # DeepSpeed's layout is not the one read here
            return None
        layouts.append(layout)
    return layouts


class _Copy:
    """One tied parameter on this stage: its tied optimizer, fp32 master, accumulator P and count."""

    def __init__(self, tie: Tie, stage_id: int, basic: torch.optim.Optimizer, where: str) -> None:
        self.tie = tie
        self.stage_id = stage_id
        p = tie.param
        # Note [tied layers across stages], bf16: the tied optimizer steps an fp32 master.
        self.master = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
        # its param group in the stage optimizer (None: that group held only tied copies and was dropped)
        self.group = tie.group if tie.group is not None and tie.group < len(basic.param_groups) else None
        settings = tie.settings if self.group is None else hyperparameters(basic.param_groups[self.group])
        self.optimizer = build_optimizer(basic, [self.master], settings, where)
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

    def step(self, lr: float, clip: float, guard: Callable[[Tensor], bool], fp16: bool) -> bool:
        """One tied step on P at ``lr`` (its group's), unless ``guard(norm of P)`` says no or, under ``fp16``, P
        is not finite (Note [tied layers under fp16]); then P and the count back to zero. False: skipped."""
        master = self.master
        master.grad = self.accumulated
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_([master], clip)
        else:
            norm = torch.nn.utils.get_total_norm([self.accumulated])
        # P is identical on every owner, so is its norm: all owners decide alike
        stepped = not fp16 or bool(torch.isfinite(norm))
        if stepped and guard(norm):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            with torch.compiler.set_stance("force_eager"):  # Note [tied steps run eager]
                self.optimizer.step()
        master.grad = None
        self.accumulated = torch.zeros_like(self.accumulated)
        self.count = 0
        if master is not self.tie.param:
            with torch.no_grad():
                self.tie.param.data.copy_(master)
        return stepped


class TiedSync:
    """The tied-gradient sync of one stage (Note [tied layers across stages]); empty without cross-stage ties.

    Args:
        ties: this stage's tied parameters (:func:`find_ties`).
        stage_id: this stage.
        basic: the stage's (unwrapped) optimizer: the tied optimizers take its class, defaults and the
            hyperparameters of the group each copy was taken out of.
        stage_optimizer: the optimizer DeepSpeed steps (``basic`` itself, or its bf16/ZeRO wrapper).
        dp_group / dp_size: the stage's data-parallel group, over which each contribution is averaged.
        collective: a context bounding a collective of the data-parallel group (``Replicas.collective``).
        where: names the stage in errors.
        across: the model has parameters tied across stages (on any stage): a stage holding no copy still
            builds a tied optimizer once, so that an optimizer FDG cannot build one from fails on every rank.
        fp16: the stage trains in fp16 (Note [tied layers under fp16]).
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        stage_id: int,
        basic: torch.optim.Optimizer | None,
        stage_optimizer: Any = None,
        dp_group: Any = None,
        dp_size: int = 1,
        collective: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
        where: str = "",
        across: bool = False,
        fp16: bool = False,
    ) -> None:
        self.copies: list[_Copy] = []
        self.fp16 = fp16
        self._finite: Tensor | None = None  # fp16: the contributions since the stage's last step were finite
        if ties or across:
            if basic is None:
                raise FDGConfigError(
                    f"{where}: tied layers across stages need an optimizer; pass one to deepspeed.initialize"
                )
            self.copies = [_Copy(t, stage_id, basic, where) for t in ties]
            if not ties:  # before any rank waits on another: the owners raise this too
                probe = nn.Parameter(torch.zeros(1))
                build_optimizer(basic, [probe], hyperparameters(basic.param_groups[0]), where)
        self.dp_group, self.dp_size = dp_group, dp_size
        self.collective = collective or (lambda what: contextlib.nullcontext())
        # Note [tied optimizer state in checkpoints]: the copies' state goes in the stage optimizer's file
        self.stage_optimizer = stage_optimizer
        self.in_stage_file = (
            stage_optimizer is not None
            and stage_optimizer is basic
            and all(c.master is c.tie.param and c.group is not None for c in self.copies)
        )
        # Note [tied copies in flat optimizer files]: a bf16 / ZeRO-1 wrapper's file gets 1F1B's layout
        self.in_flat_file = (
            bool(self.copies)
            and flat_layouts(stage_optimizer) is not None
            and all(c.group is not None for c in self.copies)
        )
        self._loaded_masters: list[Tensor] | None = None  # fp32 masters a flat load brought (for reset)

    def __bool__(self) -> bool:
        return bool(self.copies)

    def params(self) -> list[nn.Parameter]:
        return [c.tie.param for c in self.copies]

    def without(self, params: Iterable[_P]) -> list[_P]:
        """``params`` less this stage's tied copies (what the stage's own optimizer and corrections see)."""
        tied = {id(p) for p in self.params()}
        return [p for p in params if id(p) not in tied]

    def after_backward(self, scale: Callable[[], float | None] | None = None) -> None:
        """Take this stage's tied gradients out of the backward just run, averaged over its data-parallel group;
        under fp16 divided by ``scale()``, the scale the backward was made with (Note [tied layers under fp16]),
        asked only where the stage holds a copy (under fp16 a host read)."""
        if not self.copies:
            return
        grads = [c.take_gradient() for c in self.copies]
        if self.dp_size > 1:  # as DeepSpeed averages gradients; in fp32
            with self.collective("the tied-gradient all-reduce"):
                for g in grads:
                    dist.all_reduce(g, group=self.dp_group)
            for g in grads:
                g.div_(self.dp_size)
        made_with = None if scale is None or not self.fp16 else scale()
        if made_with is not None:
            finite = self._finite if self._finite is not None else torch.ones((), dtype=torch.bool)
            for g in grads:
                g.mul_(1.0 / made_with)
                finite = finite.to(g.device) & torch.isfinite(g).all()
            self._finite = finite
        for c, g in zip(self.copies, grads):
            c.contribution.add_(g)
            c.passes += 1

    def overflowed(self) -> bool:
        """fp16, at the stage's step: whether a tied contribution since its last step was not finite (a host read,
        beside the one of DeepSpeed's overflow check); the next step starts afresh (Note [tied layers under fp16])."""
        finite, self._finite = self._finite, None
        return finite is not None and not bool(finite)

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
        self,
        tick: int,
        accumulate: int,
        lrs: Sequence[float],
        clip: float,
        guard: Callable[[Tensor], bool],
        flush: bool = False,
    ) -> int:
        """At the start of global tick ``tick``: P += G(tick - 1); a step every ``accumulate`` ticks (or ``flush``).

        ``lrs``: the stage optimizer's lr per param group now; each copy steps at its group's (group 0's when
        its group held only tied copies).
        ``guard(norm)``: the non-finite policy, given P's norm before clipping; False skips the step (P is dropped).
        Returns the tied steps skipped for an fp16 overflow (Note [tied layers under fp16]).
        """
        skipped = 0
        for c in self.copies:
            c.add_sum()
            if (tick % accumulate == 0 or flush) and c.count > 0:
                skipped += not c.step(lrs[0 if c.group is None else c.group], clip, guard, self.fp16)
        return skipped

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

    @contextlib.contextmanager
    def in_stage_optimizer(self) -> Iterator[None]:
        """Inside, the stage optimizer holds the tied copies at their slots with their tied optimizer's state:
        DeepSpeed saves and loads 1F1B's layout (Note [tied optimizer state in checkpoints]). On the way
        out, the state it then holds for them (what a load put there) goes back to the tied optimizers,
        with the group's settings; nothing happens when the copies' state lives in FDG's file. A bf16 / ZeRO-1
        wrapper's flat file is translated instead (Note [tied copies in flat optimizer files])."""
        if self.in_flat_file:
            with self._flat_file():
                yield
            return
        if not self.in_stage_file:
            yield
            return
        optimizer = self.stage_optimizer
        # No group was dropped (in_stage_file), so FDG's groups are 1F1B's: ascending slots put each copy at
        # its 1F1B index once those before it are back.
        placed = sorted(self.copies, key=lambda c: c.tie.slot or (0, 0))
        for c in placed:
            group, index = c.tie.slot or (0, 0)
            optimizer.param_groups[group]["params"].insert(index, c.tie.param)
            if c.master in c.optimizer.state:
                optimizer.state[c.tie.param] = c.optimizer.state[c.master]
        try:
            yield
        finally:
            tied = {id(c.tie.param) for c in self.copies}
            for c in placed:
                state = optimizer.state.pop(c.tie.param, None)
                c.optimizer.state.pop(c.master, None)
                if state:
                    c.optimizer.state[c.master] = state
                c.optimizer.param_groups[0].update(hyperparameters(optimizer.param_groups[c.group or 0]))
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in tied]

    def _entries(self, with_values: bool) -> list[list[flat_state.TiedEntry]]:
        """Each flat group's tied copies, ascending by index (values: the fp32 masters and tied state)."""
        wrapper = self.stage_optimizer
        names = getattr(wrapper, "param_names", {})
        entries: list[list[flat_state.TiedEntry]] = [[] for _ in wrapper.param_groups]
        for c in sorted(self.copies, key=lambda c: c.tie.flat_index):
            entry = flat_state.TiedEntry(
                c.tie.flat_index, names.get(c.tie.param, f"tied_modules.{c.tie.key}.{c.tie.attr}"), c.tie.param.shape
            )
            if with_values:
                entry.fp32 = c.master.detach()
                entry.state = dict(c.optimizer.state.get(c.master, {}))
            entries[c.group or 0].append(entry)
        return entries

    def _gather(self, t: Tensor, group: int) -> list[Tensor]:
        if self.dp_size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.dp_size)]
        with self.collective("the tied copies' flat optimizer state"):
            dist.all_gather(out, t.contiguous(), group=self.dp_group)
        return out

    @contextlib.contextmanager
    def _flat_file(self) -> Iterator[None]:
        """Inside, the wrapper's ``state_dict`` / ``load_state_dict`` speak 1F1B's layout, the tied copies at
        their slots (Note [tied copies in flat optimizer files])."""
        wrapper = self.stage_optimizer
        layouts = flat_layouts(wrapper)
        assert layouts is not None
        own_state_dict, own_load = wrapper.state_dict, wrapper.load_state_dict
        rank = dist.get_rank(group=self.dp_group) if self.dp_size > 1 else 0

        def state_dict() -> dict[str, Any]:
            return flat_state.to_1f1b(own_state_dict(), layouts, self._entries(True), rank, self._gather)

        def load_state_dict(state_dict_list: Any = None, *args: Any, **kwargs: Any) -> Any:
            if state_dict_list is None or kwargs.get("checkpoint_folder"):
                return own_load(state_dict_list, *args, **kwargs)
            entries = self._entries(False)
            translated = list(state_dict_list)  # DeepSpeed reads only this rank's (the others are None)
            translated[rank] = flat_state.from_1f1b(state_dict_list[rank], layouts, entries, rank, self._gather)
            loaded = own_load(translated, *args, **kwargs)
            self._take_loaded(entries, kwargs.get("load_optimizer_states", True), kwargs.get("load_from_fp32_weights"))
            return loaded

        wrapper.state_dict, wrapper.load_state_dict = state_dict, load_state_dict
        try:
            yield
        finally:
            del wrapper.state_dict, wrapper.load_state_dict

    def _take_loaded(self, entries: list[list[flat_state.TiedEntry]], states: bool, fp32: bool | None) -> None:
        """The copies' part of a loaded flat file: fp32 masters (kept for :meth:`reset`) and tied optimizer state."""
        by_flat = {(c.group or 0, c.tie.flat_index): c for c in self.copies}
        masters: dict[int, Tensor] = {}
        for g, group in enumerate(entries):
            for entry in group:
                c = by_flat[g, entry.index]
                master = entry.fp32 if fp32 and entry.fp32 is not None else c.tie.param.detach().float()
                masters[id(c)] = master.to(c.master.device)
                if states:
                    settings = hyperparameters(self.stage_optimizer.param_groups[g])
                    state = {0: entry.state} if entry.state else {}
                    c.optimizer.load_state_dict({"state": state, "param_groups": [{**settings, "params": [0]}]})
        self._loaded_masters = [masters[id(c)] for c in self.copies]

    def capture(self) -> list[dict[str, Any]]:
        """P, the count, the tied optimizer's state (unless it goes in the stage optimizer's file) and the fp32
        master of each copy (for a checkpoint)."""
        return [
            {
                "key": c.tie.key,
                "attr": c.tie.attr,
                "accumulated": c.accumulated.clone(),
                "count": c.count,
                "optimizer": None if self.in_stage_file else c.optimizer.state_dict(),
                "master": None if c.master is c.tie.param else c.master.detach().clone(),
                "finite": None if self._finite is None else bool(self._finite),  # Note [tied layers under fp16]
            }
            for c in self.copies
        ]

    def restore(self, saved: list[dict[str, Any]] | None) -> None:
        """Undo :meth:`capture`; None (a checkpoint without it) starts P at zero with the weights as loaded."""
        if saved is None:
            self.reset()
            return
        self._loaded_masters = None  # FDG's own file has the masters and the tied optimizers' own state
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
            if s["optimizer"] is not None:  # else it came with the stage optimizer's (in_stage_optimizer)
                c.optimizer.load_state_dict(s["optimizer"])
            c.contribution.zero_()
            c.passes.zero_()
        finite = saved[0].get("finite") if saved else None
        self._finite = None if finite is None else torch.tensor(finite)

    def reset(self) -> None:
        """P and counts to zero; fp32 masters re-read from the module weights (after weights were loaded), or
        taken from the flat optimizer file just loaded (Note [tied copies in flat optimizer files])."""
        loaded, self._loaded_masters = self._loaded_masters, None
        self._finite = None
        for i, c in enumerate(self.copies):
            c.accumulated.zero_()
            c.count = 0
            c.contribution.zero_()
            c.passes.zero_()
            with torch.no_grad():
                if loaded is not None:
                    c.master.copy_(loaded[i])
                    if c.master is not c.tie.param:
                        c.tie.param.data.copy_(c.master)
                elif c.master is not c.tie.param:
                    c.master.copy_(c.tie.param)
