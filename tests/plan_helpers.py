"""A model profile of identical layers, for the planner's tests (exact expected values)."""

from __future__ import annotations

from fdg_schedule.plan import LayerCost, ModelProfile


def uniform_profile(layers: int = 8, f: float = 1.0, b: float = 2.0, step: float = 0.0, saved: float = 100.0,
                    act: float = 10.0, params: float = 40.0) -> ModelProfile:  # fmt: skip
    return ModelProfile(
        layers=tuple(LayerCost(f"l{i}", f, b, f, step, params, act, saved) for i in range(layers)),
        micro_batch=4,
        device="test",
        dtype="float32",
        input_bytes=act,
    )
