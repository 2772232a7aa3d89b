"""One stage's fp16 loss scale (Note [loss scale per stage]): DeepSpeed's rule on the scale gradients were made with.

Pure: no process group (DeepSpeed's scaler and fp16 optimizer ask for the rank only to log: rank 0 here).
"""

from __future__ import annotations

import random

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from fdg_schedule.corrections.reference import FP16, ReferenceScale
from fdg_schedule.precision.loss_scale import LossScale, ScaleConfig, as_float32, from_word, to_word


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)


SETTINGS = [
    {"loss_scale_window": 3, "hysteresis": 1},
    {"loss_scale_window": 4, "hysteresis": 2},
    {"loss_scale_window": 2, "hysteresis": 3, "consecutive_hysteresis": True},
    {"loss_scale_window": 5, "hysteresis": 2, "min_loss_scale": 64.0},
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_one_stage_follows_deepspeeds_dynamic_loss_scaler(settings) -> None:
    """K = 1: every gradient is made with the stage's own scale, and the scales are DeepSpeed's, step for step (its
    ZeRO optimizer's DynamicLossScaler, which honours hysteresis); where DeepSpeed would raise at the minimum, the
    update says so."""
    config = ScaleConfig(initial_scale_power=10, **settings)
    mine = LossScale(config)
    theirs = DynamicLossScaler(
        init_scale=2.0**10, scale_window=config.loss_scale_window, min_scale=config.min_loss_scale,
        delayed_shift=config.hysteresis, consecutive_hysteresis=config.consecutive_hysteresis,
        raise_error_at_min_scale=False,
    )  # fmt: skip
    rng = random.Random(7)
    for _ in range(400):
        overflow = rng.random() < 0.3
        at_minimum = theirs.cur_scale == theirs.min_scale and (theirs.delayed_shift == 1 or theirs.cur_hysteresis == 1)
        floor = mine.update(mine.cur_scale, overflow)
        theirs.update_scale(overflow)
        assert floor == (overflow and at_minimum)
        assert (mine.cur_scale, mine.cur_hysteresis, mine.cur_iter, mine.last_overflow_iter) == (
            theirs.cur_scale, theirs.cur_hysteresis, theirs.cur_iter, theirs.last_overflow_iter)  # fmt: skip


def test_late_gradients_change_nothing_and_growth_starts_from_the_scale_used() -> None:
    scale = LossScale(ScaleConfig(initial_scale_power=8, loss_scale_window=2, hysteresis=1))
    assert scale.update(256.0, overflow=True) is False and scale.cur_scale == 128.0
    before = scale.capture()
    for overflow in (True, False, True):  # made with 256 before the lowering reached the loss
        scale.update(256.0, overflow)
    assert scale.capture() == before
    for _ in range(2):
        scale.update(128.0, overflow=False)
    assert scale.cur_scale == 128.0
    scale.update(128.0, overflow=False)  # DeepSpeed's window: 2 steps after the first clean one, 2 * 128
    assert scale.cur_scale == 256.0
    # a stage whose own scale is far above the one in use (another stage holds it down) rises to 2 * S, not above
    high = LossScale(ScaleConfig(initial_scale_power=20, loss_scale_window=1, hysteresis=1))
    high.update(64.0, overflow=False)
    high.update(64.0, overflow=False)  # the window of 1 ends at the second step
    assert high.cur_scale == 128.0
    # an overflow at a scale below the stage's own lowers it below that scale at once
    high.update(64.0, overflow=True)
    assert high.cur_scale == 32.0


def test_static_scale_never_moves() -> None:
    scale = LossScale(ScaleConfig(loss_scale=1000.1, loss_scale_window=1, hysteresis=1))
    assert scale.cur_scale == as_float32(1000.1) != 1000.1  # a float32 number, as it travels
    for overflow in (True, False, False, True):
        assert scale.update(scale.cur_scale, overflow) is False
    assert scale.cur_scale == as_float32(1000.1)


def test_the_reference_states_the_same_rule_from_its_own_code() -> None:
    """Random made-with scales around the stage's own (late ones, scales held down by other stages) and overflows:
    the reference's scale and the engine's agree at every step."""
    for settings in SETTINGS:
        config = ScaleConfig(initial_scale_power=9, **settings)
        mine = LossScale(config)
        ref = ReferenceScale(FP16([], **{k: v for k, v in vars(config).items()}), [], config.initial, config.hysteresis)
        rng = random.Random(3)
        for _ in range(500):
            made_with = mine.cur_scale * rng.choice([0.25, 0.5, 1.0, 1.0, 1.0, 2.0])
            overflow = rng.random() < 0.25
            mine.update(made_with, overflow)
            ref.update(made_with, overflow)
            assert (mine.cur_scale, mine.cur_hysteresis) == (ref.scale, ref.hysteresis), settings


def test_capture_restore_and_words() -> None:
    scale = LossScale(ScaleConfig(initial_scale_power=12, loss_scale_window=2, hysteresis=2))
    for made_with, overflow in ((4096.0, True), (4096.0, True), (2048.0, False)):
        scale.update(made_with, overflow)
    again = LossScale(scale.config)
    again.restore(scale.capture())
    assert again == scale
    for value in (1.0, 2.0**16, as_float32(0.1), float("inf")):
        assert from_word(to_word(value)) == value


def test_config_from_deepspeeds_block() -> None:
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    block = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50, "hysteresis": 3,
             "consecutive_hysteresis": True, "min_loss_scale": 4}  # fmt: skip
    config = ScaleConfig.from_deepspeed(DeepSpeedFP16Config(**block))
    assert config == ScaleConfig.from_deepspeed(block)
    assert config == ScaleConfig(0.0, 12, 50, 3, True, 4.0) and config.dynamic and config.initial == 4096.0
    assert ScaleConfig.from_deepspeed({}) == ScaleConfig()  # DeepSpeed's defaults: 2**16, 1000, 2, False, 1
    assert not ScaleConfig.from_deepspeed({"loss_scale": 128}).dynamic


def test_deepspeeds_fp16_optimizer_steps_at_fdgs_scale_and_saves_deepspeeds_view() -> None:
    """Note [the scale in DeepSpeed's files]: DeepSpeed's unfused fp16 optimizer, taken over, divides by the scale FDG
    sets, never changes it, and writes DeepSpeed's own dynamic state (fresh window) while it is saved."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from fdg_schedule.precision import fp16_optimizer

    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    scale_config = LossScaleConfig(torch.float16, True, 1.0, {"init_scale": 2.0**8, "scale_window": 2,
                                                              "delayed_shift": 2, "consecutive_hysteresis": False,
                                                              "min_scale": 1})  # fmt: skip
    wrapper = FP16_UnfusedOptimizer(torch.optim.SGD([weight], lr=1.0), loss_scale_config=scale_config)
    config = ScaleConfig(initial_scale_power=8, loss_scale_window=2)
    fp16_optimizer.take_over(wrapper, 256.0)
    for step in range(4):  # clean steps at 64: each moves the weight by exactly grad / 64 * lr
        fp16_optimizer.set_scale(wrapper, 64.0)
        weight.grad = torch.full((4,), 64.0, dtype=torch.float16)
        wrapper.step()
        assert torch.equal(weight.detach(), torch.full((4,), -float(step), dtype=torch.float16))
        assert wrapper.loss_scale == 64.0  # DeepSpeed's own window would have raised it by now
    with fp16_optimizer.deepspeed_view(wrapper, config, 64.0):
        saved = wrapper.state_dict()
    assert (saved["dynamic_loss_scale"], saved["cur_scale"], saved["cur_iter"], saved["last_overflow_iter"]) == (
        True, 64.0, 0, -1)  # fmt: skip
    assert not wrapper.loss_scale_config.dynamic_loss_scale  # FDG steers it again
    wrapper.load_state_dict(saved)
    assert fp16_optimizer.loaded_state(wrapper) == {"cur_scale": 64.0, "cur_iter": 0, "last_overflow_iter": -1}
