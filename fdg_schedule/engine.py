"""``FDGPipelineEngine``: DeepSpeed's ``PipelineEngine`` running the FDG schedule.

The engine only executes: :class:`~fdg_schedule.schedule.FDGTrainSchedule` decides what happens
at each tick, :class:`~fdg_schedule.delayed.DelayedBackward` keeps what a delayed backward needs,
:class:`~fdg_schedule.comm.NeighbourExchange` moves tensors. DeepSpeed's own data loading,
gradient all-reduce, optimizer wrappers, checkpoints and monitors are reused as they are.

What ``train_batch()`` returns on each rank: the mean loss of the micro-batches this stage
*back-propagated* during the call, averaged over the stage's data-parallel group. On the last
stage these are the losses computed in the call; on stage k they arrived with the gradients,
``K-1-k`` ticks after the last stage computed them. NaN while the pipeline is filling and no
loss has reached the stage yet.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import PipeInstruction, ReduceGrads
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import logger
from torch import Tensor

from fdg_schedule import checkpoint, ticks
from fdg_schedule.comm import NO_END, Meta, NeighbourExchange, meta_of
from fdg_schedule.config import FDGConfig, FDGConfigError
from fdg_schedule.delayed import DelayedBackward
from fdg_schedule.errors import DataExhausted, FDGRuntimeError, _DataEnded
from fdg_schedule.observe import Observer, observers_from_config
from fdg_schedule.schedule import (
    AdvanceTick,
    Exchange,
    FDGBackward,
    FDGForward,
    FDGLoad,
    FDGTrainSchedule,
    LocalOptimizerStep,
    WaitActivation,
    WaitGrad,
)

# What each instruction's time counts as in ``fdg_stats`` ("<kind>_s") and in traces.
_KINDS: dict[type, str] = {
    FDGForward: "forward",
    FDGBackward: "backward",
    LocalOptimizerStep: "step",
    ReduceGrads: "reduce",
    WaitActivation: "wait",
    WaitGrad: "wait",
    FDGLoad: "load",
    Exchange: "exchange",
}


class FDGPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` whose ``train_batch()`` runs FDG ticks instead of a 1F1B batch.

    Built by ``deepspeed.initialize`` when the config has ``"pipeline": {"schedule": "fdg"}`` and
    ``fdg_schedule`` is imported (or through :func:`fdg_schedule.initialize`).
    """

    pipe_buffers: dict[str, list[Any]]  # DeepSpeed's, typed for mypy
    num_pipe_buffers: int
    fwd_outputs: list[Any]

    def __init__(self, *args: Any, fdg_config: FDGConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fdg_config = fdg_config
        self._decouple_optimizer_from_other_stages()
        self._exchange = NeighbourExchange(
            prev_rank=None if self.is_first_stage() else self.grid.stage_to_global(self.prev_stage),
            next_rank=None if self.is_last_stage() else self.grid.stage_to_global(self.next_stage),
            device=self.device,
            dynamic_shape=self.dynamic_shape,
            describe=lambda stage, rank: f"stage {stage} (global rank {rank})",
            stage_id=self.stage_id,
            timeout_s=fdg_config.timeout,
        )
        self._delayed = DelayedBackward(self.module, fdg_config, delayed=not self.is_last_stage())
        self.segment_tick = 0  # ticks since the pipeline last filled (micro-batch 0 of the segment)
        self._sent_meta: dict[int, Meta] = {}  # buffer -> activation shapes, for the gradient receive
        self._received: dict[int, tuple[tuple[Tensor, ...], Tensor]] = {}  # buffer -> grads, loss
        self._to_send: dict[int, tuple[tuple[Tensor, ...], Tensor]] = {}  # buffer -> input grads, loss
        self._losses: dict[int, Tensor] = {}  # buffer -> loss (last stage)
        self.labels_in_flight: collections.deque[Any] = collections.deque()  # last stage, K > 1
        self.micro_batches_read = 0  # from the data iterator on this rank (first and last stage)
        self._send_end: int | None = None  # Note [end of data]: pass the end downstream this tick
        self.segment_limit: int | None = None  # micro-batches in this segment, once the data has ended
        self._call_losses: list[Tensor] = []
        self.fdg_stats: dict[str, float] = {
            "ticks": 0,
            "steps": 0,
            "skipped": 0,
            **{f"{k}_s": 0.0 for k in _KINDS.values()},
        }
        self.observers: list[Observer] = observers_from_config(self)

    # -- public ---------------------------------------------------------------------------------

    def train_batch(self, data_iter: Any = None) -> Tensor:
        """Run ``gradient_accumulation_steps`` FDG ticks; see the module docstring for the return value.

        When the data iterator runs out, every rank drains and raises
        :class:`~fdg_schedule.DataExhausted` (a ``StopIteration``) in the same call: the one holding
        the tick at which stage 0 back-propagates the last micro-batch.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise FDGRuntimeError(
                f"stage {self.stage_id} (global rank {self.global_rank}) reads data but has none: pass "
                "train_batch(data_iter=...) or deepspeed.initialize(training_data=...)"
            )
        return self._run(self._schedule(self.micro_batches, drain=False))

    def drain(self) -> Tensor:
        """Finish every in-flight backward pass without starting new micro-batches.

        Runs ``2(K-1)`` ticks (the same on every stage); afterwards the pipeline is empty, every
        accumulated gradient has been stepped, and the next ``train_batch()`` fills it again.
        Use it at the end of training and before a schedule-independent checkpoint. On an empty
        pipeline (nothing entered since the last drain) it does nothing and returns NaN.
        """
        if self.segment_tick == 0:  # every stage agrees: nothing is in flight
            return torch.tensor(math.nan, device=self.device)
        if self.segment_limit is not None:  # the data already ended: finish that segment
            return self._run(self._schedule(self._last_tick() + 1 - self.segment_tick, drain=False))
        loss = self._run(self._schedule(ticks.drain_ticks(self.num_stages), drain=True))
        self.segment_tick = 0
        return loss

    def in_flight(self) -> int:
        """Micro-batches this stage has forwarded but not yet back-propagated."""
        return len(self._delayed.held)

    def held_bytes(self) -> int:
        """Bytes held on this stage for delayed backward passes (activations, inputs, weight snapshots)."""
        inputs = sum(_nbytes(self.pipe_buffers["inputs"][b]) for b in self._delayed.held if b < self.num_pipe_buffers)
        return inputs + self._delayed.held_bytes()

    def eval_batch(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``eval_batch``, run on its own buffers so in-flight FDG work is untouched."""
        fdg_buffers, fdg_count = self.pipe_buffers, self.num_pipe_buffers
        self.pipe_buffers = {key: [] for key in fdg_buffers}
        self.num_pipe_buffers = 0
        try:
            return super().eval_batch(*args, **kwargs)
        finally:
            self.pipe_buffers, self.num_pipe_buffers = fdg_buffers, fdg_count

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        drain: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint`` plus this rank's in-flight FDG state (see :mod:`fdg_schedule.checkpoint`).

        Every rank must call it at the same tick (between ``train_batch()`` calls). ``drain=True``
        first finishes every in-flight backward pass: a checkpoint any schedule can continue from.
        """
        if drain:
            self.drain()
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        path = checkpoint.state_path(save_dir, tag, self.stage_id, self.grid.data_parallel_id)
        checkpoint.atomic_save(checkpoint.capture(self), path)
        saved = super().save_checkpoint(
            save_dir,
            tag=tag,
            client_state=client_state or {},
            save_latest=False,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        if save_latest:  # only once every rank has written every file
            dist.barrier()
            if self.global_rank == 0:
                checkpoint.write_latest(save_dir, tag)
            dist.barrier()
        return saved

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, Any]:
        """DeepSpeed's ``load_checkpoint``, then the in-flight FDG state of this rank.

        The in-flight micro-batches are rebuilt exactly when the checkpoint was saved by an FDG job
        with the same stages, data parallelism and modes; otherwise they are dropped with a log line
        saying how many. A checkpoint of another number of stages loads its weights (re-partitioned
        by layer) when optimizer and scheduler state are not requested.
        """
        resolved = checkpoint.resolve_tag(load_dir, tag)
        saved_stages = None if resolved is None else checkpoint.saved_stages(load_dir, resolved)
        other_stages = saved_stages is not None and saved_stages != self.num_stages
        if other_stages and not load_module_only and (load_optimizer_states or load_lr_scheduler_states):
            raise FDGConfigError(
                f"checkpoint {os.path.join(load_dir, str(resolved))} has {saved_stages} pipeline stages, this job "
                f"{self.num_stages}: optimizer and LR-scheduler state are per stage and cannot be re-partitioned; "
                "call load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False) to load "
                "the weights (re-partitioned by layer)"
            )
        load_path, client_state = super().load_checkpoint(
            load_dir,
            tag=resolved,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        if load_path is None or resolved is None:
            return load_path, client_state
        if other_stages:
            logger.warning(f"stage {self.stage_id}: client_state dropped: it belongs to another pipeline layout")
            client_state = {}
        checkpoint.restore(self, load_dir, resolved)
        return load_path, client_state

    def _reset_pipeline(self) -> None:
        """Forget all in-flight work (before loading a checkpoint)."""
        self._delayed.clear()
        for store in (self._received, self._to_send, self._losses, self._sent_meta):
            store.clear()
        self.labels_in_flight.clear()
        self._exchange.restore_received(None)
        self.segment_tick = 0
        for buffers in self.pipe_buffers.values():
            buffers[:] = [None] * len(buffers)

    # -- running ticks ----------------------------------------------------------------------------

    def _schedule(self, micro_batches: int, drain: bool, start_tick: int | None = None) -> FDGTrainSchedule:
        start = self.segment_tick if start_tick is None else start_tick
        if self.segment_limit is not None and not drain:  # the data has ended: finish the segment
            micro_batches = max(0, min(micro_batches, self._last_tick() + 1 - start))
        return FDGTrainSchedule(
            micro_batches=micro_batches,
            stages=self.num_stages,
            stage_id=self.stage_id,
            start_tick=start,
            accumulate=self.fdg_config.accumulate,
            drain=drain,
            limit=self.segment_limit,
        )

    def _run(self, schedule: FDGTrainSchedule) -> Tensor:
        self.module.train()
        self._call_losses = []
        steps_before = self.global_steps
        start = time.perf_counter()
        data_ended = self._exec_ticks(schedule)
        wait_start = time.perf_counter()
        self._exchange.complete()
        self.fdg_stats["wait_s"] += time.perf_counter() - wait_start
        self.agg_train_loss = self._mean_call_loss()
        elapsed = time.perf_counter() - start
        self._report(steps_before, elapsed)
        for observer in self.observers:
            observer.on_call_end(self, elapsed)
        if data_ended:
            raise DataExhausted(self.agg_train_loss)
        return self.agg_train_loss

    def _exec_ticks(self, schedule: FDGTrainSchedule) -> bool:
        """Run the schedule tick by tick; True when the data has ended and the pipeline is drained."""
        self._reserve_pipe_buffers(schedule.num_pipe_buffers())
        call_end = schedule.start_tick + schedule.micro_batches
        for tick, cmds in zip(itertools.count(schedule.start_tick), schedule.steps()):
            done: list[PipeInstruction] = []
            try:
                for cmd in cmds:
                    self._exec_instruction(cmd)
                    done.append(cmd)
            except _DataEnded as ended:
                self._learn_data_end(tick, ended.limit, done)
                rest = self._schedule(call_end - tick - 1, drain=False, start_tick=tick + 1)
                for later in rest.steps():
                    for cmd in later:
                        self._exec_instruction(cmd)
                break
        if self.segment_limit is None or self.segment_tick <= self._last_tick():
            return False
        self.segment_limit = None  # drained: the next call fills a new segment
        self.segment_tick = 0
        self.labels_in_flight.clear()  # read past the end when the label iterator is longer
        return True

    def _learn_data_end(self, tick: int, limit: int, done: list[PipeInstruction]) -> None:
        """Note [end of data]: stage 0's iterator ran out at micro-batch ``limit`` of the segment.

        Stage 0 learns it from its iterator at tick ``limit``; it then sends a dummy activation
        carrying ``limit`` where micro-batch ``limit`` would have gone, and stage k learns it from
        that dummy at tick ``limit + k``, before it would have forwarded micro-batch ``limit``.
        From then on each stage runs the schedule of a segment of ``limit`` micro-batches, through
        the tick at which stage 0 back-propagates the last one, and every stage raises
        :class:`DataExhausted` in the call that contains that tick.
        """
        self.segment_limit = limit
        self._send_end = None if self.is_last_stage() else limit
        # Ticks since `limit` already counted a micro-batch as entering on this stage.
        self.global_samples -= (tick - limit) * self.train_micro_batch_size_per_gpu() * self.dp_world_size
        for cmd in self._schedule(0, drain=False, start_tick=tick).tick_instructions(tick):
            if not any(type(cmd) is type(d) and cmd.kwargs == d.kwargs for d in done):
                self._exec_instruction(cmd)

    def _last_tick(self) -> int:
        """The segment tick at which stage 0 back-propagates the segment's last micro-batch."""
        assert self.segment_limit is not None
        return self.segment_limit - 1 + ticks.drain_ticks(self.num_stages)

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        """DeepSpeed's dispatch loop (eval_batch runs through it), with every instruction timed."""
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                self._exec_instruction(cmd)

    def _exec_instruction(self, cmd: PipeInstruction) -> None:
        handler = self._INSTRUCTION_MAP.get(type(cmd))
        if handler is None:
            raise FDGRuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
        start = time.perf_counter()
        handler(self, **cmd.kwargs)
        end = time.perf_counter()
        kind = _KINDS.get(type(cmd))
        if kind is not None:
            self.fdg_stats[f"{kind}_s"] += end - start
        for observer in self.observers:
            observer.on_instruction(self, cmd, start, end)

    def _mean_call_loss(self) -> Tensor:
        if self._call_losses:
            loss = torch.stack(self._call_losses).mean()
        else:
            loss = torch.tensor(math.nan, device=self.device)
        if self.is_data_parallel:  # stage-local: the data-parallel peers of this stage only
            dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
            loss /= self.dp_world_size
        return loss

    def _report(self, steps_before: int, elapsed: float) -> None:
        every = self.steps_per_print()
        printing = bool(every) and self.global_steps // every != steps_before // every
        if printing and self.wall_clock_breakdown() and self.grid.data_parallel_id == 0:
            # Stage-local timings (forward, backward, step), one line per stage as each stage learns alone.
            self.timers.log(self.engine_timers.active_timers(), ranks=[self.global_rank])
        if self.global_rank != 0:
            return
        loss = self.agg_train_loss.item()
        if self.monitor.enabled:
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if not math.isnan(loss):
                events.append(("Train/Samples/train_loss", loss, self.global_samples))
            self.monitor.write_events(events)
        if printing:
            ticks_run = max(self.global_steps - steps_before, 1)
            samples = self.train_micro_batch_size_per_gpu() * self.dp_world_size * ticks_run
            print(
                f"steps: {self.global_steps} loss: {loss:0.4f} iter time (s): {elapsed:0.3f} "
                f"samples/sec: {samples / max(elapsed, 1e-9):0.3f}",
                flush=True,
            )

    # -- instruction handlers -------------------------------------------------------------------

    def _exec_fdg_load(self, buffer_id: int, micro_batch: int) -> None:
        try:
            if self.is_first_stage():  # inputs (and labels too when K = 1), as DeepSpeed loads them
                self._exec_load_micro_batch(buffer_id)
                self._check_inputs(self.pipe_buffers["inputs"][buffer_id], micro_batch)
            else:  # Note [labels read when the inputs are]
                self.labels_in_flight.append(_to_device(self._next_batch()[1], self.device))
        except StopIteration:
            if self.is_first_stage():
                raise _DataEnded(micro_batch) from None
            return  # the last stage learns the end from upstream, with the micro-batch that is missing
        self.micro_batches_read += 1

    def _exec_wait_activation(self, buffer_id: int, micro_batch: int) -> None:
        received, end = self._exchange.wait_activation()
        if end != NO_END:  # a dummy: the data ended (Note [end of data])
            raise _DataEnded(end)
        for t in received:
            t.requires_grad_(t.is_floating_point())
        self.pipe_buffers["inputs"][buffer_id] = received[0] if len(received) == 1 else received

    def _exec_wait_grad(self, buffer_id: int, micro_batch: int) -> None:
        self._received[buffer_id] = self._exchange.wait_grad()

    def _exec_fdg_forward(self, buffer_id: int, micro_batch: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        outputs = self._delayed.forward(buffer_id, lambda: self._stage_forward(inputs))
        self.pipe_buffers["outputs"][buffer_id] = outputs
        if self.is_last_stage():
            if not self.is_first_stage() and not self.labels_in_flight:
                raise FDGRuntimeError(
                    f"stage {self.stage_id} (global rank {self.global_rank}): the labels ran out before the inputs, "
                    f"at micro-batch {micro_batch} of the segment; first and last stage must read data of equal length"
                )
            labels = (
                self.pipe_buffers["labels"][buffer_id] if self.is_first_stage() else self.labels_in_flight.popleft()
            )
            if self.module.loss_fn is not None:
                try:
                    self._losses[buffer_id] = self.module.loss_fn(outputs, labels)
                except (RuntimeError, TypeError, ValueError) as err:
                    raise FDGRuntimeError(
                        f"stage {self.stage_id} (global rank {self.global_rank}): loss_fn failed on micro-batch "
                        f"{micro_batch} with outputs {_describe(outputs)} and labels {_describe(labels)}: {err}"
                    ) from err
            else:  # the model returns its loss
                self._losses[buffer_id] = outputs
        else:
            self._sent_meta[buffer_id] = meta_of(_floating(outputs))

    def _exec_fdg_backward(self, buffer_id: int, micro_batch: int) -> None:
        if self.is_last_stage():
            loss = self._losses.pop(buffer_id)
            if not bool(torch.isfinite(loss.detach()).all()):
                self._non_finite("loss", micro_batch)
            # One micro-batch per tick: no division by gradient_accumulation_steps.
            DeepSpeedEngine.backward(self, loss / self.fdg_config.accumulate, scale_wrt_gas=False)
            carried = loss.detach().float()
        else:
            grads, carried = self._received.pop(buffer_id)
            if self.fdg_config.grad_shrink != 1.0:
                grads = tuple(g.mul_(self.fdg_config.grad_shrink) for g in grads)
            inputs = self.pipe_buffers["inputs"][buffer_id]
            stored = self.pipe_buffers["outputs"][buffer_id]
            with self._delayed.backward(buffer_id, stored, lambda: self._stage_forward(inputs)) as outputs:
                self._autograd_backward(_floating(outputs), grads)
        self._call_losses.append(carried)
        if not self.is_first_stage():
            self._to_send[buffer_id] = (_input_grads(self.pipe_buffers["inputs"][buffer_id]), carried)
        self.pipe_buffers["inputs"][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["labels"][buffer_id] = None

    def _exec_local_optimizer_step(self) -> None:
        wrapped = self.bfloat16_enabled() or self.zero_optimization()
        self._force_grad_boundary = True
        try:
            finite = True
            if not wrapped:  # the bf16 and ZeRO wrappers check (and skip) non-finite steps themselves
                grads = [p.grad for p in self.module.parameters() if p.grad is not None]
                clip = self.gradient_clipping()
                # Stage-local norm: DeepSpeed's clip_fp32_gradients all-reduces across stages.
                norm = (
                    torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip)
                    if clip > 0
                    else torch.nn.utils.get_total_norm(grads)
                )
                finite = bool(torch.isfinite(norm))
            if finite:
                self._start_timers(self.engine_timers.step_timers)
                self.optimizer.step()
                self._stop_timers(self.engine_timers.step_timers)
                finite = not getattr(self.optimizer, "overflow", False)
            if wrapped:
                self.optimizer.zero_grad()
            else:
                self.zero_grad()
        finally:
            self._force_grad_boundary = False
        if finite:
            self.fdg_stats["steps"] += 1
        else:
            self._non_finite("gradient")

    def _check_inputs(self, inputs: Any, micro_batch: int) -> None:
        if not self.bfloat16_enabled():
            return
        floating = [t.dtype for t in _as_tuple(inputs) if torch.is_tensor(t) and t.is_floating_point()]
        wrong = [dtype for dtype in floating if dtype != torch.bfloat16]
        if wrong:
            raise FDGRuntimeError(
                f"stage 0 (global rank {self.global_rank}): micro-batch {micro_batch} has floating inputs of "
                f"dtype {wrong[0]} but bf16.enabled is true; convert the inputs to torch.bfloat16 in the data pipeline"
            )

    def _non_finite(self, what: str, micro_batch: int | None = None) -> None:
        """pipeline.fdg.nonfinite: stop with an error naming the stage and tick, or count a skipped step."""
        if self.fdg_config.nonfinite == "skip":
            self.fdg_stats["skipped"] += what == "gradient"
            return
        where = "" if micro_batch is None else f" of micro-batch {micro_batch} (of this pipeline segment)"
        raise FDGRuntimeError(
            f"stage {self.stage_id} (global rank {self.global_rank}): non-finite {what}{where} at tick "
            f'{self.global_steps}; lower the learning rate or set pipeline.fdg.nonfinite="skip" to skip '
            "such optimizer steps"
        )

    def _exec_exchange(
        self,
        send_activation: int | None,
        send_grad: int | None,
        recv_activation: int | None,
        recv_grad: int | None,
    ) -> None:
        activation = None
        if send_activation is not None:
            activation = _as_tuple(self.pipe_buffers["outputs"][send_activation])
            if self._delayed.recompute:  # only the input waits for the backward
                self.pipe_buffers["outputs"][send_activation] = None
        end = NO_END
        if self._send_end is not None:  # Note [end of data]: where the missing micro-batch would go
            end, self._send_end = self._send_end, None
            if self._exchange.sent_meta is None:
                raise FDGRuntimeError(
                    f"stage {self.stage_id} (global rank {self.global_rank}): the data ran out before the first "
                    "micro-batch; the next stage cannot be told -- give train_batch() a non-empty iterator"
                )
            activation = tuple(torch.zeros(s, dtype=d, device=self.device) for s, d in self._exchange.sent_meta)
        grads, loss = self._to_send.pop(send_grad) if send_grad is not None else (None, None)
        self._exchange.post(
            activation=activation,
            grads=grads,
            loss=loss,
            recv_activation=recv_activation is not None,
            recv_grad_meta=None if recv_grad is None else self._sent_meta[recv_grad],
            end=end,
        )

    def _exec_advance_tick(self, entered: bool) -> None:
        self.segment_tick += 1
        self.global_steps += 1
        if entered:
            self.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.fdg_stats["ticks"] += 1

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        FDGLoad: _exec_fdg_load,
        WaitActivation: _exec_wait_activation,
        WaitGrad: _exec_wait_grad,
        FDGForward: _exec_fdg_forward,
        FDGBackward: _exec_fdg_backward,
        LocalOptimizerStep: _exec_local_optimizer_step,
        Exchange: _exec_exchange,
        AdvanceTick: _exec_advance_tick,
    }

    # -- helpers --------------------------------------------------------------------------------

    def _stage_forward(self, inputs: Any) -> Any:
        # A clone, as in DeepSpeed: layers may write into their input; the buffer stays the leaf.
        cloned = tuple(t.clone() for t in inputs) if isinstance(inputs, tuple) else inputs.clone()
        return DeepSpeedEngine.forward(self, cloned)

    def _autograd_backward(self, outputs: list[Tensor], grads: tuple[Tensor, ...]) -> None:
        if len(outputs) != len(grads):
            raise FDGRuntimeError(
                f"stage {self.stage_id}: {len(outputs)} floating output tensors but {len(grads)} gradients"
            )
        bf16 = isinstance(self.optimizer, BF16_Optimizer)
        if bf16:  # as DeepSpeed's pipeline backward: we do not go through optimizer.backward()
            self.optimizer.clear_lp_grads()
        self._running_engine_backward = True
        try:
            torch.autograd.backward(outputs, grads)
        finally:
            self._running_engine_backward = False
            # DeepSpeed's hook on the forward outputs ran its backward prologue, which starts the
            # backward timers; the epilogue that stops them belongs to engine.backward(loss), which
            # only the last stage calls. Stop them here (they are started only with wall_clock_breakdown).
            for name in self.engine_timers.backward_inner_timers + self.engine_timers.backward_timers:
                if self.timers(name).started_:
                    self.timers(name).stop()
        if bf16 and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _decouple_optimizer_from_other_stages(self) -> None:
        """Make gradient norms, clipping and overflow checks stage-local (no cross-stage all-reduce).

        DeepSpeed's wrappers reduce them over the model-parallel group, which for a pipeline spans
        every stage: one collective across stages per step. Under FDG each stage steps on its own.
        """
        if isinstance(self.optimizer, BF16_Optimizer):
            self.optimizer.mpu = None
        if isinstance(self.optimizer, DeepSpeedZeroOptimizer):
            self.optimizer.model_parallel_group = None
            self.optimizer.model_parallel_rank = 0


def _as_tuple(x: Any) -> tuple[Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _floating(x: Any) -> list[Tensor]:
    return [t for t in _as_tuple(x) if torch.is_tensor(t) and t.is_floating_point()]


def _input_grads(inputs: Any) -> tuple[Tensor, ...]:
    return tuple(
        t.grad if t.grad is not None else torch.zeros_like(t) for t in _as_tuple(inputs) if t.is_floating_point()
    )


def _to_device(x: Any, device: torch.device) -> Any:
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return tuple(_to_device(t, device) for t in x)
    return x


def _describe(x: Any) -> str:
    if torch.is_tensor(x):
        return f"{x.dtype} {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_describe(t) for t in x) + ")"
    return type(x).__name__


def _nbytes(x: Any) -> int:
    if x is None:
        return 0
    return sum(t.numel() * t.element_size() for t in _as_tuple(x) if torch.is_tensor(t))
