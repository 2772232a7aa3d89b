"""The tied copies in a flat (ZeRO-1 / bf16) optimizer file: FDG's layout to 1F1B's and back.

Note [tied copies in flat optimizer files]
    DeepSpeed's bf16 wrapper and its ZeRO-1 optimizer keep one flat fp32 buffer per param group --
    the group's parameters end to end (ZeRO: with ``parameter_alignment`` padding after each but
    the last), zero-padded to a multiple of 2 x the data-parallel size and cut into equal partitions,
    one per data-parallel rank -- and the base optimizer steps each rank's partition as one tensor.
    Each rank's file holds its partition of the fp32 weights and of every optimizer-state tensor
    (Adam's moments) plus the layout (paddings, each parameter's slice of the partition).

    1F1B's buffers hold the tied copies at their slots; FDG's leave them out (the tied optimizer
    steps them, Note [tied layers across stages]). So that one checkpoint serves both schedules,
    an FDG stage writes 1F1B's layout: it gathers each of its buffers over the data-parallel group,
    cuts it into parameters, puts each copy's fp32 master and tied-optimizer state in at its slot,
    lays the buffer out again as 1F1B's and keeps its own rank's partition. A load runs the other
    way: every rank's 1F1B partitions, gathered, give each copy's fp32 weight and state (to its tied
    optimizer) and FDG's buffers without them. Both ways are collectives of the stage's
    data-parallel group; every rank saves and loads together anyway. Values are only moved, never computed: the
    translation is exact.

    The flat optimizer holds one ``step`` per group, the per-parameter optimizer one per parameter.
    A tied copy steps on its own clock (Note [tied layers across stages], 4), so in 1F1B's file it
    takes its group's step; a 1F1B load gives the tied optimizer that step (what 1F1B had), and an
    FDG resume gets the tied optimizer's own state back from FDG's per-stage file, exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

# DeepSpeed's state-dict keys (deepspeed.checkpoint.constants), read and rewritten here.
BASE = "base_optimizer_state"
FP32 = "single_partition_of_fp32_groups"
GROUP_PADDINGS = "group_paddings"
PARAM_PADDINGS = "param_alignment_paddings"
SLICES = "param_slice_mappings"


@dataclasses.dataclass(frozen=True)
class FlatGroup:
    """The layout of one param group's flat buffer: its parameters' sizes and names, in order."""

    numels: tuple[int, ...]
    names: tuple[str, ...]
    dp: int  # data-parallel size: the number of partitions
    param_alignment: int = 1  # ZeRO's ``parameter_alignment`` (1: none)
    lean_fp32: bool = True  # ZeRO saves each partition's fp32 weights without padding; bf16 with it

    @property
    def paddings(self) -> tuple[int, ...]:
        """Zeros after each parameter (none after the last), as ZeRO-1 lays them out."""
        out, offset = [], 0
        for i, n in enumerate(self.numels):
            offset += n
            pad = 0 if i == len(self.numels) - 1 else (-offset) % self.param_alignment
            out.append(pad)
            offset += pad
        return tuple(out)

    @property
    def offsets(self) -> tuple[int, ...]:
        starts, offset = [], 0
        for n, pad in zip(self.numels, self.paddings):
            starts.append(offset)
            offset += n + pad
        return tuple(starts)

    @property
    def lean(self) -> int:
        return sum(self.numels) + sum(self.paddings)

    @property
    def partition(self) -> int:
        alignment = 2 * self.dp  # nccl_start_alignment_factor x data-parallel size
        return math.ceil(self.lean / alignment) * alignment // self.dp

    def group_padding(self, rank: int) -> int:
        """The zeros in ``rank``'s partition (``group_paddings`` / ``groups_padding``)."""
        if self.lean_fp32:  # ZeRO: any rank whose partition reaches past the parameters
            return max(0, min(self.partition, (rank + 1) * self.partition - self.lean))
        return self.partition * self.dp - sum(self.numels) if rank == self.dp - 1 else 0  # bf16: the last rank

    def pieces(self, full: Tensor) -> list[Tensor]:
        """The parameters' slices of a gathered buffer."""
        return [full[o : o + n] for o, n in zip(self.offsets, self.numels)]

    def join(self, pieces: Sequence[Tensor]) -> Tensor:
        """The whole buffer from the parameters' slices, padded."""
        full = torch.zeros(self.partition * self.dp, dtype=pieces[0].dtype, device=pieces[0].device)
        for piece, o, n in zip(pieces, self.offsets, self.numels):
            full[o : o + n].copy_(piece.reshape(-1))
        return full

    def part(self, full: Tensor, rank: int) -> Tensor:
        return full[rank * self.partition : (rank + 1) * self.partition].clone()

    def slices(self, rank: int) -> OrderedDict[str, Any]:
        """Each parameter's fragment of ``rank``'s partition (``param_slice_mappings``), as DeepSpeed maps it."""
        from deepspeed.utils.tensor_fragment import fragment_address

        lo, hi = rank * self.partition, (rank + 1) * self.partition
        out: OrderedDict[str, Any] = OrderedDict()
        for name, o, n in zip(self.names, self.offsets, self.numels):
            start, end = max(o, lo), min(o + n, hi)
            if start < end:
                out[name] = fragment_address(numel=end - start, start=start - lo)
        return out

    def with_inserted(self, index: int, numel: int, name: str) -> FlatGroup:
        return dataclasses.replace(
            self,
            numels=self.numels[:index] + (numel,) + self.numels[index:],
            names=self.names[:index] + (name,) + self.names[index:],
        )


@dataclasses.dataclass
class TiedEntry:
    """One tied copy's part of a flat group: where it goes and its values (fp32 weight, optimizer state)."""

    index: int  # its position among the 1F1B group's trainable parameters
    name: str
    shape: torch.Size
    fp32: Tensor | None = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)


def _partition_keys(state: dict[str, Any], partition: int) -> list[str]:
    """The state entries stored per element of the partition (Adam's moments; not ``step``)."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == partition]


def _padded(t: Tensor, size: int) -> Tensor:
    return t if t.numel() == size else torch.cat([t.reshape(-1), t.new_zeros(size - t.numel())])


def _check_state(state: dict[str, Any], keys: list[str], partition: int, where: str) -> None:
    other = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and k not in keys]
    if other:
        raise ValueError(
            f"{where}: optimizer state {other} is neither per element of the flat partition ({partition}) nor a "
            "scalar; FDG cannot move tied copies in or out of it"
        )


def _check_rigid(sd: dict[str, Any]) -> None:
    if not isinstance(sd.get(BASE), dict) or "state" not in sd[BASE]:
        raise ValueError(
            "the flat optimizer state is not a torch optimizer state_dict (zero_optimization.elastic_checkpoint?); "
            "FDG moves tied copies in and out of the default (rigid) layout only"
        )


def _with_tied(layout: FlatGroup, entries: Sequence[TiedEntry]) -> FlatGroup:
    """1F1B's layout of a group: FDG's with the tied copies inserted at their indices (ascending)."""
    for entry in entries:
        layout = layout.with_inserted(entry.index, math.prod(entry.shape), entry.name)
    return layout


def _with_layout(out: dict[str, Any], sd: dict[str, Any], layouts: Sequence[FlatGroup], rank: int) -> None:
    """``out``'s layout fields (paddings, parameter slices) as DeepSpeed writes them for ``layouts``."""
    out[GROUP_PADDINGS] = [layout.group_padding(rank) for layout in layouts]
    out[SLICES] = [layout.slices(rank) for layout in layouts]
    if PARAM_PADDINGS in sd:
        out[PARAM_PADDINGS] = [list(layout.paddings) for layout in layouts]


def to_1f1b(
    sd: dict[str, Any],
    groups: Sequence[FlatGroup],
    tied: Sequence[Sequence[TiedEntry]],
    rank: int,
    gather: Callable[[Tensor, int], list[Tensor]],
) -> dict[str, Any]:
    """FDG's flat state dict of ``rank`` (its wrapper's ``state_dict()``) in 1F1B's layout.

    ``groups``: FDG's layout per group; ``tied[g]``: the copies of group g with their fp32 weights and
    state, ascending by index; ``gather(t, g)``: the partitions of every rank of group g's
    data-parallel group, in rank order (a collective).
    """
    _check_rigid(sd)
    out = dict(sd)
    base = dict(sd[BASE])
    states = {k: dict(v) for k, v in base["state"].items()}
    fp32_out = []
    wides = [_with_tied(layout, entries) for layout, entries in zip(groups, tied)]
    for g, (layout, wide) in enumerate(zip(groups, wides)):

        def move(partition: Tensor, tied_values: list[Tensor], layout: FlatGroup = layout, wide: FlatGroup = wide,
                 g: int = g) -> Tensor:  # fmt: skip
            full = torch.cat(gather(_padded(partition, layout.partition), g))
            pieces = layout.pieces(full)
            for entry, value in zip(tied[g], tied_values):
                pieces.insert(entry.index, value.reshape(-1).to(full.dtype))
            return wide.part(wide.join(pieces), rank)

        fp32 = move(sd[FP32][g], [e.fp32 for e in tied[g]])  # type: ignore[misc]
        fp32_out.append(fp32[: wide.partition - wide.group_padding(rank)] if layout.lean_fp32 else fp32)
        if g not in states:  # no step yet: 1F1B's group starts fresh too (FDG's file keeps the tied state)
            continue
        state = states[g]
        keys = _partition_keys(state, layout.partition)
        _check_state(state, keys, layout.partition, f"param group {g}")
        for key in keys:
            state[key] = move(state[key], [e.state[key] for e in tied[g]])
    base["state"] = states
    out[BASE], out[FP32] = base, fp32_out
    _with_layout(out, sd, wides, rank)
    return out


def from_1f1b(
    sd: dict[str, Any],
    groups: Sequence[FlatGroup],
    tied: Sequence[Sequence[TiedEntry]],
    rank: int,
    gather: Callable[[Tensor, int], list[Tensor]],
) -> dict[str, Any]:
    """1F1B's flat state dict of ``rank`` (DeepSpeed loads each rank's own) in FDG's layout.

    Fills each ``TiedEntry`` of ``tied`` (indices, names and shapes given) with the copy's fp32 weight and
    state (the group's ``step`` and other scalars included). ``gather`` as for :func:`to_1f1b`.
    """
    _check_rigid(sd)
    out = dict(sd)
    base = dict(sd[BASE])
    states = {k: dict(v) for k, v in base["state"].items()}
    fp32_out = []
    for g, layout in enumerate(groups):
        wide = _with_tied(layout, tied[g])

        def move(partition: Tensor, layout: FlatGroup = layout, wide: FlatGroup = wide,
                 g: int = g) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
            full = torch.cat(gather(_padded(partition, wide.partition), g))
            pieces = wide.pieces(full)
            taken = [pieces.pop(entry.index) for entry in reversed(tied[g])][::-1]
            return layout.part(layout.join(pieces), rank), taken

        fp32, taken = move(sd[FP32][g])
        fp32_out.append(fp32[: layout.partition - layout.group_padding(rank)] if layout.lean_fp32 else fp32)
        for entry, value in zip(tied[g], taken):
            entry.fp32 = value.reshape(entry.shape).clone()
        if g not in states:  # saved before the group's first step: the tied state starts fresh as well
            continue
        state = states[g]
        keys = _partition_keys(state, wide.partition)
        _check_state(state, keys, wide.partition, f"param group {g} of the checkpoint")
        for entry in tied[g]:
            entry.state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items() if k not in keys}
        for key in keys:
            state[key], taken = move(state[key])
            for entry, value in zip(tied[g], taken):
                entry.state[key] = value.reshape(entry.shape).clone()
    base["state"] = states
    out[BASE], out[FP32] = base, fp32_out
    _with_layout(out, sd, groups, rank)
    return out
