"""The single-process reference against hand-computed definitions of FDG's update."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fdg_schedule import FDGConfig, fdg_reference

MODES = [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]


def _data(n: int, seed: int = 0, size: int = 5, dim: int = 4, classes: int = 3) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, dim, generator=g), torch.randint(0, classes, (size,), generator=g)) for _ in range(n)]


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("weights,activations", MODES)
def test_one_stage_is_plain_backprop_bit_for_bit(weights: str, activations: str, accumulate: int) -> None:
    data = _data(7)
    fdg_model, bp_model = _mlp(), _mlp()
    fdg_opt = torch.optim.SGD(fdg_model.parameters(), lr=0.1, momentum=0.9)
    bp_opt = torch.optim.SGD(bp_model.parameters(), lr=0.1, momentum=0.9)
    config = FDGConfig(grad_shrink=0.3, weights=weights, activations=activations, accumulate=accumulate)
    losses = fdg_reference([fdg_model], [fdg_opt], data, F.cross_entropy, config, drain=True)
    bp_losses = []
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(bp_model(x), y)
        (loss / accumulate).backward()
        bp_losses.append(loss.item())
        if (i + 1) % accumulate == 0 or i == len(data) - 1:
            bp_opt.step()
            bp_opt.zero_grad()
    assert losses == bp_losses
    for p, q in zip(fdg_model.parameters(), bp_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("grad_shrink", [1.0, 0.5, 0.2])
def test_first_update_of_stage_k_is_beta_to_the_k_minus_1_minus_k_times_backprop(grad_shrink: float) -> None:
    """Micro-batch 0 sees only initial weights on every stage, so its FDG gradient is BP's times beta^(K-1-k)."""
    model = _mlp()
    x, y = _data(1)[0]
    F.cross_entropy(model(x), y).backward()
    bp_grads = [p.grad.clone() for p in model.parameters()]
    stages = [copy.deepcopy(model[0:2]), copy.deepcopy(model[2:4]), copy.deepcopy(model[4:])]
    for s in stages:
        s.zero_grad()
    initial = [p.detach().clone() for s in stages for p in s.parameters()]
    lr = 0.1
    opts = [torch.optim.SGD(s.parameters(), lr=lr) for s in stages]
    K = 3
    # Run to the tick where stage 0 steps for micro-batch 0 (tick 4); every stage has stepped once by then.
    fdg_reference(stages, opts, [(x, y)], F.cross_entropy, FDGConfig(grad_shrink=grad_shrink), drain=True)
    owners = [0, 0, 1, 1, 2, 2]
    for p0, s_k, g, p in zip(initial, owners, bp_grads, [p for s in stages for p in s.parameters()]):
        expected = p0 - lr * grad_shrink ** (K - 1 - s_k) * g
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


class _Capture(nn.Module):
    """Records the gradient flowing into the stage it starts (what the stage sends upstream)."""

    def __init__(self) -> None:
        super().__init__()
        self.grads: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        x.register_hook(lambda g: self.grads.append(g.clone()))
        return x


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.grads: list[list[Tensor]] = []

    def step(self, closure=None):  # type: ignore[override]
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@pytest.mark.parametrize("weights,activations", MODES)
def test_each_mode_equals_its_definition(weights: str, activations: str) -> None:
    """K = 2: stage 0 = Wb tanh(Wa x). Micro-batch 1 is forwarded at tick 1 (weights W_f) and
    back-propagated at tick 3 (weights W_c, after one step) with gradient g from stage 1."""
    torch.manual_seed(0)
    stage0 = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 5, bias=False))
    capture = _Capture()
    stage1 = nn.Sequential(capture, nn.Linear(5, 3))
    lr, beta = 0.5, 0.7
    opt0, opt1 = _RecordingSGD(stage0.parameters(), lr), torch.optim.SGD(stage1.parameters(), lr=lr)
    Wa_f, Wb_f = stage0[0].weight.detach().clone(), stage0[2].weight.detach().clone()
    data = _data(4)
    config = FDGConfig(grad_shrink=beta, weights=weights, activations=activations)
    fdg_reference([stage0, stage1], [opt0, opt1], data, F.cross_entropy, config)
    # Stage 0 stepped at tick 2 (micro-batch 0, W_f) and tick 3 (micro-batch 1).
    assert len(opt0.grads) == 2
    Wa_c, Wb_c = Wa_f - lr * opt0.grads[0][0], Wb_f - lr * opt0.grads[0][1]
    x, g = data[1][0], beta * capture.grads[1]
    if weights == "stashed":  # the exact gradient of the forward that ran
        Wb, h = Wb_f, torch.tanh(x @ Wa_f.T)
    elif activations == "stored":  # stored activations, saved weights read now
        Wb, h = Wb_c, torch.tanh(x @ Wa_f.T)
    else:  # forward rerun at the current weights
        Wb, h = Wb_c, torch.tanh(x @ Wa_c.T)
    d_pre = (g @ Wb) * (1 - h * h)
    expected = [d_pre.T @ x, g.T @ h]
    for got, want in zip(opt0.grads[1], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_stored_and_recomputed_agree_with_stashed_weights_even_with_dropout_and_batchnorm() -> None:
    def stages() -> list[nn.Module]:
        torch.manual_seed(1)
        return [
            nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Tanh()),
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Tanh()),
            nn.Linear(8, 3),
        ]

    results = []
    for activations in ("stored", "recomputed"):
        torch.manual_seed(123)  # the same dropout masks in both runs
        st = stages()
        opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in st]
        losses = fdg_reference(st, opts, _data(9), F.cross_entropy, FDGConfig(0.5, "stashed", activations), drain=True)
        results.append((losses, [t.detach().clone() for s in st for t in s.state_dict().values()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # running statistics updated once per micro-batch


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_schedulers_step_every_tick_and_clipping_is_stage_local() -> None:
    st = [_mlp()[0:2], _mlp()[2:]]
    opts = [torch.optim.SGD(s.parameters(), lr=1.0) for s in st]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    lrs: list[float] = []
    snapshots = [[torch.cat([p.detach().flatten() for p in s.parameters()]) for s in st]]

    def after_tick(tick: int) -> None:
        lrs.append(opts[0].param_groups[0]["lr"])
        snapshots.append([torch.cat([p.detach().flatten() for p in s.parameters()]) for s in st])

    clip = 1e-3
    fdg_reference(
        st, opts, _data(3), F.cross_entropy, drain=True, schedulers=scheds, clip_grad_norm=clip, after_tick=after_tick
    )
    assert lrs == [0.5**t for t in range(1, 6)]  # 3 micro-batches + 2 drain ticks, fill included
    # Each stage's first step has norm lr * clip: the norm is the stage's own, not the model's.
    # Stage 1 first steps at tick 1 (lr 0.5), stage 0 at tick 2 (lr 0.25).
    for stage, tick, lr in ((1, 1, 0.5), (0, 2, 0.25)):
        assert torch.equal(snapshots[tick][stage], snapshots[0][stage])
        step = (snapshots[tick + 1][stage] - snapshots[tick][stage]).norm().item()
        assert step == pytest.approx(lr * clip, rel=1e-4)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_schedulers_step_once_per_accumulate_ticks() -> None:
    # Note [learning rate per optimizer step]: accumulate = 2 -> one scheduler step every 2 ticks.
    st = [_mlp()[0:2], _mlp()[2:]]
    opts = [torch.optim.SGD(s.parameters(), lr=1.0) for s in st]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    lrs: list[float] = []
    config = FDGConfig(accumulate=2)
    after = lambda tick: lrs.append(opts[0].param_groups[0]["lr"])  # noqa: E731
    fdg_reference(st, opts, _data(3), F.cross_entropy, config, drain=True, schedulers=scheds, after_tick=after)
    assert lrs == [1.0, 0.5, 0.5, 0.25, 0.25]  # 3 micro-batches + 2 drain ticks
