"""fdg_schedule.exchange.flat_state: the tied copies moved into 1F1B's flat layout and out again, in one
process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fdg_schedule.exchange import flat_state
from fdg_schedule.exchange.flat_state import FlatGroup, TiedEntry


def test_layout_follows_zero1s_rules() -> None:
    """ZeRO-1 pads each parameter but the last to ``parameter_alignment`` and the group to 2 x dp; the
    partitions are equal; the last rank holds the padding."""
    g = FlatGroup(numels=(5, 3, 6), names=("a", "b", "c"), dp=2, param_alignment=4)
    assert g.paddings == (3, 1, 0) and g.offsets == (0, 8, 12) and g.lean == 18
    assert g.partition == 10  # 18 -> 20, two partitions of 10
    assert [g.group_padding(r) for r in range(2)] == [0, 2]
    assert [(k, v.start, v.numel) for k, v in g.slices(1).items()] == [("b", 0, 1), ("c", 2, 6)]
    bf16 = FlatGroup(numels=(5, 3, 6), names=("a", "b", "c"), dp=4, lean_fp32=False)
    assert bf16.partition == 4 and [bf16.group_padding(r) for r in range(4)] == [0, 0, 0, 2]


def _flat_sd(layout: FlatGroup, values: dict[str, torch.Tensor], rank: int, step: int) -> dict[str, Any]:
    """A rank's flat state dict of one group, as DeepSpeed writes it (its partition of fp32 and of the moments)."""

    def part(key: str) -> torch.Tensor:
        return layout.part(layout.join([values[f"{n}.{key}"] for n in layout.names]), rank)

    fp32 = part("fp32")
    state = {"step": torch.tensor(float(step)), "exp_avg": part("m"), "exp_avg_sq": part("v")}
    return {
        flat_state.BASE: {"state": {0: state}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        flat_state.FP32: [fp32[: layout.partition - layout.group_padding(rank)] if layout.lean_fp32 else fp32],
        flat_state.GROUP_PADDINGS: [layout.group_padding(rank)],
        flat_state.SLICES: [layout.slices(rank)],
        flat_state.PARAM_PADDINGS: [list(layout.paddings)],
    }  # fmt: skip


@pytest.mark.parametrize("dp,alignment,lean", [(1, 1, True), (2, 4, True), (3, 1, False)])
def test_to_1f1b_writes_1f1bs_file_and_from_1f1b_reads_it_back(dp: int, alignment: int, lean: bool) -> None:
    """FDG's partitions plus a tied copy (inserted at index 1) give, rank by rank, exactly the file 1F1B writes for
    the same values; reading 1F1B's files gives FDG's partitions and the copy's values back."""
    torch.manual_seed(0)
    shapes = {"w0": (3, 2), "tied": (4, 3), "w1": (5,), "w2": (2, 2)}
    values = {f"{n}.{k}": torch.randn(shape).reshape(-1) for n, shape in shapes.items() for k in ("fp32", "m", "v")}
    fdg = FlatGroup((6, 5, 4), ("w0", "w1", "w2"), dp, alignment, lean)
    onef1b = fdg.with_inserted(1, 12, "tied")
    fdg_files = [_flat_sd(fdg, values, r, step=7) for r in range(dp)]
    want = [_flat_sd(onef1b, values, r, step=7) for r in range(dp)]

    def gather_from(files: list[dict[str, Any]], layout: FlatGroup, rank: int):
        """What rank's all_gather returns: every rank's partition of the buffer ``t`` is a partition of."""
        parts = {key: [_padded_part(f, layout, key) for f in files] for key in ("fp32", "m", "v")}

        def gather(t: torch.Tensor, g: int) -> list[torch.Tensor]:
            [key] = [k for k, p in parts.items() if torch.equal(t, p[rank])]
            return parts[key]

        return gather

    for rank in range(dp):
        tied = [
            [
                TiedEntry(
                    1,
                    "tied",
                    torch.Size(shapes["tied"]),
                    values["tied.fp32"].reshape(4, 3),
                    {"step": torch.tensor(9.0), "exp_avg": values["tied.m"], "exp_avg_sq": values["tied.v"]},
                )
            ]
        ]
        got = flat_state.to_1f1b(fdg_files[rank], [fdg], tied, rank, gather_from(fdg_files, fdg, rank))
        _same(got, want[rank])
        assert got[flat_state.BASE]["state"][0]["step"] == 7  # one step per group: the group's

        back = [[TiedEntry(1, "tied", torch.Size(shapes["tied"]))]]
        got = flat_state.from_1f1b(want[rank], [fdg], back, rank, gather_from(want, onef1b, rank))
        _same(got, fdg_files[rank])
        assert torch.equal(back[0][0].fp32, values["tied.fp32"].reshape(4, 3))
        assert torch.equal(back[0][0].state["exp_avg"], values["tied.m"].reshape(4, 3))
        assert torch.equal(back[0][0].state["exp_avg_sq"], values["tied.v"].reshape(4, 3))
        assert back[0][0].state["step"] == 7


def _padded_part(sd: dict[str, Any], layout: FlatGroup, key: str) -> torch.Tensor:
    if key == "fp32":
        return flat_state._padded(sd[flat_state.FP32][0], layout.partition)
    return sd[flat_state.BASE]["state"][0]["exp_avg" if key == "m" else "exp_avg_sq"]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for x, y in zip(a[flat_state.FP32], b[flat_state.FP32]):
        assert torch.equal(x, y)
    sa, sb = a[flat_state.BASE]["state"][0], b[flat_state.BASE]["state"][0]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for key in (flat_state.GROUP_PADDINGS, flat_state.SLICES, flat_state.PARAM_PADDINGS):
        assert a[key] == b[key], key


def test_state_of_another_shape_is_refused() -> None:
    layout = FlatGroup((4,), ("w",), 1)
    sd = _flat_sd(layout, {"w.fp32": torch.ones(4), "w.m": torch.ones(4), "w.v": torch.ones(4)}, 0, 1)
    sd[flat_state.BASE]["state"][0]["factored"] = torch.ones(3)
    with pytest.raises(ValueError, match="factored"):
        flat_state.to_1f1b(sd, [layout], [[]], 0, lambda t, g: [t])
