"""ScheduleFDG: FDG as a torch.distributed.pipelining schedule, one PipelineStage per rank, with no flush.

    stage = PipelineStage(module, stage_index, num_stages, device, group=pp_group)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-4)
    schedule = ScheduleFDG(stage, n_microbatches=8, loss_fn=loss_fn, optimizer=optimizer, grad_shrink=0.5)
    schedule.step(x, target=y, losses=losses)        # on every rank; no optimizer.step() of your own

At every tick stage k of K back-propagates the micro-batch it forwarded ``2(K-1-k)`` ticks before (with the
gradient the next stage sent at the end of the previous tick, times ``grad_shrink`` on non-last stages),
steps its own optimizer (every ``accumulate`` backward passes), then forwards the newest micro-batch
(:mod:`fdg_schedule.sched.ticks` draws the grid). A ``step()`` runs ``n_microbatches`` ticks, one new
micro-batch each; what is in flight at its end carries over to the next call, and :meth:`ScheduleFDG.drain`
finishes it. The math is :func:`fdg_schedule.fdg_reference`'s, bit for bit (tested).

Note [keyword inputs of later stages]: torch's schedules pass a call's keyword inputs (torchtitan's
``attention_masks``, ``positions``) to every stage's ``step()``, split into micro-batches. Under FDG a later stage
forwards, in one call, micro-batches that entered in earlier calls, so like the last stage's targets its
keyword inputs wait in a queue, one entry per micro-batch, and each forward takes the one of the micro-batch
it forwards (kept with it for a recomputed forward and in checkpoints).

Note [what torch's stage does and what FDG adds]: the stage does what it does under torch's schedules --
the metadata inference, the receive buffers, ``forward_one_chunk`` / ``backward_one_chunk``, the send
and receive ``P2POp``s. Its chunk ids name buffer slots here, not a step's micro-batches: micro-batch b
of a segment lives in slot ``b % (delay + 1)`` (:func:`fdg_schedule.sched.ticks.num_buffers`), so a
slot's receive buffer, which the stored graph reads, is written again only after b's backward. FDG adds
what torch's runtime has no action for: the delayed backward's modes (the engine's own
:class:`~fdg_schedule.corrections.delayed.DelayedBackward`: saved weights read live, stashed weights,
recomputed forwards), the gradient shrink, the optimizer step inside the tick with the staleness
corrections (:class:`~fdg_schedule.corrections.staleness.Corrections`), a data-parallel gradient
reduction per optimizer step, and messages that outlive ``step()`` (:mod:`.links`). The corrections are
contexts this schedule runs torch's chunks and its optimizer step inside (Note [one direction] in
:mod:`fdg_schedule.corrections.delayed`). torch's
``_PipelineScheduleRuntime`` cannot carry them: its step clears the stage after n micro-batches,
reduces gradients at the last backward and has no update action.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from fdg_schedule.base.config import FDGConfig
from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.tensors import describe
from fdg_schedule.corrections import auto_corrections
from fdg_schedule.corrections.delayed import DelayedBackward, Held
from fdg_schedule.corrections.staleness import Corrections
from fdg_schedule.sched import ticks
from fdg_schedule.torch_pipelining import arguments
from fdg_schedule.torch_pipelining.links import Links, describe_rank


@dataclasses.dataclass
class InFlight:
    """A micro-batch between its forward and its delayed backward on one stage."""

    slot: int  # the stage's chunk id (buffer slot) it lives in
    args: tuple[Any, ...]  # first stage: its inputs (others read theirs from the slot's receive buffer)
    kwargs: dict[str, Any]
    held: Held | None  # what DelayedBackward keeps for it


class ScheduleFDG(PipelineScheduleSingle):
    """FDG for one :class:`~torch.distributed.pipelining.PipelineStage` per rank (module docstring).

    Args:
        stage: this rank's stage (``group``: the pipeline group, one rank per stage).
        n_microbatches: micro-batches (ticks) per ``step()``; the batch is split as torch's schedules split it.
        loss_fn: ``loss_fn(output, target)`` of the last stage (needed on every rank, as in torch).
        optimizer: this stage's optimizer over ``stage.submod``'s trainable parameters; the schedule steps it.
        lr_scheduler: stepped once every ``accumulate`` ticks, fill and drain ticks included.
        clip_grad_norm: clip this stage's gradients by their own norm before each step (0: off).
        dp_group: the data-parallel group of this stage's replicas: gradients are averaged over it before each
            optimizer step (one all-reduce per step). None: no data parallelism.
        args_chunk_spec, kwargs_chunk_spec: as in torch's schedules.
        on_tick: called with the global tick at the end of every tick (an observer, e.g. for tests).
        **fdg: the FDG keys of ``pipeline.fdg`` (:class:`~fdg_schedule.base.config.FDGConfig`):
            ``grad_shrink``, ``weights``, ``activations``, ``accumulate``, ``corrections`` and the
            correction keys, ``timeout`` (seconds a stage waits for a neighbour).
    """

    def __init__(
        self,
        stage: Any,
        n_microbatches: int,
        loss_fn: Callable[..., Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        lr_scheduler: Any = None,
        clip_grad_norm: float = 0.0,
        dp_group: dist.ProcessGroup | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        on_tick: Callable[[int], None] | None = None,
        **fdg: Any,
    ) -> None:
        arguments.check_stage(stage, n_microbatches)
        self.config: FDGConfig = arguments.fdg_config(fdg)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (the last stage's loss), got {loss_fn!r}")
        self.clip_grad_norm = arguments.check_number("clip_grad_norm", clip_grad_norm, 0.0, strict=False)
        self.dp_group = dp_group
        replica = None if dp_group is None else dist.get_rank(dp_group)
        self.name = describe_rank(stage.stage_index, stage.group, stage.group_rank, replica)
        arguments.check_optimizer(stage.submod, optimizer, self.name)
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, scale_grads=False)
        self.optimizer, self.lr_scheduler, self.on_tick = optimizer, lr_scheduler, on_tick
        K, k = stage.num_stages, stage.stage_index
        self.config = auto_corrections.resolve(self.config, optimizer, lr_scheduler, K)[0]
        params = [p for p in stage.submod.parameters() if p.requires_grad]
        self.params = params
        self.corrections = Corrections(params, K, k, self.config, optimizer, self.name)
        self.delayed = DelayedBackward(stage.submod, self.config, delayed=not stage.is_last)
        self.slots = ticks.num_buffers(K, k)
        neighbour = [None if i < 0 or i >= K else describe_rank(i, stage.group, i) for i in (k - 1, k + 1)]
        self.links = Links(self.name, neighbour[0], neighbour[1], self.config.timeout)
        self.tick = 0  # ticks since training began (fill and drain included): t of the corrections
        self.segment_tick = 0  # ticks since the pipeline last filled (micro-batch numbers count from there)
        self.in_flight: dict[int, InFlight] = {}
        self.targets: collections.deque[Any] = collections.deque()  # last stage: targets of micro-batches to come
        # later stages: keyword inputs of micro-batches to come (Note [keyword inputs of later stages])
        self.later_kwargs: collections.deque[dict[str, Any]] = collections.deque()
        self.received: set[str] = set()  # messages already in their buffers (settled for a checkpoint)
        self.restoring: dict[str, Any] | None = None  # a checkpoint's state, restored at the next step()

    # -- the public calls -------------------------------------------------------------------------------

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        **kwargs: Any,
    ) -> None:
        """Run ``n_microbatches`` ticks, one new micro-batch each; nothing is flushed.

        ``losses`` (last stage) receives the losses of the micro-batches the last stage computed in this
        call, in order: ``n_microbatches`` per call once the pipeline is full, ``K - 1`` fewer in the first
        call of a segment (they come in the next call or in :meth:`drain`). Returns None (no merged outputs:
        the outputs of one call belong to micro-batches of several calls).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("ScheduleFDG.step() trains: call it with gradients enabled (not under torch.no_grad())")
        stage = self._stage
        stage.has_backward = True
        arg_split, kwarg_split, target_split = self._get_microbatch_inputs(
            args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs
        )
        self._step_microbatches(arg_split, kwarg_split, target_split, losses, return_outputs, loss_kwargs)

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``n_microbatches`` ticks on micro-batches already split (torch's entry point for them)."""
        stage, n = self._stage, self._n_microbatches
        arg_mbs = arg_mbs if arg_mbs is not None else [()] * n
        kwarg_mbs = kwarg_mbs if kwarg_mbs is not None else [{}] * n
        self._check_step_inputs(arg_mbs, kwarg_mbs, target_mbs)
        if not self._stage_forward_initialized:
            self._initialize(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs else None, loss_kwargs)
        if self.restoring is not None:  # Note [in-flight state in a checkpoint]
            self._restore(self.restoring)
            self.restoring = None
        if stage.is_last:
            assert target_mbs is not None
            self.targets.extend(target_mbs)
        if not stage.is_first:
            self.later_kwargs.extend(kwarg_mbs)
        computed: list[Tensor] = []
        for i in range(n):
            self._tick(arg_mbs[i], kwarg_mbs[i], None, computed, loss_kwargs)
        if losses is not None and stage.is_last:
            losses.clear()
            losses.extend(computed)

    def drain(self, losses: list[Tensor] | None = None, loss_kwargs: dict[str, Any] | None = None) -> None:
        """Finish every micro-batch in flight (``2(K-1)`` ticks without new ones, a partial accumulation
        stepped), on every rank; the next ``step()`` fills the pipeline again. ``losses`` (last stage): the
        losses computed while draining."""
        computed: list[Tensor] = []
        limit = self.segment_tick  # every micro-batch that entered the segment
        if limit > 0 and self.restoring is not None:  # a drain right after a load
            self._resume_without_inputs(self.restoring)
            self.restoring = None
        if limit > 0:
            for _ in range(ticks.drain_ticks(self._num_stages)):
                self._tick((), {}, limit, computed, loss_kwargs)
        self.links.wait_sends()
        self.segment_tick = 0
        if losses is not None and self._stage.is_last:
            losses.clear()
            losses.extend(computed)

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a forward-only pass through FDG's ticks would interleave with the micro-batches in flight."""
        raise NotImplementedError(
            f"{self.name}: ScheduleFDG.eval() is not supported (it trains only); call drain() on every rank, then "
            "evaluate the stage modules with your own forward passes"
        )

    def in_flight_micro_batches(self) -> list[int]:
        """The segment's micro-batch numbers this stage has forwarded and not yet back-propagated."""
        return sorted(self.in_flight)

    # -- one tick ----------------------------------------------------------------------------------------

    def _tick(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int | None, losses: list[Tensor],
        loss_kwargs: dict[str, Any] | None,
    ) -> None:  # fmt: skip
        stage, t, K, k = self._stage, self.segment_tick, self._num_stages, self._stage.stage_index
        sends: list[tuple[dist.P2POp, str | None]] = []
        backward = None if stage.is_last else ticks.backward_micro_batch(t, K, k, limit)
        if backward is not None:
            self._wait("grad")
            sends += [(op, self.links.prev) for op in self._delayed_backward(backward)]
            self._maybe_step(backward, limit)
        forward = ticks.forward_micro_batch(t, k, limit)
        if forward is not None:
            if not stage.is_first:
                self._wait("activation")
                kwargs = self.later_kwargs.popleft()
            if stage.is_last:
                sends += [(op, self.links.prev) for op in self._last_stage(forward, args, kwargs, losses, loss_kwargs)]
                self._maybe_step(forward, limit)
            else:
                sends += [(op, self.links.next) for op in self._forward(forward, args, kwargs)]
        self._post(sends, t + 1, limit)
        self.segment_tick += 1
        self.tick += 1
        if self.lr_scheduler is not None and ticks.scheduler_steps_after(self.tick, self.config.accumulate):
            self.lr_scheduler.step()  # Note [learning rate per optimizer step] in fdg_schedule.sched.ticks
        if self.on_tick is not None:
            self.on_tick(self.tick - 1)

    def _forward(self, micro_batch: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[dist.P2POp]:
        stage, slot = self._stage, micro_batch % self.slots
        with self.corrections.predicted(), self.delayed.forwarding() as forward:  # Note [one direction]
            self._run_forward(slot, args, kwargs)  # its output stays in the stage's fwd_cache
        held = forward.held
        if self.config.activations == "recomputed":  # keep the inputs only: the first forward's graph goes
            outputs, inputs = stage.fwd_cache[slot]
            stage.fwd_cache[slot] = (tuple(o.detach() if torch.is_tensor(o) else o for o in outputs), inputs)
        self._check_outputs(micro_batch, stage.fwd_cache[slot][0])
        self.in_flight[micro_batch] = InFlight(slot, args if stage.is_first else (), kwargs, held)
        return stage.get_fwd_send_ops(slot)

    def _delayed_backward(self, micro_batch: int) -> list[dist.P2POp]:
        stage, record = self._stage, self.in_flight.pop(micro_batch)
        if self.config.grad_shrink != 1.0:
            for info in stage.grad_recv_info[record.slot]:
                if info.buffer is not None:
                    info.buffer.mul_(self.config.grad_shrink)
        assert record.held is not None
        with self.delayed.backward(record.held) as rerun:  # Note [one direction]
            if rerun:
                self._run_forward(record.slot, record.args, record.kwargs)
            stage.backward_one_chunk(record.slot, loss=None, last_backward=False)
        return stage.get_bwd_send_ops(record.slot)

    def _last_stage(
        self, micro_batch: int, args: tuple[Any, ...], kwargs: dict[str, Any], losses: list[Tensor],
        loss_kwargs: dict[str, Any] | None,
    ) -> list[dist.P2POp]:  # fmt: skip
        """Forward, loss and backward in one tick. Note [the last stage's prediction] in
        fdg_schedule/corrections/staleness.py: under "current" only the forward runs on the predicted weights."""
        stage, slot = self._stage, micro_batch % self.slots
        target = self.targets.popleft()
        stashed = self.config.weights == "stashed"
        with self.corrections.predicted() if stashed else contextlib.nullcontext():
            with contextlib.nullcontext() if stashed else self.corrections.predicted():
                output = self._run_forward(slot, args, kwargs)
            try:
                loss = self._compute_loss(output, target, loss_kwargs)
            except Exception as err:
                raise FDGRuntimeError(
                    f"{self.name}: loss_fn failed on micro-batch {micro_batch} (tick {self.tick}) with output "
                    f"{describe(output)} and target {describe(target)}: {err}"
                ) from err
            stage.backward_one_chunk(slot, loss=loss / self.config.accumulate, last_backward=False)
        losses.append(loss.detach())
        return stage.get_bwd_send_ops(slot)

    def _run_forward(self, slot: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return self._stage.forward_one_chunk(slot, args, kwargs, save_forward_output=False)
        except RuntimeError as err:  # torch's stage wraps the module's error: name it, with this stage and tick
            cause = err.__cause__ if err.__cause__ is not None else err
            raise FDGRuntimeError(
                f"{self.name}: the forward failed at tick {self.tick}: {type(cause).__name__}: {cause}"
            ) from err

    def _maybe_step(self, micro_batch: int, limit: int | None) -> None:
        last = None if limit is None else limit - 1
        if not ticks.steps_after_backward(micro_batch, self.config.accumulate, last):
            return
        self._reduce_grads()
        if self.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self._stage.submod.parameters(), self.clip_grad_norm)
        with self.corrections.stepping(self.optimizer, self.tick) as step:  # Note [one direction]
            self.optimizer.step()
            step.taken = True
        self.optimizer.zero_grad()

    def _reduce_grads(self) -> None:
        """The mean of the stage's gradients over its data-parallel replicas: one all-reduce per step."""
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        self.links._wait([work], "the gradient all-reduce of the stage's data-parallel replicas")
        flat.div_(dist.get_world_size(self.dp_group))
        for p, reduced in zip(self.params, torch._utils._unflatten_dense_tensors(flat, grads)):
            p.grad = reduced

    def _post(self, sends: list[tuple[dist.P2POp, str | None]], next_tick: int, limit: int | None) -> None:
        stage, K, k = self._stage, self._num_stages, self._stage.stage_index
        activations: list[dist.P2POp] = []
        grads: list[dist.P2POp] = []
        forward = ticks.forward_micro_batch(next_tick, k, limit)
        if not stage.is_first and forward is not None:
            activations = stage.get_fwd_recv_ops(forward % self.slots)
        backward = None if stage.is_last else ticks.backward_micro_batch(next_tick, K, k, limit)
        if backward is not None:
            grads = stage.get_bwd_recv_ops(backward % self.slots)
        self.links.post(sends, activations, grads)

    def _wait(self, what: str) -> None:
        if what in self.received:  # restored from a checkpoint
            self.received.discard(what)
            return
        self.links.wait_grad() if what == "grad" else self.links.wait_activation()

    # -- checkpoints ----------------------------------------------------------------------------------------

    def fdg_state(self) -> dict[str, Any]:
        """What this rank needs to continue bit for bit besides its weights and optimizer (Note [in-flight state
        in a checkpoint]). Waits for the messages posted for the next tick (the neighbours sent them already)."""
        stage, K, k = self._stage, self._num_stages, self._stage.stage_index
        received: dict[str, tuple[int, list[Tensor]]] = {}
        forward = ticks.forward_micro_batch(self.segment_tick, k)
        if self.links.pending_activation() or "activation" in self.received:
            assert forward is not None
            self._wait("activation")
            received["activation"] = (forward % self.slots, _buffers(stage.args_recv_info[forward % self.slots]))
            self.received.add("activation")
        backward = ticks.backward_micro_batch(self.segment_tick, K, k)
        if self.links.pending_grad() or "grad" in self.received:
            assert backward is not None
            self._wait("grad")
            received["grad"] = (backward % self.slots, _buffers(stage.grad_recv_info[backward % self.slots]))
            self.received.add("grad")
        self.links.wait_sends()
        in_flight = {}
        for b, record in self.in_flight.items():
            held = record.held
            assert held is not None
            inputs = None if stage.is_first else _buffers(stage.args_recv_info[record.slot])
            in_flight[b] = {"slot": record.slot, "args": record.args, "kwargs": record.kwargs, "inputs": inputs,
                            "weights": held.weights, "saved": held.saved,
                            "rng_state": None if held.rng_state is None else tuple(held.rng_state)}  # fmt: skip
        return {
            "layout": self._layout(), "tick": self.tick, "segment_tick": self.segment_tick, "in_flight": in_flight,
            "received": received, "targets": list(self.targets), "later_kwargs": list(self.later_kwargs),
            "delta": self.corrections.capture(),
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in self.params],
            "scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "rng": torch.get_rng_state(), "auto": auto_corrections.recorded(self.config),
        }  # fmt: skip

    def load_fdg_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`fdg_state` of the same stage: counters, gradients and the scheduler now, the
        micro-batches in flight at the next ``step()`` (their graphs need the stage set up by that call)."""
        if state["layout"] != self._layout():
            raise ValueError(
                f"{self.name}: the checkpoint was saved by {state['layout']}, this job is {self._layout()}; resume "
                "with the pipeline (stages, data-parallel replicas, FDG modes) that saved it"
            )
        auto_corrections.check_resume(state["auto"], self.config, self.name)
        if self.in_flight or self.tick:
            raise ValueError(f"{self.name}: load a checkpoint into a new ScheduleFDG, before its first step()")
        self.tick, self.segment_tick = state["tick"], state["segment_tick"]
        self.targets = collections.deque(state["targets"])
        self.later_kwargs = collections.deque(state["later_kwargs"])
        self.corrections.restore(state["delta"])
        for p, grad in zip(self.params, state["grads"]):
            p.grad = grad
        if self.lr_scheduler is not None and state["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.restoring = state

    def _restore(self, state: dict[str, Any]) -> None:
        """Note [in-flight state in a checkpoint]: refill the receive buffers, rebuild the stored graphs."""
        stage = self._stage
        with torch.no_grad():
            for what, (slot, tensors) in state["received"].items():
                infos = stage.args_recv_info[slot] if what == "activation" else stage.grad_recv_info[slot]
                _fill(infos, tensors)
                self.received.add(what)
        rng = torch.get_rng_state()
        for b, record in sorted(state["in_flight"].items()):
            slot = record["slot"]
            if record["inputs"] is not None:
                with torch.no_grad():
                    _fill(stage.args_recv_info[slot], record["inputs"])
            held = Held(weights=record["weights"], rng_state=record["rng_state"], saved=record["saved"])
            with self.delayed.rebuilding(held) as rerun:  # Note [one direction]
                if rerun:
                    self._run_forward(slot, record["args"], record["kwargs"])
            self.in_flight[b] = InFlight(slot, record["args"], record["kwargs"], held)
        torch.set_rng_state(rng)

    def _resume_without_inputs(self, state: dict[str, Any]) -> None:
        """A drain as the first call after a load: torch's stage set-up reads an example micro-batch from what
        the checkpoint holds (the first stage's inputs in flight, the queued keyword inputs and targets)."""
        records = [state["in_flight"][b] for b in sorted(state["in_flight"])]
        stage = self._stage
        args = records[0]["args"] if stage.is_first and records else ()
        kwargs = records[0]["kwargs"] if stage.is_first and records else {}
        if not stage.is_first and state["later_kwargs"]:
            kwargs = state["later_kwargs"][0]
        target = state["targets"][0] if state["targets"] else None
        if not self._stage_forward_initialized:
            stage.has_backward = True
            self._initialize(args, kwargs, target, None)
        self._restore(state)

    def _layout(self) -> dict[str, Any]:
        dp = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        modes = {"weights": self.config.weights, "activations": self.config.activations}
        return {"stages": self._num_stages, "stage": self._stage.stage_index, "data_parallel": dp, **modes}

    # -- checks and set-up ---------------------------------------------------------------------------------

    def _check_step_inputs(self, arg_split: list[Any], kwarg_split: list[Any], target_split: list[Any] | None) -> None:
        stage = self._stage
        if stage.is_first and not all(arg_split):
            raise ValueError(f"{self.name} is the first stage: step() needs the batch, step(x, ...)")
        if not stage.is_first and any(arg_split):
            raise ValueError(
                f"{self.name} is not the first stage: its positional inputs come from the previous stage; call "
                "step() without them here (keyword inputs are fine: Note [keyword inputs of later stages])"
            )
        if stage.is_last and target_split is None:
            raise ValueError(f"{self.name} is the last stage: step() needs target=...")

    def _initialize(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_kwargs: Any) -> None:
        """torch's stage set-up (warm-up vote, metadata inference, buffers) with one chunk per buffer slot."""
        per_step, self._n_microbatches = self._n_microbatches, self.slots
        try:
            self._initialize_stage(args, kwargs, target, loss_kwargs)
        finally:
            self._n_microbatches = per_step

    def _check_outputs(self, micro_batch: int, outputs: tuple[Any, ...]) -> None:
        """The activation must have the shapes the next stage's receive buffers were made for."""
        expected = self._stage._stage_meta.outputs
        if expected is None:
            return
        got = [(tuple(o.shape), o.dtype) for o in outputs if torch.is_tensor(o)]
        want = [(tuple(m.shape), m.dtype) for m in expected if m is not None]
        if got != want:
            raise FDGRuntimeError(
                f"{self.name}: the activation of micro-batch {micro_batch} (tick {self.tick}) has shapes {got}, the "
                f"pipeline was set up for {want} (from the first micro-batch); give every micro-batch the same shape "
                "(n_microbatches must divide the batch)"
            )


def _buffers(infos: Any) -> list[Tensor]:
    return [info.buffer.detach().clone() for info in infos if info.buffer is not None]


def _fill(infos: Any, tensors: list[Tensor]) -> None:
    buffers = [info.buffer for info in infos if info.buffer is not None]
    for buffer, value in zip(buffers, tensors, strict=True):
        buffer.detach().copy_(value)
