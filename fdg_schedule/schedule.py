"""The FDG training schedule: a pure generator of DeepSpeed pipeline instructions, one list per tick.

It imports no communication code and needs no process group: ``list(FDGTrainSchedule(...))`` is
the whole plan of one ``train_batch()`` call (or one drain) for one stage. All tick arithmetic
lives in :mod:`fdg_schedule.ticks`; this module only orders the instructions within a tick.
``str(instruction)`` gives a compact form (``B3`` backward of micro-batch 3, ``F5`` forward,
``S`` optimizer step, ``X`` exchange) used by the golden tests and by error messages.
"""

from __future__ import annotations

from collections.abc import Iterator

from deepspeed.runtime.pipe.schedule import (
    BufferOpInstruction,
    PipeInstruction,
    PipeSchedule,
    ReduceGrads,
)

from fdg_schedule import ticks


class FDGForward(BufferOpInstruction):
    """Forward the micro-batch in ``buffer_id`` and keep what its delayed backward needs.

    Roughly: ``outputs = module(inputs)``, keeping the graph (``activations="stored"``) or only
    the inputs and RNG state (``"recomputed"``), plus a weight snapshot (``weights="stashed"``).
    On the last stage also ``loss = loss_fn(outputs, labels)``.
    """

    def __str__(self) -> str:
        return f"F{self.micro_batch}"


class FDGBackward(BufferOpInstruction):
    """Back-propagate the micro-batch in ``buffer_id`` with the gradient the next stage sent.

    Roughly: ``backward(outputs, grad_shrink * received_grad)`` on a non-last stage,
    ``backward(loss / accumulate)`` on the last one; the input gradient is kept for sending.
    """

    def __str__(self) -> str:
        return f"B{self.micro_batch}"


class FDGLoad(BufferOpInstruction):
    """Read the next micro-batch from the data iterator (inputs on the first stage, labels on the last).

    Roughly: DeepSpeed's ``LoadMicroBatch``. The last stage reads a micro-batch's labels at the tick
    its inputs enter stage 0 and queues them until its forward, K-1 ticks later.
    """

    def __str__(self) -> str:
        return f"L{self.micro_batch}"


class WaitActivation(BufferOpInstruction):
    """Wait for the activation the previous stage sent last tick and put it in ``buffer_id``."""

    def __str__(self) -> str:
        return f"A{self.micro_batch}"


class WaitGrad(BufferOpInstruction):
    """Wait for the gradient (and carried loss) the next stage sent last tick, for ``buffer_id``."""

    def __str__(self) -> str:
        return f"G{self.micro_batch}"


class LocalOptimizerStep(PipeInstruction):
    """Step this stage's optimizer with stage-local clipping; no counters, no cross-stage collective."""

    def __str__(self) -> str:
        return "S"


class Exchange(PipeInstruction):
    """Post this tick's one batched, non-blocking exchange with both neighbours.

    Roughly: ``batch_isend_irecv([activation -> next, gradient + loss -> previous,
    activation <- previous, gradient + loss <- next])`` for the buffers named; the receives are
    waited for by next tick's :class:`WaitGrad` / :class:`WaitActivation`. Each field is the
    buffer of the micro-batch concerned, or None.
    """

    def __str__(self) -> str:
        parts = [
            name
            for name, on in (
                ("sa", self.send_activation is not None),
                ("sg", self.send_grad is not None),
                ("ra", self.recv_activation is not None),
                ("rg", self.recv_grad is not None),
            )
            if on
        ]
        return f"X[{','.join(parts)}]"


class AdvanceTick(PipeInstruction):
    """End the tick: ``global_steps += 1``, the LR scheduler steps, samples counted if one entered."""

    def __str__(self) -> str:
        return "T+" if self.entered else "T"


class FDGTrainSchedule(PipeSchedule):
    """The instructions of ``micro_batches`` ticks of FDG for one stage.

    Args:
        micro_batches: ticks to run (DeepSpeed's ``gradient_accumulation_steps`` per call).
        stages: number of pipeline stages ``K``.
        stage_id: this stage.
        start_tick: segment tick at which this call starts (ticks since the pipeline last filled).
        accumulate: backward passes per optimizer step.
        drain: run a drain instead: no micro-batch enters, in-flight ones finish.
        limit: the segment has only this many micro-batches (the data ran out): none enters after.
    """

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        start_tick: int = 0,
        accumulate: int = 1,
        drain: bool = False,
        limit: int | None = None,
    ) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.start_tick = start_tick
        self.accumulate = accumulate
        # During a drain only the micro-batches that already entered stage 0 are processed.
        self.limit: int | None = start_tick if drain else limit

    def num_pipe_buffers(self) -> int:
        return ticks.num_buffers(self.stages, self.stage_id)

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for tick in range(self.start_tick, self.start_tick + self.micro_batches):
            yield self.tick_instructions(tick)
        if self.limit is not None and self.stages == 1 and self.limit % self.accumulate:
            # K = 1 has no drain ticks: its last backward ran before the drain, so the partial
            # accumulation is stepped here (with the learning rate of the tick after it).
            yield [ReduceGrads(), LocalOptimizerStep()]

    def tick_instructions(self, tick: int) -> list[PipeInstruction]:
        """Everything this stage does at segment tick ``tick``, in order."""
        fwd = ticks.forward_micro_batch(tick, self.stage_id, self.limit)
        bwd = ticks.backward_micro_batch(tick, self.stages, self.stage_id, self.limit)
        cmds: list[PipeInstruction] = []
        if not self.is_last_stage and bwd is not None:
            cmds += [WaitGrad(self._buffer(bwd), micro_batch=bwd)]
            cmds += self._backward_and_step(bwd)
        # Every stage agrees on whether a micro-batch enters the pipeline at this tick.
        entering = ticks.forward_micro_batch(tick, 0, self.limit)
        if fwd is not None and not self.is_first_stage:
            cmds.append(WaitActivation(self._buffer(fwd), micro_batch=fwd))
        if entering is not None and self.is_last_stage and not self.is_first_stage:
            # Note [labels read when the inputs are]: the last stage reads micro-batch t's labels at
            # tick t, with stage 0's inputs, and keeps the K-1 in flight; both iterators stay aligned.
            cmds.append(FDGLoad(0, micro_batch=entering))
        if fwd is not None:
            if self.is_first_stage:
                cmds.append(FDGLoad(self._buffer(fwd), micro_batch=fwd))
            cmds.append(FDGForward(self._buffer(fwd), micro_batch=fwd))
            if self.is_last_stage:  # delay 0: fwd == bwd
                cmds += self._backward_and_step(fwd)
        cmds.append(self._exchange(tick, fwd, bwd))
        cmds.append(AdvanceTick(entered=entering is not None))
        return cmds

    def _backward_and_step(self, micro_batch: int) -> list[PipeInstruction]:
        cmds: list[PipeInstruction] = [FDGBackward(self._buffer(micro_batch), micro_batch=micro_batch)]
        last = None if self.limit is None else self.limit - 1
        if ticks.steps_after_backward(micro_batch, self.accumulate, last):
            cmds += [ReduceGrads(), LocalOptimizerStep()]
        return cmds

    def _exchange(self, tick: int, fwd: int | None, bwd: int | None) -> Exchange:
        # What the neighbours need next tick is exactly what they will forward / back-propagate.
        next_fwd = ticks.forward_micro_batch(tick + 1, self.stage_id, self.limit)
        next_bwd = ticks.backward_micro_batch(tick + 1, self.stages, self.stage_id, self.limit)
        back_propagated = fwd if self.is_last_stage else bwd
        return Exchange(
            send_activation=None if self.is_last_stage or fwd is None else self._buffer(fwd),
            send_grad=None if self.is_first_stage or back_propagated is None else self._buffer(back_propagated),
            recv_activation=None if self.is_first_stage or next_fwd is None else self._buffer(next_fwd),
            recv_grad=None if self.is_last_stage or next_bwd is None else self._buffer(next_bwd),
        )

    def _buffer(self, micro_batch: int) -> int:
        return micro_batch % self.num_pipe_buffers()


def render(schedule: FDGTrainSchedule) -> list[str]:
    """The compact text of each tick, e.g. ``["L0 F0 X[sa] T+", "G0 B0 R S A1 F1 X[sa,sg,ra,rg] T+"]``."""
    return [" ".join(_short(cmd) for cmd in step) for step in schedule.steps()]


def _short(cmd: PipeInstruction) -> str:
    if isinstance(cmd, ReduceGrads):
        return "R"
    return str(cmd)
