"""``FDGPipelineEngine``: DeepSpeed's ``PipelineEngine`` running the FDG schedule.

The engine only executes: :class:`~fdg_schedule.sched.schedule.FDGTrainSchedule` decides what happens
at each tick (and how a segment ends), :class:`~fdg_schedule.runtime.stage_state.StageState` holds what
is in flight between ticks, :class:`~fdg_schedule.corrections.delayed.DelayedBackward` is the context the stage's
forwards and delayed backwards run inside (the engine calls into ``corrections/``, never the other way: Note [one
direction] there), :class:`~fdg_schedule.exchange.comm.NeighbourExchange` moves tensors. DeepSpeed's own
data loading, gradient all-reduce, optimizer wrappers, checkpoints and monitors are reused as they are.

What ``train_batch()`` returns on each rank: the mean loss of the micro-batches this stage
*back-propagated* during the call, averaged over the stage's data-parallel group. On the last
stage these are the losses computed in the call; on stage k they arrived with the gradients,
``K-1-k`` ticks after the last stage computed them. NaN while the pipeline is filling and no
loss has reached the stage yet.
"""

from __future__ import annotations

import math
import time
from typing import Any, cast

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import PipeInstruction, ReduceGrads
from deepspeed.utils import logger
from torch import Tensor

from fdg_schedule.base import dispatch, guards, host_memory, optim
from fdg_schedule.base.config import FDGConfig
from fdg_schedule.base.errors import DataExhausted, FDGRuntimeError
from fdg_schedule.base.tensors import as_tuple, describe, floating, input_grads, to_device
from fdg_schedule.checkpointing.replicas import Replicas
from fdg_schedule.corrections import auto_corrections
from fdg_schedule.corrections.delayed import DelayedBackward
from fdg_schedule.corrections.staleness import Corrections, StalenessMeter
from fdg_schedule.exchange import tied
from fdg_schedule.exchange.comm import NO_END, NeighbourExchange, meta_of
from fdg_schedule.observability import observe
from fdg_schedule.observability.report import print_flops_profile, report_call
from fdg_schedule.precision import fp16
from fdg_schedule.runtime import loading, stage_view
from fdg_schedule.runtime.engine_checkpoints import FDGCheckpoints
from fdg_schedule.runtime.stage_backward import stage_backward
from fdg_schedule.runtime.stage_state import InFlight, StageState
from fdg_schedule.sched import grid, schedule, ticks
from fdg_schedule.sched.kinds import Kind
from fdg_schedule.sched.outcomes import DataEnded, LabelsEnded
from fdg_schedule.sched.schedule import KINDS, FDGTrainSchedule, ScheduleRun


# Three handlers that are one call to the exchange each (Note [each message when it exists] in
# fdg_schedule.exchange.comm), kept out of the engine class.
def _send_grad(engine: FDGPipelineEngine, buffer_id: int, micro_batch: int) -> None:
    sent = engine.fdg_state.records.pop(buffer_id).to_send  # the micro-batch leaves the stage
    assert sent is not None
    engine._exchange.send_grad(*sent)


def _post_recv_activation(engine: FDGPipelineEngine, buffer_id: int, micro_batch: int) -> None:
    engine._exchange.post_recv_activation()


def _post_recv_grad(engine: FDGPipelineEngine, buffer_id: int, micro_batch: int) -> None:
    meta = engine.fdg_state.records[buffer_id].sent_meta  # its forward's activation shapes
    assert meta is not None
    engine._exchange.post_recv_grad(meta)


def _loss(engine: FDGPipelineEngine, outputs: Any, labels: Any, micro_batch: int) -> Tensor:
    """The last stage's loss of ``micro_batch``: the module's ``loss_fn``, or the outputs where the model returns it."""
    if engine.module.loss_fn is None:
        return cast(Tensor, outputs)
    try:
        return cast(Tensor, engine.module.loss_fn(outputs, labels))
    except (RuntimeError, TypeError, ValueError) as err:
        raise FDGRuntimeError(
            f"{engine._where()}: loss_fn failed on micro-batch {micro_batch} "
            f"with outputs {describe(outputs)} and labels {describe(labels)}: {err}"
        ) from err


def _no_plan() -> str:
    return ""  # between calls: no schedule is running


def _set_up_host(engine: FDGPipelineEngine, config: FDGConfig) -> None:
    """``pipeline.fdg.host_memory`` on a CPU device; rank 0 logs it and the transport ``"auto"`` chose."""
    if config.host_memory == "retain" and engine.device.type == "cpu":
        host_memory.retain_freed_memory()
    if engine.global_rank == 0:
        logger.info(
            f"fdg_schedule: transport {config.transport!r} runs {engine._exchange.transport!r}, host memory "
            f"{host_memory.describe()} (pipeline.fdg.transport / host_memory; Note [the fastest transport by "
            "default] in fdg_schedule.exchange.comm)"
        )


def _complete_exchange(engine: FDGPipelineEngine) -> None:
    """Wait for every message posted (Note [no wait between calls]): the time counts as waiting."""
    start = time.perf_counter()
    engine._exchange.complete()
    engine.fdg_stats["wait_s"] += time.perf_counter() - start


class FDGPipelineEngine(FDGCheckpoints):
    """A ``PipelineEngine`` whose ``train_batch()`` runs FDG ticks instead of a 1F1B batch.

    Built by ``deepspeed.initialize`` when the config has ``"pipeline": {"schedule": "fdg"}`` and
    ``fdg_schedule`` is imported (or through :func:`fdg_schedule.initialize`).
    """

    pipe_buffers: dict[str, list[Any]]  # DeepSpeed's, typed for mypy
    num_pipe_buffers: int

    def __init__(self, *args: Any, fdg_config: FDGConfig, **kwargs: Any) -> None:
        # Note [tied layers across stages]: the tied copies get an optimizer of their own, never DeepSpeed's.
        ties = tied.find_ties(kwargs.get("model"))
        if ties:
            tied.check_own_parameters(kwargs["model"], ties)
            model_parameters = kwargs.get("model_parameters")
            kwargs["model_parameters"] = tied.take_out(ties, kwargs.get("optimizer"), model_parameters, kwargs["model"])
        kwargs["optimizer"] = optim.explain_client_optimizer(kwargs.get("optimizer"), kwargs.get("model"))
        super().__init__(*args, **kwargs)
        self.fdg_config = fdg_config = auto_corrections.for_engine(fdg_config, self)  # Note [the auto rule]
        optim.decouple_from_other_stages(self.optimizer, self.basic_optimizer)
        rank = lambda stage: self.grid.stage_to_global(stage) if 0 <= stage < self.num_stages else None  # noqa: E731
        self._tie_keys = list(tied.owners(self.module))  # every rank's, also where it holds no copy
        scale_config = fp16.scale_config(self)  # Note [loss scale per stage]; None: no fp16
        self._exchange = NeighbourExchange(
            rank(self.stage_id - 1), rank(self.stage_id + 1), self.device, self.dynamic_shape, self.stage_id,
            timeout_s=fdg_config.timeout, describe=self._describe, transport=fdg_config.transport,
            loss_scale=scale_config is not None,
        )  # fmt: skip
        _set_up_host(self, fdg_config)
        self._replicas = Replicas(self.grid, self.stage_id, fdg_config.timeout, self._where(), self.device)
        self._delayed = DelayedBackward(self.module, fdg_config, delayed=(delayed := not self.is_last_stage()))
        self._tied = tied.TiedSync(
            ties, self.stage_id, self.basic_optimizer, self.optimizer, self.grid.get_data_parallel_group(),
            self.dp_world_size, self._replicas.collective, self._where(), bool(self._tie_keys), bool(scale_config),
        )  # fmt: skip
        # Every parameter of the stage, listed once: the module's parameters are fixed once DeepSpeed has built its
        # optimizer, and walking the module each tick (for the reduce's zero-fill and zero_grad) cost ~0.2 ms each.
        self._params = list(self.module.parameters())
        self._own_params = self._tied.without(self._params)  # stepped by the stage's optimizer
        params, every = self._delayed.params, fdg_config.staleness_every
        corrected = self._tied.without(params)  # tied copies are never predicted nor lr-scaled
        corrections = Corrections(corrected, self.num_stages, self.stage_id, fdg_config, self.optimizer, self._where())
        # Counters, seconds spent per kind of instruction ("<kind>_s", see sched.kinds.Kind), the latest staleness
        # measured (NaN until then; the last stage's is 0 by definition) and, with fp16, the loss scale.
        self.fdg_stats: dict[str, float] = {"ticks": 0, "steps": 0, "skipped": 0, **{f"{k.value}_s": 0.0 for k in Kind}}
        self.fdg_stats["staleness"] = 0.0 if every and not delayed else math.nan
        self.fdg_stats["staleness_tick"] = math.nan  # the tick of the backward it was measured at
        scaling = fp16.StageScaling(scale_config, self.optimizer, self._exchange, self.is_first_stage(),
                                    not delayed, fdg_config.accumulate, self.fdg_stats)  # fmt: skip
        self.fdg_state = StageState(
            self.num_stages, self._exchange, corrections=corrections,
            meter=StalenessMeter(params, every, delayed), tied=self._tied, scaling=scaling,
        )  # fmt: skip
        self._watch = guards.NonFiniteWatch()  # Note [no host sync in a tick]
        self.observers = observe.observers_from_config(stage_view.view(self), self._config._param_dict)
        self._reduce_is_identity = optim.reduce_is_identity(self)

    # -- public ---------------------------------------------------------------------------------

    def train_batch(self, data_iter: Any = None) -> Tensor:
        """Run ``gradient_accumulation_steps`` FDG ticks; see the module docstring for the return value.

        When the data iterator runs out, every rank drains and raises
        :class:`~fdg_schedule.DataExhausted` (a ``StopIteration``) in the same call: the one holding
        the tick at which stage 0 back-propagates the last micro-batch (Note [end of data]).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise FDGRuntimeError(
                f"{self._where()} reads data but has none: pass "
                "train_batch(data_iter=...) or deepspeed.initialize(training_data=...)"
            )
        return self._run(self._schedule(self.micro_batches))

    def drain(self) -> Tensor:
        """Finish every in-flight backward pass without starting new micro-batches.

        Runs ``2(K-1)`` ticks (the same on every stage); afterwards the pipeline is empty, every
        accumulated gradient has been stepped, and the next ``train_batch()`` fills it again.
        Use it at the end of training and before a schedule-independent checkpoint. On an empty
        pipeline (nothing entered since the last drain) it does nothing and returns NaN.
        """
        state = self.fdg_state
        if state.segment_tick == 0:  # every stage agrees: nothing is in flight
            return torch.tensor(math.nan, device=self.device)
        try:
            if state.segment_limit is not None:  # the data already ended: finish that segment
                return self._run(self._schedule(state.ticks_left()))
            # (if stage 0's data ended and this stage does not know yet, it learns it during the drain)
            loss = self._run(self._schedule(ticks.drain_ticks(self.num_stages), drain=True))
        except DataExhausted as ended:  # the data had ended: the drain ends that segment, on every rank
            return cast(Tensor, ended.loss)
        state.segment_tick = 0
        return loss

    def in_flight(self) -> int:
        """Micro-batches this stage has forwarded but not yet back-propagated."""
        return self.fdg_state.in_flight()

    def held_bytes(self) -> int:
        """Bytes held on this stage for delayed backward passes (activations, inputs, weight snapshots)."""
        return self.fdg_state.held_bytes()

    @property
    def micro_batches_read(self) -> int:
        """Micro-batches this rank has read from its data iterator (where to restart the data after a resume)."""
        return self.fdg_state.micro_batches_read

    def eval_batch(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``eval_batch``, on pipe buffers of its own that it drops after (FDG keeps its work in flight
        in ``fdg_state.records``)."""
        fdg_buffers, fdg_count = self.pipe_buffers, self.num_pipe_buffers
        self.pipe_buffers = {key: [] for key in fdg_buffers}
        self.num_pipe_buffers = 0
        try:
            return super().eval_batch(*args, **kwargs)
        finally:
            self.pipe_buffers, self.num_pipe_buffers = fdg_buffers, fdg_count

    # -- running ticks ----------------------------------------------------------------------------

    def _schedule(self, micro_batches: int, drain: bool = False) -> FDGTrainSchedule:
        """The next ``micro_batches`` ticks of this stage's segment (fewer if the segment ends first)."""
        state, accumulate = self.fdg_state, self.fdg_config.accumulate
        return FDGTrainSchedule(micro_batches, self.num_stages, self.stage_id, state.segment_tick, accumulate, drain,
                                limit=state.segment_limit)  # fmt: skip

    def _run(self, plan: FDGTrainSchedule) -> Tensor:
        self.module.train()
        self.fdg_state.call_losses = []
        steps_before, start = self.global_steps, time.perf_counter()
        run = ScheduleRun(plan)  # told what the handlers found out (the dispatch loop hands it their outcomes)
        self._exchange.plan = lambda: grid.around(run.schedule, self.fdg_state.segment_tick)  # errors print it
        try:
            self._exec_schedule(run)
        finally:
            self._exchange.plan = _no_plan
        limit = self.fdg_state.segment_limit
        try:
            self._watch.check(self._where())  # the call's one host read (Note [no host sync in a tick])
        except guards.NonFiniteError as err:
            others = self._replicas.agree(limit, failed=err.what)  # Note [replicas end together]
            if others:
                raise guards.NonFiniteError(f"{err}; {others}", err.what) from err
            raise
        self._replicas.agree(limit)
        self.fdg_state.meter.report_new(self.fdg_stats)
        data_ended = self.fdg_state.segment_over()
        if data_ended or plan.drain:  # Note [no wait between calls] in fdg_schedule.exchange.comm: a segment's end
            _complete_exchange(self)
        self.agg_train_loss = self._replicas.mean_loss(
            self.fdg_state.call_losses, self.grid.get_data_parallel_group(), self.device
        )
        elapsed = time.perf_counter() - start
        report_call(self, steps_before, elapsed)
        stage_view.call_ended(self, elapsed)
        if data_ended:
            raise DataExhausted(self.agg_train_loss)
        return self.agg_train_loss

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        """DeepSpeed's dispatch loop (``eval_batch`` runs through it too), every instruction timed and observed."""
        dispatch.execute(self, pipe_schedule, self._after_instruction)

    def _after_instruction(self, cmd: PipeInstruction, start: float, end: float) -> None:
        kind = KINDS.get(type(cmd))
        if kind is not None:
            self.fdg_stats[f"{kind.value}_s"] += end - start
        stage_view.instruction_ran(self, cmd, start, end)

    def _data_ended(self, limit: int) -> DataEnded:
        """Note [end of data]: this stage just learned that its segment has ``limit`` micro-batches."""
        self.fdg_state.segment_limit = limit
        # Ticks since micro-batch `limit` would have entered counted one as entering on this stage.
        late = self.fdg_state.segment_tick - limit
        self.global_samples -= late * self.train_micro_batch_size_per_gpu() * self.dp_world_size
        return DataEnded(limit)  # for the run: the dispatch loop hands it on

    # -- instruction handlers -------------------------------------------------------------------

    def _exec_fdg_load(self, buffer_id: int, micro_batch: int) -> DataEnded | None:
        try:
            if self.is_first_stage():  # inputs (and labels too when K = 1), as DeepSpeed loads them
                inputs, labels = loading.load_micro_batch(self)  # Note [no host sync in a tick]: non_blocking copies
                guards.check_inputs(inputs, micro_batch, guards.training_dtype(self), self._where())
                self.fdg_state.enter(buffer_id, inputs, labels)
            else:  # Note [labels read when the inputs are]
                self.fdg_state.labels_in_flight.append(to_device(self._next_batch()[1], self.device))
        except StopIteration:
            # the last stage learns the end from upstream, with the micro-batch that is missing
            return self._data_ended(micro_batch) if self.is_first_stage() else None
        self.fdg_state.micro_batches_read += 1
        return None

    def _exec_wait_activation(self, buffer_id: int, micro_batch: int) -> DataEnded | None:
        received, end = self._exchange.wait_activation(lend=True)
        if end != NO_END:  # a dummy where micro-batch `end` would be: the data ended (Note [end of data])
            return self._data_ended(end)
        for t in received:
            t.requires_grad_(t.is_floating_point())
        self.fdg_state.enter(buffer_id, received[0] if len(received) == 1 else received)
        return None

    def _exec_wait_grad(self, buffer_id: int, micro_batch: int) -> None:
        self.fdg_state.records[buffer_id].received = self._exchange.wait_grad(lend=True)

    def _exec_fdg_forward(self, buffer_id: int, micro_batch: int) -> LabelsEnded | None:
        state = self.fdg_state
        record = state.records[buffer_id]
        with state.predicted_forward(keep=lambda: self.fdg_config.weights == "stashed" and record.loss is not None):
            inputs = record.inputs
            with self._delayed.forwarding() as forward:  # Note [one direction] in fdg_schedule.corrections.delayed
                forward.outputs = self._stage_forward(inputs, received=True)
            record.outputs, record.held = forward.outputs, forward.held
            if record.held is not None:
                record.probe = state.meter.after_forward(state.tick, record.held.weights)
            if not self.is_last_stage():
                record.sent_meta = meta_of(floating(record.outputs))
                return None
            first = self.is_first_stage()  # K = 1 reads its labels with the inputs
            labels = record.labels if first else state.next_labels(micro_batch, self._where)
            # Note [end of data]: none read for the next one
            ended = None if first or state.labels_in_flight else LabelsEnded(micro_batch + 1)
            record.loss = _loss(self, record.outputs, labels, micro_batch)
            return ended

    def _exec_fdg_backward(self, buffer_id: int, micro_batch: int) -> None:
        record = self.fdg_state.records[buffer_id]
        if self.is_last_stage():
            loss, record.loss = record.loss, None
            assert loss is not None
            if self.fdg_config.nonfinite == "error":  # under "skip" the gradient's check skips the step
                self._watch.record("loss", loss, self.global_steps, micro_batch)
            scaled = self.fdg_state.scaling.scale_loss(loss, micro_batch)  # / accumulate, not GAS; fp16: x the scale
            with self.fdg_state.last_prediction:  # the forward's predicted weights, back to w after
                DeepSpeedEngine.backward(self, scaled, scale_wrt_gas=False)
            carried = loss.detach().float()
            self._tied.after_backward(self.fdg_state.scaling.backward_scale)  # fp16: unscaled by S
        else:
            assert record.received is not None and record.held is not None
            (grads, carried), held = record.received, record.held
            if self.fdg_config.grad_shrink != 1.0:
                grads = tuple(g.mul_(self.fdg_config.grad_shrink) for g in grads)
            self.fdg_state.meter.before_backward(self.fdg_state.tick, record.probe)  # the live weights are w_bwd
            with self._delayed.backward(held) as rerun:  # stashed weights swapped in; recomputed: RNG replayed
                outputs = self._stage_forward(record.inputs) if rerun else record.outputs
                stage_backward(self, floating(outputs), grads, self._where)
            self._tied.after_backward(self.fdg_state.scaling.backward_scale)  # before the reduce; fp16: unscaled
        self.fdg_state.call_losses.append(carried)
        if self.is_first_stage():
            del self.fdg_state.records[buffer_id]  # the micro-batch leaves the stage
            return
        sent = self.fdg_state.scaling.carry(carried)  # the loss and, with fp16, its scale
        # only the message stays, for SendGrad, which ends the record
        self.fdg_state.records[buffer_id] = InFlight(to_send=(input_grads(record.inputs), sent))

    def _exec_reduce_grads(self) -> None:
        """DeepSpeed's gradient all-reduce among this stage's replicas, bounded (Note [replicas end together])."""
        # Note [gradient reduce with one data-parallel rank]: skip the identity all-reduce every tick.
        with self._tied.hidden():  # Note [tied layers across stages]: their gradients are reduced apart
            if not (self._reduce_is_identity and optim.fill_missing_grads(self._params)):
                with self._replicas.collective("the gradient all-reduce"):
                    super()._exec_reduce_grads()

    def _exec_local_optimizer_step(self) -> None:
        wrapped = self.bfloat16_enabled() or self.zero_optimization() or self.fp16_enabled()
        self._force_grad_boundary = True
        try:
            finite = self._step(wrapped)
            self.optimizer.zero_grad() if wrapped else optim.clear_grads(self._params)  # DeepSpeed's zero_grad
        finally:
            self._force_grad_boundary = False
        scaling = self.fdg_state.scaling
        floor = scaling.after_step(overflow=not finite)  # Note [loss scale per stage]
        if wrapped:  # the wrapper's norm, computed stage-locally (optim.decouple_from_other_stages)
            self._global_grad_norm = getattr(self.optimizer, "_global_grad_norm", 0.0)
        if finite:
            self.fdg_stats["steps"] += 1
        else:
            self.skipped_steps += 1  # as DeepSpeed counts an overflow step
            self._non_finite(scaling.describe_floor() if floor else None if scaling.enabled else "gradient")

    def _step(self, wrapped: bool) -> bool:
        """One optimizer step of this stage, with the delay-aware lr (fdg_schedule.corrections.staleness); False when
        it was skipped for a non-finite gradient.

        Note [no host sync in a tick]: under ``nonfinite="error"`` the stage norm's check is queued
        and the step taken (the run stops at the next read); only ``"skip"`` reads it before stepping.
        The bf16, fp16 and ZeRO wrappers check (and skip) non-finite steps themselves, inside DeepSpeed.
        """
        if not wrapped:
            norm = optim.clip_stage_local(self._own_params, self.gradient_clipping())
            self._global_grad_norm = norm  # get_global_grad_norm(): this stage's own norm, left on the device
            if not self._watch.allows(self.fdg_config.nonfinite, "gradient", norm, self.global_steps):
                return False
        with self.fdg_state.corrections.stepping(self.optimizer, self.fdg_state.tick) as step:  # lr, momentum, delta
            step.taken = self._optimizer_step()
        return step.taken

    def _optimizer_step(self) -> bool:
        """One step of the optimizer DeepSpeed built; False when it skipped it (a wrapper's overflow check)."""
        with self.fdg_state.scaling.stepping(self._tied.overflowed):  # fp16: the gradients' scale; a tied overflow
            self._start_timers(self.engine_timers.step_timers)
            self.optimizer.step()
            self._stop_timers(self.engine_timers.step_timers)
        return not getattr(self.optimizer, "overflow", False)

    def _exec_send_activation(self, buffer_id: int, micro_batch: int, end: bool) -> None:
        record = None if end else self.fdg_state.records[buffer_id]  # end: no micro-batch, the end word
        activation = None if record is None else as_tuple(record.outputs)
        if record is not None and self._delayed.recompute:  # only the input waits for the backward
            record.outputs = None
        ceiling = self.fdg_state.scaling.ceiling(sending=not end)
        self._exchange.send_activation(activation, micro_batch if end else NO_END, ceiling)

    def _exec_exchange(self) -> None:
        self._exchange.finish_tick(peers=self._tied.messages())

    def _exec_advance_tick(self, entered: bool, last: bool) -> None:
        print_flops_profile(self)
        self.fdg_state.tick += 1
        self.fdg_state.segment_tick += 1
        self.global_steps += 1
        if entered:
            self.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if self.lr_scheduler is not None and ticks.scheduler_steps_after(self.global_steps, self.fdg_config.accumulate):
            self.lr_scheduler.step()  # Note [learning rate per optimizer step]
        if self._tied:
            self._tied_step(segment_over=last)
        self.fdg_stats["ticks"] += 1
        every = self.fdg_config.check_every
        if every and self.global_steps % every == 0:
            self._watch.check(self._where())

    def _tied_step(self, segment_over: bool) -> None:
        """Note [tied layers across stages]: the tied step of the tick that starts now (after the LR scheduler)."""
        start = time.perf_counter()
        self._exchange.wait_peers()
        self.fdg_stats["wait_s"] += time.perf_counter() - start
        lrs, clip, tick, gas = self.get_lr(), self.gradient_clipping(), self.fdg_state.tick, self.fdg_config.accumulate
        self.fdg_stats["skipped"] += self._tied.apply(tick, gas, lrs, clip, self._tied_guard, segment_over)  # fp16

    def _tied_guard(self, norm: Tensor) -> bool:
        """pipeline.fdg.nonfinite for a tied step: queue the check ("error"), or skip and count it ("skip")."""
        allowed = self._watch.allows(self.fdg_config.nonfinite, "tied gradient", norm, self.global_steps)
        self.fdg_stats["skipped"] += not allowed
        return allowed

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.FDGLoad: _exec_fdg_load,
        schedule.WaitActivation: _exec_wait_activation,
        schedule.WaitGrad: _exec_wait_grad,
        schedule.FDGForward: _exec_fdg_forward,
        schedule.FDGBackward: _exec_fdg_backward,
        schedule.ReduceGrads: _exec_reduce_grads,
        schedule.LocalOptimizerStep: _exec_local_optimizer_step,
        schedule.SendActivation: _exec_send_activation,
        schedule.SendGrad: _send_grad,
        schedule.PostRecvActivation: _post_recv_activation,
        schedule.PostRecvGrad: _post_recv_grad,
        schedule.Exchange: _exec_exchange,
        schedule.AdvanceTick: _exec_advance_tick,
        ReduceGrads: _exec_reduce_grads,
    }

    # -- helpers --------------------------------------------------------------------------------

    def _non_finite(self, what: str | None) -> None:
        """A skipped step: nonfinite "error" raises naming ``what``; else, or None (an fp16 overflow), counted."""
        if what is not None and self.fdg_config.nonfinite == "error":
            raise guards.non_finite(what, self._where(), self.global_steps)
        self.fdg_stats["skipped"] += 1

    def _where(self) -> str:
        return self._describe(self.stage_id, self.global_rank)

    def _describe(self, stage: int, rank: int | None) -> str:
        """A stage of this pipeline replica in messages: ``stage 1 (global rank 3, data-parallel replica 1)``."""
        replica = f", data-parallel replica {self.grid.data_parallel_id}" if self.dp_world_size > 1 else ""
        return f"stage {stage} (global rank {rank}{replica})"

    def _stage_forward(self, inputs: Any, received: bool = False) -> Any:
        # A clone, as in DeepSpeed: layers may write into their input; the buffer stays the leaf.
        cloned = tuple(t.clone() for t in inputs) if isinstance(inputs, tuple) else inputs.clone()
        outputs = DeepSpeedEngine.forward(self, cloned)
        if received:  # Note [a lent message]: the clone was the one read of a received activation
            self._exchange.own_activation(as_tuple(inputs), as_tuple(cloned))
        return outputs
