"""One stage's fp16 loss scale under FDG: DeepSpeed's dynamic rule, applied to the scale its gradients were made with.

Note [loss scale per stage]: under 1F1B one scale serves every stage (each step all-reduces an overflow
flag over all of them). FDG steps each stage alone, so every stage k holds a scale ``s_k`` of its own,
the largest scale its recent gradients tolerate, and a micro-batch's loss is scaled by the minimum of
the stages' scales as it passes them (:mod:`fdg_schedule.precision.fp16` carries it;
docs/fdg-reference.md, "fp16 and the loss scale", draws it tick by tick). After each optimizer step the stage
updates ``s_k`` with the scale ``S`` its gradients were made with and whether they overflowed:

    S > s_k                 made before the stage last lowered s_k: no change at all (late evidence)
    overflow                the hysteresis count drops; at its last one s_k = max(S / 2, min_loss_scale)
    no overflow             consecutive_hysteresis refills the count; when loss_scale_window such steps have
                            followed the first one after the last overflow (DeepSpeed's stable interval:
                            the window+1-th clean step), s_k = 2 * S (the count refilled without consecutive)

This is DeepSpeed's ``DynamicLossScaler.update_scale`` (``fp16.hysteresis`` its ``delayed_shift``) with
S in place of the scaler's own scale: a stage lowers from, and raises above, the scale that was actually
used, so the late gradients of an old scale change nothing, and a stage that is not the one holding the
scale down does not run away. With one stage S = s_0 at every step: DeepSpeed's sequence of scales.
A static ``fp16.loss_scale`` > 0 never changes.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from typing import Any

FACTOR = 2.0  # DeepSpeed's scale_factor (not configurable in its fp16 block)


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32: scales travel as float32 numbers (Note [loss scale per stage])."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def to_word(value: float) -> int:
    """A scale as an int64 control word (its float64 bits), exact, read on the host (fdg_schedule.exchange.comm)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def from_word(word: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", word))[0])


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """DeepSpeed's ``fp16`` block, the keys that decide the scale (DeepSpeed's defaults)."""

    loss_scale: float = 0.0  # 0: dynamic; else this static scale
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial(self) -> float:
        return as_float32(2.0**self.initial_scale_power if self.dynamic else self.loss_scale)

    @classmethod
    def from_deepspeed(cls, fp16: Mapping[str, Any] | Any) -> ScaleConfig:
        """From a ds_config ``fp16`` dict or DeepSpeed's ``DeepSpeedFP16Config`` (its validated values)."""
        get = fp16.get if isinstance(fp16, Mapping) else lambda key, default: getattr(fp16, key, default)
        defaults = cls()
        return cls(**{f.name: type(getattr(defaults, f.name))(get(f.name, getattr(defaults, f.name)))
                      for f in dataclasses.fields(cls)})  # fmt: skip


@dataclasses.dataclass
class LossScale:
    """One stage's loss scale and its counters (Note [loss scale per stage]); DeepSpeed's scaler field names."""

    config: ScaleConfig
    cur_scale: float = 0.0  # s_k; the initial scale when 0
    cur_iter: int = 0  # counted steps
    last_overflow_iter: int = -1
    cur_hysteresis: int = 0  # overflows left before s_k is lowered; hysteresis when 0

    def __post_init__(self) -> None:
        self.cur_scale = self.cur_scale or self.config.initial
        self.cur_hysteresis = self.cur_hysteresis or self.config.hysteresis

    def update(self, made_with: float, overflow: bool) -> bool:
        """After a step on gradients made with scale ``made_with``; True when it overflowed at ``min_loss_scale``
        with the hysteresis used up (no smaller scale can cure it)."""
        config = self.config
        if not config.dynamic or made_with > self.cur_scale:
            return False
        floor = False
        if overflow:
            if config.hysteresis == 1 or self.cur_hysteresis == 1:
                floor = made_with <= config.min_loss_scale
                self.cur_scale = as_float32(max(made_with / FACTOR, config.min_loss_scale))
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if config.consecutive_hysteresis:
                self.cur_hysteresis = config.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % config.loss_scale_window == 0:
                if not config.consecutive_hysteresis:
                    self.cur_hysteresis = config.hysteresis
                self.cur_scale = as_float32(made_with * FACTOR)
        self.cur_iter += 1
        return floor

    def capture(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")}

    def restore(self, saved: Mapping[str, Any]) -> None:
        for key, value in saved.items():
            setattr(self, key, value)
