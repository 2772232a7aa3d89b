"""The single-process reference against hand-computed definitions of FDG's update."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fdg_schedule import FDGConfig, fdg_reference
from fdg_schedule.corrections.reference import ReferenceState, _Corrections

MODES = [(w, a) for w in ("current", "stashed") for a in ("stored", "recomputed")]


def _data(n: int, seed: int = 0, size: int = 5, dim: int = 4, classes: int = 3) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, dim, generator=g), torch.randint(0, classes, (size,), generator=g)) for _ in range(n)]


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("corrections", [{}, {"delay_lr_ticks": 3, "predict_decay": 0.9}])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("weights,activations", MODES)
def test_one_stage_is_plain_backprop_bit_for_bit(weights: str, activations: str, accumulate: int, corrections) -> None:
    data = _data(7)
    fdg_model, bp_model = _mlp(), _mlp()
    fdg_opt = torch.optim.SGD(fdg_model.parameters(), lr=0.1, momentum=0.9)
    bp_opt = torch.optim.SGD(bp_model.parameters(), lr=0.1, momentum=0.9)
    config = FDGConfig(grad_shrink=0.3, weights=weights, activations=activations, accumulate=accumulate, **corrections)
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


@pytest.mark.parametrize("predict_decay", [None, 0.8])
def test_stored_and_recomputed_agree_with_stashed_weights_even_with_dropout_and_batchnorm(predict_decay) -> None:
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
        config = FDGConfig(0.5, "stashed", activations, predict_decay=predict_decay)
        losses = fdg_reference(st, opts, _data(9), F.cross_entropy, config, drain=True)
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


# --- staleness corrections (Note [staleness corrections] in reference.py) ---------------------------


class _StepLog(torch.optim.SGD):
    """Plain SGD that records, at each step, the lr it was given and the parameters before and after."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.steps: list[dict] = []

    def step(self, closure=None):  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"]]
        entry = {
            "lr": self.param_groups[0]["lr"],
            "grads": [p.grad.clone() for p in params],
            "before": [p.detach().clone() for p in params],
        }
        result = super().step(closure)
        entry["after"] = [p.detach().clone() for p in params]
        self.steps.append(entry)
        return result


def _linear_stages(K: int, seed: int = 0, width: int = 4) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(width, width if k < K - 1 else 3, bias=False) for k in range(K)]


def _step_lrs(K: int, config: FDGConfig, n: int, lr: float = 1.0, calls: int = 1) -> list[list[float]]:
    stages = _linear_stages(K)
    opts = [_StepLog(s.parameters(), lr) for s in stages]
    state = ReferenceState()
    for call in range(calls):
        fdg_reference(stages, opts, _data(n, seed=call), F.cross_entropy, config, drain=True, state=state)
    for opt in opts:
        assert opt.param_groups[0]["lr"] == lr  # put back after every step
        for entry in opt.steps:  # the step ran with the lr it was given
            for g, before, after in zip(entry["grads"], entry["before"], entry["after"], strict=True):
                torch.testing.assert_close(after, before - entry["lr"] * g, rtol=0, atol=1e-7)
    return [[entry["lr"] / lr for entry in opt.steps] for opt in opts]


def test_delay_lr_factor_per_stage_and_tick() -> None:
    """K=3, accumulate 1, T=8: h = 4, 2, 0. Stage 0 steps at ticks 4..9, stage 1 at ticks 3..8, the
    last stage at ticks 2..7 (6 micro-batches and a drain); factor tau ** -max(0, 1 - t/8)."""
    factors = _step_lrs(3, FDGConfig(delay_lr_ticks=8), n=6)
    expected = [
        [4 ** -(4 / 8), 4 ** -(3 / 8), 4 ** -(2 / 8), 4 ** -(1 / 8), 1.0, 1.0],  # ticks 4, 5, 6, 7, 8, 9
        [2 ** -(5 / 8), 2 ** -(4 / 8), 2 ** -(3 / 8), 2 ** -(2 / 8), 2 ** -(1 / 8), 1.0],  # ticks 3 .. 8
        [1.0] * 6,
    ]
    for got, want in zip(factors, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12)


def test_delay_lr_uses_the_delay_in_optimizer_steps() -> None:
    """accumulate 2: h = 4/2 = 2 and 2/2 = 1 (tau 1: no factor). Stage 0 steps after the backward of
    micro-batches 1, 3, 4 (the drain steps the partial one) at ticks 5, 7, 8."""
    factors = _step_lrs(3, FDGConfig(delay_lr_ticks=10, accumulate=2), n=5)
    assert factors[0] == pytest.approx([2 ** -(5 / 10), 2 ** -(3 / 10), 2 ** -(2 / 10)], rel=1e-12)
    assert factors[1] == [1.0, 1.0, 1.0]


def test_delay_lr_tick_continues_across_calls() -> None:
    """K=2, two calls of 3 micro-batches, each drained (5 ticks): stage 0 (tau 2) steps at ticks
    2, 3, 4, then 7, 8, 9 -- not 2, 3, 4 again."""
    factors = _step_lrs(2, FDGConfig(delay_lr_ticks=10), n=3, calls=2)
    want = [2 ** -(8 / 10), 2 ** -(7 / 10), 2 ** -(6 / 10), 2 ** -(3 / 10), 2 ** -(2 / 10), 2 ** -(1 / 10)]
    assert factors[0] == pytest.approx(want, rel=1e-12)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_delay_lr_multiplies_what_the_scheduler_gives_and_leaves_it_alone() -> None:
    stages = _linear_stages(2)
    opts = [_StepLog(s.parameters(), 1.0) for s in stages]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (t + 1)) for o in opts]
    seen: list[float] = []
    config = FDGConfig(delay_lr_ticks=4)
    fdg_reference(
        stages, opts, _data(4), F.cross_entropy, config, drain=True, schedulers=scheds,
        after_tick=lambda tick: seen.append(opts[0].param_groups[0]["lr"]),
    )  # fmt: skip
    assert seen == pytest.approx([1 / (t + 2) for t in range(6)])  # the scheduler's values, untouched
    # stage 0 steps at ticks 2..5 with lr(t) = 1/(t+1) times 2 ** -max(0, 1 - t/4)
    want = [1 / 3 * 2 ** -(2 / 4), 1 / 4 * 2 ** -(1 / 4), 1 / 5, 1 / 6]
    assert [e["lr"] for e in opts[0].steps] == pytest.approx(want, rel=1e-12)


class _Inputs(nn.Module):
    """Records the activations entering the stage it starts (what the previous stage sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.detach().clone())
        return x


@pytest.mark.parametrize("weights,activations", MODES)
def test_prediction_in_each_mode_equals_its_definition(weights: str, activations: str) -> None:
    """K = 2, stage 0 = Wb tanh(Wa x), h = 2, gamma 0.5, SGD lr 0.5 without momentum.

    Stage 0 steps at tick 2 (w0 -> w1) and tick 3 (w1 -> w2), so delta = (1-gamma)(w1 - w0) when it
    forwards micro-batch 2 at tick 2, on w_hat = w1 + 2 delta; it back-propagates micro-batch 2 at
    tick 4, when the live weights are w2."""
    torch.manual_seed(0)
    stage0 = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 5, bias=False))
    capture, inputs = _Capture(), _Inputs()
    stage1 = nn.Sequential(inputs, capture, nn.Linear(5, 3))
    lr, beta, gamma = 0.5, 0.7, 0.5
    opt0, opt1 = _StepLog(stage0.parameters(), lr), torch.optim.SGD(stage1.parameters(), lr=lr)
    data = _data(5)
    config = FDGConfig(grad_shrink=beta, weights=weights, activations=activations, predict_decay=gamma)
    state = ReferenceState()
    fdg_reference([stage0, stage1], [opt0, opt1], data, F.cross_entropy, config, state=state)
    assert len(opt0.steps) == 3  # ticks 2, 3, 4
    w0, w1, w2 = opt0.steps[0]["before"], opt0.steps[1]["before"], opt0.steps[2]["before"]
    delta1 = [(1 - gamma) * (b - a) for a, b in zip(w0, w1)]
    Wa_hat, Wb_hat = (w + 2 * d for w, d in zip(w1, delta1))
    x = data[2][0]
    # The activation micro-batch 2 carried to stage 1 came from the predicted weights...
    torch.testing.assert_close(inputs.seen[2], torch.tanh(x @ Wa_hat.T) @ Wb_hat.T, rtol=1e-5, atol=1e-6)
    # ...micro-batches 0 and 1 were forwarded before any step: delta was zero.
    torch.testing.assert_close(inputs.seen[1], torch.tanh(data[1][0] @ w0[0].T) @ w0[1].T)
    g = beta * capture.grads[2]
    if weights == "stashed":  # the gradient of the forward that ran, at w_hat
        Wb, h = Wb_hat, torch.tanh(x @ Wa_hat.T)
    elif activations == "stored":  # activations from w_hat, saved weights read live (w2)
        Wb, h = w2[1], torch.tanh(x @ Wa_hat.T)
    else:  # recomputed on the live weights
        Wb, h = w2[1], torch.tanh(x @ w2[0].T)
    d_pre = (g @ Wb) * (1 - h * h)
    for got, want in zip(opt0.steps[2]["grads"], [d_pre.T @ x, g.T @ h]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # delta after three steps, by its recursion over the steps actually taken
    delta = [torch.zeros_like(w) for w in w0]
    for entry in opt0.steps:
        delta = [gamma * d + (1 - gamma) * (a - b) for d, a, b in zip(delta, entry["after"], entry["before"])]
    for got, want in zip(state.delta[0].values(), delta):
        torch.testing.assert_close(got, want)
    assert 1 not in state.delta  # the last stage has h = 0: nothing to predict


def test_prediction_uses_the_delay_in_optimizer_steps() -> None:
    """K = 2, accumulate 2: h = 2/2 = 1. Stage 0 first steps at tick 3 (after the backward of
    micro-batch 1, before the forward of micro-batch 3), so micro-batches 3 and 4 run on
    w1 + 1 * (1-gamma)(w1 - w0) and micro-batch 2 (tick 2) on w0."""
    torch.manual_seed(0)
    stage0, inputs = nn.Linear(4, 5, bias=False), _Inputs()
    stage1 = nn.Sequential(inputs, nn.Linear(5, 3))
    gamma = 0.25
    opt0 = _StepLog(stage0.parameters(), 0.5)
    opts = [opt0, torch.optim.SGD(stage1.parameters(), lr=0.5)]
    data = _data(6)
    config = FDGConfig(accumulate=2, predict_decay=gamma)
    fdg_reference([stage0, stage1], opts, data, F.cross_entropy, config)
    w0, w1 = opt0.steps[0]["before"][0], opt0.steps[0]["after"][0]
    w_hat = w1 + 1 * (1 - gamma) * (w1 - w0)
    torch.testing.assert_close(inputs.seen[2], data[2][0] @ w0.T)
    torch.testing.assert_close(inputs.seen[3], data[3][0] @ w_hat.T)
    torch.testing.assert_close(inputs.seen[4], data[4][0] @ w_hat.T)  # no step at tick 4 (accumulating)


@pytest.mark.parametrize("weights,activations", MODES)
def test_first_stage_horizon_predicts_the_last_stage_too(weights: str, activations: str) -> None:
    """K = 2, ``predict_horizon: "first_stage"``: stage 0 still predicts 2 ticks ahead, the last stage
    (Wb tanh(Wa x)) 1 tick ahead: micro-batch b's forward on it (tick b + 1, after b steps) runs on
    w_hat = w + 1 * delta. Its gradient: "stashed" at w_hat; "current" with w_hat's activations and the
    live w read in the backward (the last stage never recomputes, so both activation modes agree)."""
    torch.manual_seed(0)
    inputs = _Inputs()
    stage0 = nn.Linear(4, 5, bias=False)
    stage1 = nn.Sequential(inputs, nn.Linear(5, 6, bias=False), nn.Tanh(), nn.Linear(6, 3, bias=False))
    gamma = 0.5
    opt0, opt1 = _StepLog(stage0.parameters(), 0.5), _StepLog(stage1.parameters(), 0.5)
    data = _data(5)
    config = FDGConfig(weights=weights, activations=activations, predict_decay=gamma, predict_horizon="first_stage")
    state = ReferenceState()
    fdg_reference([stage0, stage1], [opt0, opt1], data, F.cross_entropy, config, state=state)
    # stage 0: h = 2, as under "own": micro-batch 2 (tick 2) runs on w + 2 * delta, delta from its one step
    w0, w1 = opt0.steps[0]["before"][0], opt0.steps[0]["after"][0]
    torch.testing.assert_close(inputs.seen[2], data[2][0] @ (w1 + 2 * (1 - gamma) * (w1 - w0)).T)
    delta = [torch.zeros_like(w) for w in opt1.steps[0]["before"]]
    for b, entry in enumerate(opt1.steps):  # the last stage's step b back-propagates micro-batch b
        Wa, Wb = entry["before"]
        Wa_hat, Wb_hat = (w + 1 * d for w, d in zip(entry["before"], delta))
        x, y = inputs.seen[b], data[b][1]
        h = torch.tanh(x @ Wa_hat.T)
        g = (torch.softmax(h @ Wb_hat.T, dim=1) - F.one_hot(y, 3)) / len(y)
        d_pre = (g @ (Wb_hat if weights == "stashed" else Wb)) * (1 - h * h)
        for got, want in zip(entry["grads"], [d_pre.T @ x, g.T @ h]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, b=b: f"step {b}: {m}")
        delta = [gamma * d + (1 - gamma) * (a - w) for d, a, w in zip(delta, entry["after"], entry["before"])]
    assert any(d.abs().sum() > 0 for d in state.delta[1].values())  # the last stage keeps a delta
    for got, want in zip(state.delta[1].values(), delta):
        torch.testing.assert_close(got, want)


def _simulate(weights0: list[Tensor], data, K: int, beta: float, A: int, T: int, gamma: float, lr: float,
              stashed: bool) -> tuple[list[Tensor], list[float]]:  # fmt: skip
    """FDG with both corrections for linear stages y = x W_k^T and loss sum((y - t)^2) / (2 batch),
    written from the definitions: stage k forwards micro-batch b at tick b + k and back-propagates it
    at tick b + 2(K-1) - k; within a tick a stage back-propagates and steps before it forwards."""
    n = len(data)
    W = [w.clone() for w in weights0]
    delta = [torch.zeros_like(w) for w in W]
    acc = [torch.zeros_like(w) for w in W]
    h = [2 * (K - 1 - k) / A for k in range(K)]
    inputs: dict[tuple[int, int], Tensor] = {}  # (stage, b) -> input the forward saw
    used: dict[tuple[int, int], Tensor] = {}  # (stage, b) -> weights the forward used
    grad_out: dict[tuple[int, int], Tensor] = {}  # (stage, b) -> gradient w.r.t. the stage output
    losses = []

    def step(k: int, b: int, t: int) -> None:
        if (b + 1) % A and b != n - 1:
            return
        factor = max(1.0, h[k]) ** -max(0.0, 1 - t / T)
        new = W[k] - lr * factor * acc[k]
        delta[k] = gamma * delta[k] + (1 - gamma) * (new - W[k])
        W[k], acc[k] = new, torch.zeros_like(acc[k])

    for t in range(n + 2 * (K - 1)):
        for k in range(K):
            b = t - k - 2 * (K - 1 - k)  # backward (non-last stages)
            if k < K - 1 and 0 <= b < n:
                g = beta * grad_out[k, b]
                acc[k] += g.T @ inputs[k, b]
                if k > 0:
                    grad_out[k - 1, b] = g @ (used[k, b] if stashed else W[k])
                step(k, b, t)
            b = t - k  # forward
            if not 0 <= b < n:
                continue
            x = data[b][0] if k == 0 else inputs[k, b]
            inputs[k, b] = x
            used[k, b] = W[k] + h[k] * delta[k] if k < K - 1 else W[k]
            y = x @ used[k, b].T
            if k < K - 1:
                inputs[k + 1, b] = y
                continue
            target = data[b][1]
            losses.append(float(((y - target) ** 2).sum() / (2 * len(x))))
            g = (y - target) / len(x) / A
            acc[k] += g.T @ x
            grad_out[k - 1, b] = g @ W[k]
            step(k, b, t)
    return W, losses


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("weights,activations", MODES)
def test_both_corrections_with_beta_and_accumulate_equal_a_hand_simulation(
    weights: str, activations: str, accumulate: int
) -> None:
    """Three linear stages (for which stored and recomputed activations give the same gradients)."""
    torch.manual_seed(3)
    stages = [nn.Linear(4, 4, bias=False).double() for _ in range(3)]
    weights0 = [s.weight.detach().clone() for s in stages]
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 4, generator=g).double(), torch.randn(2, 4, generator=g).double()) for _ in range(9)]
    beta, T, gamma, lr = 0.6, 7, 0.7, 0.05
    config = FDGConfig(
        grad_shrink=beta, weights=weights, activations=activations, accumulate=accumulate,
        delay_lr_ticks=T, predict_decay=gamma,
    )  # fmt: skip
    opts = [torch.optim.SGD(s.parameters(), lr=lr) for s in stages]

    def mse(y: Tensor, target: Tensor) -> Tensor:
        return ((y - target) ** 2).sum() / (2 * len(y))

    losses = fdg_reference(stages, opts, data, mse, config, drain=True)
    want_weights, want_losses = _simulate(weights0, data, 3, beta, accumulate, T, gamma, lr, weights == "stashed")
    assert losses == pytest.approx(want_losses, rel=1e-12)
    for s, want in zip(stages, want_weights, strict=True):
        torch.testing.assert_close(s.weight.detach(), want, rtol=1e-12, atol=1e-14)
    # and the corrections changed something: without them the weights differ
    plain = _simulate(weights0, data, 3, beta, accumulate, 10**9, 0.0, lr, weights == "stashed")[0]
    assert not torch.allclose(plain[0], want_weights[0], rtol=1e-6, atol=0)


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


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("peak_lr", [None, 0.4, "raise"])
def test_delay_momentum_is_the_momentum_of_each_stage_raised_to_one_plus_its_delay(
    optimizer: str, accumulate: int, peak_lr: float | str | None
) -> None:
    """delay_momentum (Note [staleness corrections]) equals running the plain update with stage k's optimizer built
    with momentum mu ** (1 + h_k), h_k = 2(K-1-k) / accumulate: the last stage keeps mu. With
    delay_momentum_peak_lr rho: mu ** (1 + h_k * min(1, lr / rho)) (constant lr here: SGD 0.1, Adam 0.01). With
    delay_momentum_raise c instead ("raise", c = 1.5): mu ** (1 / (1 + c * h_k))."""
    K, mu, c = 3, 0.9, 1.5
    lr = 0.1 if optimizer == "sgd" else 0.01
    share = 1.0 if not isinstance(peak_lr, float) else min(1.0, lr / peak_lr)

    def power(k: int) -> float:
        h = 2 * (K - 1 - k) / accumulate
        return 1 / (1 + c * h) if peak_lr == "raise" else 1 + h * share

    def build(with_power: bool) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.5)
        stages = [model[0:2], model[2:4], model[4:]]
        opts = []
        for k, stage in enumerate(stages):
            m = mu ** power(k) if with_power else mu
            if optimizer == "sgd":
                opts.append(torch.optim.SGD(stage.parameters(), lr=lr, momentum=m))
            else:
                opts.append(torch.optim.Adam(stage.parameters(), lr=lr, betas=(m, 0.99)))
        return stages, opts

    data = _data(12)
    corrected, corrected_opts = build(False)
    config = FDGConfig(0.5, "stashed", accumulate=accumulate)
    if peak_lr == "raise":
        momentum: dict[str, object] = {"delay_momentum_raise": c}
    else:
        momentum = {"delay_momentum": True, "delay_momentum_peak_lr": peak_lr}
    got = fdg_reference(corrected, corrected_opts, data, F.cross_entropy, FDGConfig(
        0.5, "stashed", accumulate=accumulate, **momentum), drain=True)  # fmt: skip
    preset, preset_opts = build(True)
    want = fdg_reference(preset, preset_opts, data, F.cross_entropy, config, drain=True)
    assert got == want
    for a, b in zip(corrected, preset):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    for opt in corrected_opts:  # put back after every step
        group = opt.param_groups[0]
        assert group.get("momentum", mu) == mu and group.get("betas", (mu, 0.99)) == (mu, 0.99)


@pytest.mark.parametrize(
    ("keys", "K", "reach"),
    [
        ({}, 4, [6, 4, 2, 0]),  # h_k itself: the prediction before predict_scale existed
        ({"predict_scale": 0.5}, 4, [3, 2, 1, 0]),
        ({"predict_scale": 0.5, "predict_horizon": "first_stage"}, 3, [2, 1.5, 1]),
        ({"predict_momentum": 0.5}, 3, [0.5 + 0.25 + 0.125 + 0.0625, 0.5 + 0.25, 0]),  # mu + ... + mu**h
        ({"predict_momentum": 0.5, "predict_scale": 2.0, "accumulate": 2}, 2, [2 * 0.5]),  # h = 1: p * mu
    ],
)
def test_the_references_forwards_reach_p_times_the_discounted_horizon(keys: dict, K: int, reach: list[float]) -> None:
    # Note [staleness corrections], predict_scale and predict_momentum: w_hat = w + R*delta
    config = FDGConfig(predict_decay=0.0, **keys)
    stage = nn.Linear(2, 2)
    for k, want in enumerate(reach):
        corrections = _Corrections(stage, k, K, 0, config, ReferenceState(), set())
        assert corrections.reach == pytest.approx(want, rel=1e-15, abs=0)
        if corrections.delta is not None:
            for d in corrections.delta.values():
                d.fill_(0.25)
            predicted = corrections.predicted()
            assert predicted is not None
            torch.testing.assert_close(predicted["weight"], stage.weight + want * 0.25, rtol=0, atol=1e-7)
