"""Staleness on one stage: the two corrections against it (delay-aware lr, weight prediction) and its measurement.

The math is Note [staleness corrections] in :mod:`fdg_schedule.corrections.reference`, the judge this module is
tested against: stage k of K has delay d_k = 2(K-1-k) ticks, h_k = d_k / accumulate optimizer
steps and tau_k = max(1, h_k); t is the tick counted from the start of training
(``StageState.tick``: fill and drain ticks included, continuing across calls and checkpoints).

Note [predicted weights in place]: every forward of a delayed stage runs on ``w_hat = w + h*delta``
written into the parameters' own storage, and ``w`` is copied back from a saved copy right after
(never recomputed by subtracting ``h*delta``, which would not give ``w`` back bit for bit).
Everything that reads the parameters during the forward sees ``w_hat``; afterwards each mode of
:mod:`fdg_schedule.corrections.delayed` does what it does without prediction, which is what the definition
asks: ``"stashed"`` snapshots the parameters during the forward, so its snapshot is ``w_hat`` and the
backward (stored or recomputed) differentiates at ``w_hat`` (Note [stashed weights]); ``"current"``
with stored activations reads the live ``w`` in the backward because saved weights are read live
(Note [saved weights read live]); ``"current"`` recomputed reruns the forward on the live ``w``.
Buffers (batch-norm statistics) are not predicted. The step applies the gradient to ``w``. ``h`` is the
prediction's horizon in optimizer steps: h_k, or with ``predict_horizon: "first_stage"``
``(2(K-1) - k) / accumulate`` (:func:`fdg_schedule.sched.ticks.prediction_ticks`); ``predict_scale`` and
``predict_momentum`` turn ``h`` into the prediction's reach (Note [the prediction's reach]).

Note [the prediction's reach]: delta is multiplied by R = p * H, p = ``predict_scale`` and H the horizon
``h``, or with ``predict_momentum`` mu the discounted count ``mu + mu**2 + ... + mu**h``, computed for any real
h as ``(mu - mu**(h+1)) / (1 - mu)``. The reference states the same sum as ``mu * (1 - mu**h) / (1 - mu)``
(:mod:`fdg_schedule.corrections.reference`, Note [staleness corrections]); the two agree to rounding. With p = 1
and no mu, R is h itself, so the prediction is the one before these keys existed, bit for bit.

Note [the last stage's prediction]: with ``predict_horizon: "first_stage"`` the last stage predicts too
((K-1) ticks ahead). Its forward, loss and backward run back to back in one tick with plain autograd
(it never recomputes). Under ``"current"`` the forward alone runs inside :meth:`Corrections.predicted`,
so the backward reads the live ``w`` through the graph's saved weights (Note [saved weights read live]
holds for the last stage because ``w`` is written back through ``.data``). Under ``"stashed"`` the
predicted weights stay in the parameters until the backward is done (``StageState.last_prediction``),
so the gradient is taken at ``w_hat``.

Note [delta in fp32]: delta is kept in fp32, one tensor per trainable parameter of the stage (the
module's full parameters, also under ZeRO-1, whose step ends with an all-gather of them; each
data-parallel rank keeps its own, equal, copy). It is updated from the parameters as they are right
before and right after the wrapper's step, so under bf16 it follows the bf16 weights the forwards
use. A step the optimizer skips (``nonfinite: "skip"``, an overflow) is no step: delta keeps its value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fdg_schedule.base.config import FDGConfig, FDGConfigError
from fdg_schedule.sched import ticks


def prediction_reach(h: float, scale: float, momentum: float | None) -> float:
    """Note [the prediction's reach]: ``p * h``, or with a momentum mu ``p * (mu - mu**(h+1)) / (1 - mu)``."""
    steps = h if momentum is None else (momentum - momentum ** (h + 1.0)) / (1.0 - momentum)
    return steps if scale == 1.0 else scale * steps  # p = 1: h itself, as before the scale existed


def momentum_of(group: dict[str, Any]) -> tuple[str | None, Any]:
    """The key holding a param group's momentum (``"momentum"``, or ``"betas"`` whose first entry it is)
    and its value; (None, None) without one."""
    for key in ("momentum", "betas"):
        if key in group:
            return key, group[key]
    return None, None


def set_momentum(group: dict[str, Any], key: str | None, value: Any, power: float) -> None:
    """mu -> mu ** power in ``group`` (delay-aware momentum); betas keep their other entries."""
    if key == "momentum":
        group[key] = value**power
    elif key == "betas":
        group[key] = (value[0] ** power, *value[1:])


@dataclasses.dataclass
class Step:
    """One optimizer step inside :meth:`Corrections.stepping`: the caller sets ``taken``."""

    taken: bool = False  # the optimizer stepped (False: it skipped the step; delta keeps its value)


class Corrections:
    """The delay-aware learning rate and weight prediction of one stage, and the prediction's delta.

    Args:
        params: the stage's trainable parameters (the ones the optimizer steps).
        stages, stage_id: ``K`` and ``k``.
        config: ``delay_lr_ticks``, ``predict_decay``, ``delay_momentum`` and ``accumulate``.
        optimizer, where: the stage's optimizer, checked at once (:meth:`check_optimizer`; errors name ``where``).
    """

    def __init__(
        self, params: Sequence[Tensor], stages: int, stage_id: int, config: FDGConfig, optimizer: Any = None,
        where: str = "",
    ) -> None:  # fmt: skip
        self.params = list(params)
        self.h = ticks.delay(stages, stage_id) / config.accumulate  # the delay in optimizer steps
        self.tau = max(1.0, self.h)
        self.delay_lr_ticks = config.delay_lr_ticks
        self.delay_momentum = config.delay_momentum
        self.raise_momentum = config.delay_momentum_raise  # c: mu ** (1 / (1 + c*h)) instead; None: off
        # the last stage (h = 0) keeps mu
        self.moves_momentum = (config.delay_momentum or self.raise_momentum is not None) and self.h > 0
        self.peak_lr = config.delay_momentum_peak_lr  # None: h in full at every lr
        # how far ahead the forwards' weights aim, in optimizer steps (config.predict_horizon)
        self.h_predict = ticks.prediction_ticks(stages, stage_id, config.predict_horizon) / config.accumulate
        # Note [the prediction's reach]: what delta is multiplied by in the forwards
        self.reach = prediction_reach(self.h_predict, config.predict_scale, config.predict_momentum)
        self.gamma = config.predict_decay if self.h_predict > 0 else None  # "own": the last stage predicts nothing
        # Note [delta in fp32]
        self.delta: list[Tensor] | None = None
        if self.gamma is not None:
            self.delta = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        if optimizer is not None:
            self.check_optimizer(optimizer, where)

    def lr_factor(self, tick: int) -> float:
        """``tau ** -max(0, 1 - t/T)``: what the step in tick ``t`` multiplies every param group's lr by."""
        if self.delay_lr_ticks == 0:
            return 1.0
        return self.tau ** -max(0.0, 1.0 - tick / self.delay_lr_ticks)

    def momentum_power_at(self, lr: float) -> float:
        """``1 + h``, or with a peak lr rho ``1 + h * min(1, lr / rho)``: the power delay_momentum raises mu to
        in a step whose param group has learning rate ``lr`` (before :meth:`lr_factor`); with
        delay_momentum_raise c, ``1 / (1 + c*h)`` at every lr."""
        if self.raise_momentum is not None:
            return 1.0 / (1.0 + self.raise_momentum * self.h)
        if self.peak_lr is None:
            return 1.0 + self.h
        return 1.0 + self.h * min(1.0, lr / self.peak_lr)

    @contextlib.contextmanager
    def predicted(self) -> Iterator[None]:
        """Note [predicted weights in place]: the parameters hold ``w + h*delta`` inside, ``w`` again after."""
        if self.delta is None:
            yield
            return
        weights = _data(self.params)
        with torch.no_grad():
            saved = [w.clone() for w in weights]
            torch._foreach_add_(weights, torch._foreach_mul(self.delta, self.reach))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(weights, saved)

    @contextlib.contextmanager
    def stepping(self, optimizer: Any, tick: int) -> Iterator[Step]:
        """Context for one optimizer step in tick ``tick``: the caller steps inside and sets ``step.taken``
        (False, the default: the optimizer skipped it). Note [one direction] in :mod:`fdg_schedule.corrections.delayed`.

        Inside, the lr of every param group of ``optimizer`` is multiplied by :meth:`lr_factor`, and with
        ``delay_momentum`` (or ``delay_momentum_raise``) its momentum mu is taken as ``mu ** p``, p from
        :meth:`momentum_power_at` of the group's lr: the values they had are written back on leaving
        (not divided back), so a scheduler or the user sees its own. DeepSpeed's bf16 and ZeRO wrappers
        share ``param_groups`` (the same dicts) with the optimizer they wrap. After a step that was
        taken, delta moves towards the step:
        ``delta <- gamma*delta + (1-gamma)*(w_after - w_before)``.
        """
        groups = optimizer.param_groups
        lrs = [group["lr"] for group in groups]
        momenta = [momentum_of(group) if self.moves_momentum else (None, None) for group in groups]
        factor = self.lr_factor(tick)
        before = None
        if self.delta is not None:
            with torch.no_grad():
                before = [p.detach().clone() for p in self.params]
        if factor != 1.0:
            for group, lr in zip(groups, lrs):
                group["lr"] = lr * factor
        if self.moves_momentum:
            for group, lr, (key, value) in zip(groups, lrs, momenta):
                set_momentum(group, key, value, self.momentum_power_at(lr))
        step = Step()
        try:
            yield step
        finally:
            for group, lr, (key, value) in zip(groups, lrs, momenta):
                group["lr"] = lr
                if key is not None:
                    group[key] = value
        if step.taken and before is not None and self.delta is not None and self.gamma is not None:
            with torch.no_grad():
                moved = torch._foreach_sub(_fp32(_data(self.params)), _fp32(before))
                torch._foreach_mul_(self.delta, self.gamma)
                torch._foreach_add_(self.delta, moved, alpha=1.0 - self.gamma)

    def check_optimizer(self, optimizer: Any, where: str) -> None:
        """With ``delay_momentum`` or ``delay_momentum_raise``, every param group must have a momentum to take
        the power of (checked on every stage, the last one too, so that all raise alike)."""
        if self.delay_momentum:
            key, value, off = "delay_momentum", "true", "false"
        elif self.raise_momentum is not None:
            key, value, off = "delay_momentum_raise", repr(self.raise_momentum), "null"
        else:
            return
        for i, group in enumerate(optimizer.param_groups):
            if momentum_of(group)[0] is None:
                raise FDGConfigError(
                    f"{where}: pipeline.fdg.{key} is {value} but param group {i} of the optimizer "
                    f"({type(optimizer).__name__}) has no 'momentum' nor 'betas'; set {key} to {off}, "
                    "or use an optimizer with momentum (SGD with momentum, Adam, AdamW)"
                )

    def reset(self) -> None:
        """delta back to zero (a checkpoint that cannot continue this stage's prediction)."""
        if self.delta is not None:
            for d in self.delta:
                d.zero_()

    def capture(self) -> list[Tensor] | None:
        """delta, for a checkpoint (None without prediction)."""
        return None if self.delta is None else [d.detach().clone() for d in self.delta]

    def restore(self, saved: list[Tensor] | None, strict: bool = True) -> bool:
        """delta from :meth:`capture` of the same stage; zero if the checkpoint has none (prediction was off).

        Other shapes (the stage holds other parameters) raise ValueError, or with ``strict=False``
        leave delta at zero and return False.
        """
        self.reset()
        if self.delta is None or saved is None:
            return True
        if [tuple(s.shape) for s in saved] != [tuple(d.shape) for d in self.delta]:
            if not strict:
                return False
            raise ValueError(
                "the checkpoint's weight-prediction delta does not have this stage's parameter shapes: "
                f"{[tuple(s.shape) for s in saved]} against {[tuple(d.shape) for d in self.delta]}"
            )
        with torch.no_grad():
            torch._foreach_copy_(self.delta, [s.to(d.device) for s, d in zip(saved, self.delta)])
        return True


class StalenessMeter:
    """Measures ``||w_fwd - w_bwd|| / ||w_bwd||`` for one micro-batch every ``every`` ticks, on the device.

    ``w_fwd`` is what the parameters held during the forward of the micro-batch entering this stage
    at a tick ``t`` with ``t % every == 0`` (predicted weights included); ``w_bwd`` what they hold
    right before that micro-batch's backward, the weights its gradient is applied to. Norms over all
    trainable parameters of the stage, in fp32. The value stays a device tensor: reading it (once per
    call) is the only host synchronisation. The last stage (delay 0) measures nothing.

    Args:
        params: the stage's trainable parameters.
        every: ``pipeline.fdg.staleness_every`` (0: off).
        delayed: False on the last stage.
    """

    def __init__(self, params: Sequence[Tensor], every: int, delayed: bool) -> None:
        self.params = list(params)
        self.every = every if delayed and self.params else 0
        self.value: Tensor | None = None  # the latest measurement
        self.tick: int | None = None  # the tick of the backward it was measured at
        self.count = 0  # measurements so far (observers compare it to see a new one)
        self._reported = 0  # measurements already copied into the engine's stats (report_new)

    def after_forward(self, tick: int, stashed: list[Tensor] | None) -> list[Tensor] | None:
        """The weights of the forward that just ran when ``tick`` is measured (None when it is not): the probe the
        micro-batch keeps until :meth:`before_backward`.

        ``stashed``: the forward's weight snapshot when the mode keeps one (no copy is made then).
        Call it while the parameters still hold the forward's weights (Note [predicted weights in place]).
        """
        if not self.every or tick % self.every:
            return None
        if stashed is None:
            with torch.no_grad():
                stashed = [p.detach().clone() for p in self.params]
        return stashed

    def before_backward(self, tick: int, probe: list[Tensor] | None) -> None:
        """Measure a micro-batch whose forward kept ``probe`` (None: not measured); the parameters hold ``w_bwd``."""
        if probe is None:
            return
        with torch.no_grad():
            live = _fp32([p.detach() for p in self.params])
            moved = torch._foreach_sub(_fp32(probe), live)
            self.value = _norm(moved) / _norm(live)
        self.tick = tick
        self.count += 1

    def report_new(self, stats: dict[str, float]) -> None:
        """A measurement taken since the last call into ``stats["staleness"]`` and ``["staleness_tick"]``
        (the engine's one host read of the metric per call; nothing when none was taken)."""
        if self.count == self._reported:
            return
        self._reported = self.count
        stats["staleness"] = self.read()
        stats["staleness_tick"] = float(self.tick if self.tick is not None else math.nan)

    def read(self) -> float:
        """The latest measurement on the host (NaN before the first): a device synchronisation."""
        return math.nan if self.value is None else float(self.value)


def _data(params: Sequence[Tensor]) -> list[Tensor]:
    # ``.data``: writing the predicted weights is not an autograd-visible write (as in delayed.py).
    return [p.data for p in params]


def _fp32(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.float() for t in tensors]  # no copy when already fp32


def _norm(tensors: Sequence[Tensor]) -> Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(tensors))))
