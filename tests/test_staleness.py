"""The staleness corrections and metric of one stage on their own (fdg_schedule.corrections.staleness): no process
group.

The engine's parity with ``fdg_reference`` is tested in test_engine.py; here each piece is checked
against values written by hand, including what the engine tests cannot see (w restored bit for bit,
a skipped step, bf16 weights, checkpoint contents).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fdg_schedule.base.config import FDGConfig, FDGConfigError
from fdg_schedule.corrections.staleness import Corrections, StalenessMeter


def _params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3, generator=g).to(dtype)), nn.Parameter(torch.randn(3, generator=g).to(dtype))]


def _step(corrections: Corrections, optimizer: Any, tick: int, take_step: Callable[[], bool]) -> bool:
    """One step inside ``corrections.stepping`` as the engine takes it: ``take_step()`` says whether it was taken."""
    with corrections.stepping(optimizer, tick) as step:
        step.taken = take_step()
    return step.taken


def test_the_step_is_not_taken_unless_the_caller_says_so() -> None:
    params = _params()
    corrections = Corrections(params, 3, 0, FDGConfig(predict_decay=0.5))
    with corrections.stepping(torch.optim.SGD(params, lr=0.1), 0) as step:
        params[0].grad, params[1].grad = torch.ones(4, 3), torch.ones(3)
        torch.optim.SGD(params, lr=0.1).step()  # the weights moved, but the caller did not say the step was taken
    assert not step.taken
    assert corrections.delta is not None and all(not d.any() for d in corrections.delta)  # a skipped step: no move


def test_lr_factor_per_stage_and_tick() -> None:
    config = FDGConfig(delay_lr_ticks=8)
    stage0 = Corrections([], 3, 0, config)  # K = 3: delay 4, tau 4
    assert [stage0.lr_factor(t) for t in (0, 4, 8, 100)] == [0.25, 0.5, 1.0, 1.0]
    assert Corrections([], 3, 1, config).lr_factor(4) == 2**-0.5  # delay 2
    assert Corrections([], 3, 2, config).lr_factor(0) == 1.0  # the last stage: tau 1
    accumulated = Corrections([], 3, 1, FDGConfig(delay_lr_ticks=8, accumulate=4))
    assert accumulated.h == 0.5 and accumulated.lr_factor(0) == 1.0  # tau = max(1, 2/4)
    assert Corrections([], 3, 0, FDGConfig()).lr_factor(0) == 1.0  # off


def test_the_step_runs_at_the_scaled_lr_and_the_lr_is_written_back() -> None:
    params = _params()
    optimizer = torch.optim.SGD([{"params": params[:1], "lr": 0.3}, {"params": params[1:], "lr": 0.1}])
    corrections = Corrections(params, 2, 0, FDGConfig(delay_lr_ticks=4))  # tau 2
    seen: list[list[float]] = []

    def step() -> bool:
        seen.append([group["lr"] for group in optimizer.param_groups])
        return True

    assert _step(corrections, optimizer, 2, step)
    assert seen == [[0.3 * 2**-0.5, 0.1 * 2**-0.5]]
    assert [group["lr"] for group in optimizer.param_groups] == [0.3, 0.1]  # the same floats, not divided back

    def failing() -> bool:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _step(corrections, optimizer, 0, failing)
    assert [group["lr"] for group in optimizer.param_groups] == [0.3, 0.1]


@pytest.mark.parametrize("stage,power", [(0, 1 + 4 / 2), (1, 1 + 2 / 2), (2, None)])  # K = 3, accumulate 2
def test_the_step_runs_with_delay_aware_momentum_and_it_is_written_back(stage: int, power: float | None) -> None:
    """delay_momentum: mu ** (1 + h) in the step, h = delay / accumulate (SGD's momentum, Adam's first beta); the
    values are put back after it, also when it fails; the last stage (h = 0) keeps mu."""
    params = _params()
    sgd = torch.optim.SGD([{"params": params[:1], "momentum": 0.9}, {"params": params[1:], "momentum": 0.5}], lr=0.1)
    adam = torch.optim.Adam(params, betas=(0.8, 0.95))
    corrections = Corrections(params, 3, stage, FDGConfig(delay_momentum=True, accumulate=2))
    seen: list[list[object]] = []
    for optimizer, key in ((sgd, "momentum"), (adam, "betas")):
        before = [group[key] for group in optimizer.param_groups]
        _step(corrections, optimizer, 5, lambda o=optimizer, k=key: seen.append([g[k] for g in o.param_groups]) or True)
        assert [group[key] for group in optimizer.param_groups] == before
        with pytest.raises(RuntimeError):
            _step(corrections, optimizer, 5, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
        assert [group[key] for group in optimizer.param_groups] == before
    p = power or 1.0
    assert seen == [[0.9**p, 0.5**p], [(0.8**p, 0.95)]]


def test_a_peak_lr_scales_the_delay_by_each_groups_lr() -> None:
    """delay_momentum_peak_lr rho: mu ** (1 + h * min(1, lr / rho)) per param group, lr before delay_lr's factor."""
    params = _params()
    sgd = torch.optim.SGD([{"params": params[:1], "lr": 0.2}, {"params": params[1:], "lr": 0.05}], lr=0.1, momentum=0.9)
    config = FDGConfig(delay_momentum=True, delay_momentum_peak_lr=0.1, delay_lr_ticks=100)  # K = 4, stage 0: h = 6
    corrections = Corrections(params, 4, 0, config)
    seen: list[list[float]] = []
    _step(corrections, sgd, 0, lambda: seen.append([g["momentum"] for g in sgd.param_groups]) or True)
    assert seen == [[0.9 ** (1 + 6), 0.9 ** (1 + 6 * 0.5)]]  # lr 0.2 >= rho: h in full; lr 0.05: half of it
    assert [g["momentum"] for g in sgd.param_groups] == [0.9, 0.9]
    assert Corrections(params, 4, 3, config).momentum_power_at(0.05) == 1.0  # the last stage keeps mu
    assert Corrections(params, 4, 0, FDGConfig(delay_momentum=True)).momentum_power_at(1e-9) == 7.0


@pytest.mark.parametrize("stage,power", [(0, 1 / (1 + 2.5 * 4 / 4)), (1, 1 / (1 + 2.5 * 2 / 4)), (2, None)])
def test_a_raised_momentum_is_mu_to_one_over_one_plus_c_times_the_delay(stage: int, power: float | None) -> None:
    """delay_momentum_raise c: mu ** (1 / (1 + c*h)) in the step (K = 3, accumulate 4: h < 1 on stage 1), at every lr,
    put back after it; the last stage (h = 0) keeps mu, and so does K = 1."""
    params = _params()
    sgd = torch.optim.SGD([{"params": params[:1], "lr": 0.2}, {"params": params[1:], "lr": 0.05}], lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(params, betas=(0.8, 0.95))
    corrections = Corrections(params, 3, stage, FDGConfig(delay_momentum_raise=2.5, accumulate=4, delay_lr_ticks=9))
    seen: list[list[object]] = []
    for optimizer, key in ((sgd, "momentum"), (adam, "betas")):
        before = [group[key] for group in optimizer.param_groups]
        _step(corrections, optimizer, 5, lambda o=optimizer, k=key: seen.append([g[k] for g in o.param_groups]) or True)
        assert [group[key] for group in optimizer.param_groups] == before
    p = power or 1.0
    assert seen == [[0.9**p, 0.9**p], [(0.8**p, 0.95)]]
    assert corrections.moves_momentum == (power is not None)
    assert not Corrections(params, 1, 0, FDGConfig(delay_momentum_raise=2.5)).moves_momentum


def test_delay_momentum_needs_an_optimizer_with_momentum() -> None:
    """Checked on every stage, the last one too (every rank raises alike), naming the key and the fix."""
    params = _params()
    for stage in (0, 1):
        corrections = Corrections(params, 2, stage, FDGConfig(delay_momentum=True))
        with pytest.raises(FDGConfigError, match="delay_momentum is true but param group 0 .*Adagrad.* no 'momentum'"):
            corrections.check_optimizer(torch.optim.Adagrad(params), "stage 0")
        corrections.check_optimizer(torch.optim.SGD(params, lr=0.1), "stage 0")  # momentum 0: allowed
    Corrections(params, 2, 0, FDGConfig()).check_optimizer(torch.optim.Adagrad(params), "stage 0")  # off
    raised = Corrections(params, 2, 1, FDGConfig(delay_momentum_raise=2.0))
    with pytest.raises(FDGConfigError, match=r"delay_momentum_raise is 2.0 but param group 0 .*Adagrad.* set "
                       "delay_momentum_raise to null"):  # fmt: skip
        raised.check_optimizer(torch.optim.Adagrad(params), "stage 1")


def test_delta_follows_taken_steps_only() -> None:
    params = _params()
    corrections = Corrections(params, 3, 0, FDGConfig(predict_decay=0.75, accumulate=2))  # h = 4/2
    assert corrections.h == 2.0
    moves = [torch.full_like(p, 0.1) for p in params]

    def move() -> bool:
        with torch.no_grad():
            for p, m in zip(params, moves):
                p.add_(m)
        return True

    before = [p.detach().clone() for p in params]
    _step(corrections, torch.optim.SGD(params, lr=0.1), 0, move)
    assert corrections.delta is not None
    for d, p, b in zip(corrections.delta, params, before):  # 0.75 * 0 + 0.25 * (w_after - w_before)
        assert torch.equal(d, torch.zeros_like(b).mul_(0.75).add_(p.detach() - b, alpha=0.25))
    kept = corrections.capture()
    assert kept is not None
    assert not _step(corrections, torch.optim.SGD(params, lr=0.1), 1, lambda: False)  # skipped: no step
    for d, k in zip(corrections.delta, kept):
        assert torch.equal(d, k)


def test_forward_weights_are_predicted_and_w_comes_back_bit_for_bit() -> None:
    params = _params()
    corrections = Corrections(params, 3, 1, FDGConfig(predict_decay=0.9, accumulate=3))  # h = 2/3
    assert corrections.delta is not None
    g = torch.Generator().manual_seed(1)
    for d in corrections.delta:
        d.copy_(torch.randn(d.shape, generator=g) * 1e-3)
    w = [p.detach().clone() for p in params]
    with corrections.predicted():
        for p, wp, d in zip(params, w, corrections.delta):
            assert torch.equal(p, wp + corrections.h_predict * d)  # the reference's w + h*delta
    for p, wp in zip(params, w):
        assert torch.equal(p, wp)
    last = Corrections(params, 3, 2, FDGConfig(predict_decay=0.9))
    assert last.delta is None  # the last stage predicts nothing and keeps no delta
    first = FDGConfig(predict_decay=0.9, accumulate=2, predict_horizon="first_stage")
    ahead = [Corrections(params, 3, k, first).h_predict for k in range(3)]
    assert ahead == [4 / 2, 3 / 2, 2 / 2]  # (2(K-1) - k) / A: to the tick stage 0 applies the gradient
    assert Corrections(params, 3, 2, first).delta is not None  # the last stage predicts too
    assert Corrections(params, 1, 0, first).delta is None  # K = 1 stays plain backprop


def test_the_prediction_reach_scales_and_discounts_the_horizon() -> None:
    # Note [the prediction's reach]: R = p * h, or p * (mu + mu**2 + ... + mu**h), written out here as a sum
    params = _params()
    own = FDGConfig(predict_decay=0.0)
    assert [Corrections(params, 4, k, own).reach for k in range(3)] == [6.0, 4.0, 2.0]  # h itself
    half = FDGConfig(predict_decay=0.0, predict_scale=0.5)
    assert [Corrections(params, 4, k, half).reach for k in range(3)] == [3.0, 2.0, 1.0]
    nesterov = FDGConfig(predict_decay=0.0, predict_momentum=0.9, predict_scale=0.5, predict_horizon="first_stage")
    for k, h in enumerate((6, 5, 4, 3)):
        assert Corrections(params, 4, k, nesterov).reach == pytest.approx(0.5 * sum(0.9**i for i in range(1, h + 1)))
    one = Corrections(params, 2, 0, FDGConfig(predict_decay=0.0, predict_momentum=0.9, accumulate=2))  # h = 1
    assert one.reach == pytest.approx(0.9)  # Nesterov's look-ahead point w + mu * v
    real = Corrections(params, 3, 1, FDGConfig(predict_decay=0.0, predict_momentum=0.5, accumulate=3))  # h = 2/3
    assert real.reach == pytest.approx(0.5 * (1 - 0.5 ** (2 / 3)) / 0.5)  # the closed form for a real h
    corrections = Corrections(params, 4, 0, nesterov)
    assert corrections.delta is not None
    for d in corrections.delta:
        d.fill_(1e-3)
    w = [p.detach().clone() for p in params]
    with corrections.predicted():
        for p, wp, d in zip(params, w, corrections.delta):
            assert torch.equal(p, wp + corrections.reach * d)
    for p, wp in zip(params, w):
        assert torch.equal(p, wp)


def test_bf16_weights_keep_an_fp32_delta() -> None:
    params = _params(torch.bfloat16)
    corrections = Corrections(params, 2, 0, FDGConfig(predict_decay=0.5))
    assert corrections.delta is not None and all(d.dtype == torch.float32 for d in corrections.delta)

    def move() -> bool:
        with torch.no_grad():
            params[0].add_(1.0)
        return True

    before = params[0].detach().clone()
    _step(corrections, torch.optim.SGD(params, lr=0.1), 0, move)
    moved = params[0].detach().float() - before.float()  # the bf16 weights' own step, not the 1.0 asked for
    assert torch.equal(corrections.delta[0], 0.5 * moved)
    w = params[0].detach().clone()
    with corrections.predicted():  # h = 2: w + 2 * delta, added in fp32 and rounded once to bf16
        assert params[0].dtype == torch.bfloat16
        assert torch.equal(params[0], (w.float() + 2 * corrections.delta[0]).bfloat16())
    assert torch.equal(params[0], w)


def test_delta_round_trip_and_what_a_checkpoint_without_one_gives() -> None:
    params = _params()
    corrections = Corrections(params, 2, 0, FDGConfig(predict_decay=0.5))
    assert corrections.delta is not None
    corrections.delta[0].fill_(3.0)
    saved = corrections.capture()
    other = Corrections(_params(), 2, 0, FDGConfig(predict_decay=0.5))
    other.restore(saved)
    assert other.delta is not None and all(torch.equal(a, b) for a, b in zip(other.delta, corrections.delta))
    other.restore(None)  # saved without prediction: delta starts at zero
    assert all(not d.any() for d in other.delta)
    with pytest.raises(ValueError, match="parameter shapes"):
        other.restore([torch.zeros(2)])
    Corrections(params, 2, 0, FDGConfig()).restore(saved)  # a job without prediction ignores it


@pytest.mark.parametrize("stashed", [False, True])
def test_the_meter_measures_the_relative_distance_every_n_ticks(stashed: bool) -> None:
    params = _params()
    meter = StalenessMeter(params, every=3, delayed=True)
    w_fwd = [p.detach().clone() for p in params]
    probes = [meter.after_forward(tick, [w.clone() for w in w_fwd] if stashed else None) for tick in (0, 1, 2)]
    assert [probe is not None for probe in probes] == [True, False, False]  # only tick 0 of ticks 0-2
    with torch.no_grad():
        params[0][0, 0] += 3.0
        params[1][1] -= 4.0
    meter.before_backward(2, probes[1])  # not measured
    assert meter.count == 0 and math.isnan(meter.read())
    meter.before_backward(2, probes[0])
    norm = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in params))
    assert meter.count == 1 and meter.tick == 2
    assert meter.read() == pytest.approx(5.0 / norm, rel=1e-6)
    assert isinstance(meter.value, torch.Tensor)  # kept on the device until read
    assert StalenessMeter(params, every=3, delayed=False).every == 0  # the last stage
    assert StalenessMeter(params, every=0, delayed=True).every == 0
