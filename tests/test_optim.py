"""The optimizer side of a stage: what replaces DeepSpeed's gradient reduce with one data-parallel rank.

That the engine takes the shortcut only where it changes no number is checked end to end by
test_engine.py (tick-by-tick parity with the reference, dp = 1 and dp = 2, and no collective at all
in steady state with dp = 1).
"""

from __future__ import annotations

import torch
from torch import nn

from fdg_schedule.base import optim


def test_fill_missing_grads_gives_zeros_where_deepspeeds_reduce_would() -> None:
    torch.manual_seed(0)
    used, unused, frozen = nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 2)
    frozen.requires_grad_(False)
    module = nn.ModuleList([used, unused, frozen])
    used(torch.randn(4, 3)).sum().backward()
    before = used.weight.grad.clone()

    assert optim.fill_missing_grads(module.parameters())

    assert torch.equal(used.weight.grad, before)  # an existing gradient is left as it is (not copied)
    assert torch.equal(unused.weight.grad, torch.zeros(2, 3)) and torch.equal(unused.bias.grad, torch.zeros(2))
    assert frozen.weight.grad is None and frozen.bias.grad is None

    # What that changes: a momentum optimizer steps a parameter with a zero gradient (weight decay moves it).
    sgd = torch.optim.SGD(unused.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    weight = unused.weight.detach().clone()
    sgd.step()
    assert not torch.equal(unused.weight, weight)


def test_fill_missing_grads_leaves_sparse_gradients_to_deepspeed() -> None:
    embedding, unused = nn.Embedding(5, 2, sparse=True), nn.Linear(2, 2)
    embedding(torch.tensor([1, 3])).sum().backward()
    assert not optim.fill_missing_grads(nn.ModuleList([embedding, unused]).parameters())
    assert unused.weight.grad is None  # nothing changed
