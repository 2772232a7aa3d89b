"""fdg_schedule.base.rng: the forward's RNG state is saved and replayed through DeepSpeed's accelerator API.

The CPU accelerator's generator is the host one; an accelerator with its own generator is stood in
for by a fake (no other accelerator exists on the machines the suite runs on).
"""

from __future__ import annotations

import torch

from fdg_schedule.base import rng


class FakeAccelerator:
    """An accelerator whose device generator is a torch.Generator of its own."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(7)

    def device_name(self, device_index: int | None = None) -> str:
        return "xpu" if device_index is None else f"xpu:{device_index}"

    def is_available(self) -> bool:
        return True

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        self.generator.set_state(state)


def test_cpu_accelerator_replays_the_host_generator() -> None:
    state = rng.capture()
    assert state.device is None  # the CPU accelerator's generator is the host one
    first = torch.rand(4)
    with rng.replayed(state):
        assert torch.equal(torch.rand(4), first)
    assert not torch.equal(torch.rand(4), first)  # the generator is back where it was, not replayed


def test_an_accelerator_generator_is_saved_and_replayed(monkeypatch) -> None:
    fake = FakeAccelerator()
    monkeypatch.setattr(rng, "get_accelerator", lambda: fake)
    state = rng.capture()
    assert state.device is not None
    draws = torch.rand(3, generator=fake.generator), torch.rand(3)
    after = fake.generator.get_state()
    with rng.replayed(state):
        assert torch.equal(torch.rand(3, generator=fake.generator), draws[0])
        assert torch.equal(torch.rand(3), draws[1])
    assert torch.equal(fake.generator.get_state(), after)  # a fork: the device generator moved on as before
