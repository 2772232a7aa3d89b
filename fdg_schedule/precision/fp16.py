"""fp16 on one FDG stage: which scale the loss gets, the scales that travel with the messages, the scale of each step.

Note [loss scale per stage] (in :mod:`fdg_schedule.precision.loss_scale`) is the rule;
docs/fdg-reference.md, "fp16 and the loss scale", draws it tick by tick. Per tick, on a stage with fp16 on
(:class:`StageScaling`):

    WaitActivation   the activation's control word brought the ceiling: min of the upstream stages' scales
    FDGBackward      last stage: the loss is multiplied by S = min(own scale, ceiling), fixed for the
                     `accumulate` micro-batches of one step; every stage sends (loss, S) up with its gradient
    step             DeepSpeed's fp16 optimizer divides by the S the gradients came with; the stage's own
                     scale is updated with (S, overflow)
    Exchange         the activation leaves with ceiling min(own scale, ceiling)

With fp16 off every method leaves things as they were (the loss divided by ``accumulate``, the loss alone
carried, no ceiling), so the engine calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from fdg_schedule.precision import fp16_optimizer
from fdg_schedule.precision.loss_scale import LossScale, ScaleConfig


class StageScaling:
    """One stage's loss scale in the tick (Note [loss scale per stage]).

    Args:
        config: the job's fp16 scale settings; None with fp16 off.
        optimizer: DeepSpeed's fp16 optimizer wrapper of the stage (taken over: it steps at FDG's scales).
        exchange: the stage's :class:`~fdg_schedule.exchange.comm.NeighbourExchange` (built with ``loss_scale=True``):
            the ceiling and the gradient's scale of the tick are read from it.
        first / last: the stage's place in the pipeline; ``accumulate``: micro-batches per step.
        stats: ``engine.fdg_stats``: ``"loss_scale"`` is the scale of the stage's last step.
    """

    def __init__(
        self,
        config: ScaleConfig | None,
        optimizer: Any,
        exchange: Any,
        first: bool,
        last: bool,
        accumulate: int,
        stats: dict[str, float],
    ) -> None:
        self.config = config
        self.optimizer, self.exchange = optimizer, exchange
        self.first, self.last, self.accumulate = first, last, accumulate
        self.stats = stats
        self.state = LossScale(config if config is not None else ScaleConfig())
        self.group_scale: float | None = None  # last stage: S of the step being accumulated
        self.step_scale = self.state.cur_scale  # S of the step being taken, then of the last one
        self._loaded: dict[str, Any] | None = None  # what DeepSpeed's load put into the wrapper
        if config is not None:
            fp16_optimizer.take_over(optimizer, self.state.cur_scale)
            stats["loss_scale"] = self.step_scale

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def scale_loss(self, loss: Tensor, micro_batch: int) -> Tensor:
        """The last stage's loss for its backward: divided by ``accumulate`` and, with fp16, times S in fp32
        (Note [who scales the loss] in fdg_schedule.precision.fp16_optimizer)."""
        if self.config is None:
            return loss / self.accumulate
        if micro_batch % self.accumulate == 0 or self.group_scale is None:  # the first of a step's micro-batches
            self.group_scale = min(self.state.cur_scale, self._ceiling_in())
        return loss.float() / self.accumulate * self.group_scale

    def carry(self, loss: Tensor) -> Tensor:
        """What travels up with the stage's input gradient: the loss and, with fp16, the scale it was made with."""
        if self.config is None:
            return loss
        if self.last:
            return torch.stack([loss, torch.full_like(loss, self._group_scale())])
        return torch.stack([loss, self._scale_in().to(loss.dtype)])

    def ceiling(self, sending: bool) -> float | None:
        """The ceiling the activation sent this tick carries (``sending``): min(own scale, the one it arrived with)."""
        if self.config is None or not sending:
            return None
        return min(self.state.cur_scale, self._ceiling_in())

    def backward_scale(self) -> float | None:
        """The S the backward just run was made with (None with fp16 off): what the stage's tied copies' gradients
        are divided by before they leave (Note [tied layers under fp16] in fdg_schedule/exchange/tied.py)."""
        if self.config is None:
            return None
        return self._group_scale() if self.last else float(self._scale_in())

    @contextlib.contextmanager
    def stepping(self, tied_overflowed: Callable[[], bool]) -> Iterator[None]:
        """Around the wrapper's step: the step's S, the scale the gradients came with (a host read on the stage's
        device, where DeepSpeed's fp16 step reads its overflow flag anyway); ``tied_overflowed()`` True (a tied
        copy's gradient of this step was not finite) makes the wrapper's overflow check find one, so DeepSpeed's
        own skip runs (Note [tied layers under fp16] in fdg_schedule/exchange/tied.py)."""
        if self.config is None:
            yield
            return
        self.step_scale = self._group_scale() if self.last else float(self._scale_in())
        fp16_optimizer.set_scale(self.optimizer, self.step_scale)
        if tied_overflowed():
            with fp16_optimizer.overflow_found(self.optimizer):
                yield
        else:
            yield

    def after_step(self, overflow: bool) -> bool:
        """The stage's scale after a step; True when the step overflowed at ``min_loss_scale``."""
        if self.config is None:
            return False
        self.stats["loss_scale"] = self.step_scale
        fp16_optimizer.unscale_norm(self.optimizer, self.step_scale)
        return self.state.update(self.step_scale, overflow)

    def unscaled(self, norm: Tensor | None) -> Tensor | None:
        """A norm of this tick's fp16 gradients (W&B's fdg/grad_norm after the reduce) divided by their scale."""
        if self.config is None or norm is None:
            return norm
        return norm / (self._group_scale() if self.last else self._scale_in())

    def describe_floor(self) -> str:
        """What an overflow at the minimum scale is, for ``nonfinite: "error"``'s message."""
        assert self.config is not None
        return f"gradient at the minimum loss scale {self.step_scale:g} (fp16.min_loss_scale)"

    # -- checkpoints ------------------------------------------------------------------------------

    def capture(self) -> dict[str, Any] | None:
        if self.config is None:
            return None
        return {"state": self.state.capture(), "group_scale": self.group_scale, "step_scale": self.step_scale}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Undo :meth:`capture` (None: a checkpoint without it; the scale DeepSpeed's load brought, if any)."""
        if self.config is None:
            return
        if saved is None:
            if self._loaded is not None:  # Note [the scale in DeepSpeed's files]: a 1F1B checkpoint
                self.state = LossScale(self.config, **self._loaded)
                self.step_scale = self.state.cur_scale
            self.group_scale = None
        else:
            self.state.restore(saved["state"])
            self.group_scale, self.step_scale = saved["group_scale"], saved["step_scale"]
        self._loaded = None
        self.stats["loss_scale"] = self.step_scale

    @contextlib.contextmanager
    def deepspeed_view(self) -> Iterator[None]:
        """Around DeepSpeed's save (Note [the scale in DeepSpeed's files])."""
        if self.config is None:
            yield
            return
        with fp16_optimizer.deepspeed_view(self.optimizer, self.config, self.step_scale):
            yield

    def after_deepspeed_load(self, optimizer_loaded: bool) -> None:
        """After DeepSpeed's load: keep what it put into the wrapper's scaler for :meth:`restore`, and take over."""
        if self.config is None:
            return
        self._loaded = fp16_optimizer.loaded_state(self.optimizer) if optimizer_loaded else None
        fp16_optimizer.take_over(self.optimizer, self.step_scale)

    # -- what arrived this tick -----------------------------------------------------------------

    def _ceiling_in(self) -> float:
        if self.first:
            return math.inf
        ceiling = self.exchange.ceiling_in
        assert ceiling is not None, "an activation arrives with its ceiling under fp16"
        return float(ceiling)

    def _scale_in(self) -> Tensor:
        scale = self.exchange.scale_in
        assert scale is not None, "a gradient arrives with its scale under fp16"
        return scale

    def _group_scale(self) -> float:
        assert self.group_scale is not None, "the last stage scaled a loss before"
        return self.group_scale


def scale_config(engine: Any) -> ScaleConfig | None:
    """The fp16 scale settings of an engine's config (None without fp16)."""
    if not engine.fp16_enabled():
        return None
    return ScaleConfig.from_deepspeed(engine._config.float16_config)
