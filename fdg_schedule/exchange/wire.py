"""What travels between neighbouring stages: tensors in their wire form, the activation header, peer messages.

The header (Note [control words on the host] in :mod:`fdg_schedule.exchange.comm`) is :data:`HEADER_INTS` int64:
the activation's shapes and dtypes, then the two set-up ints of a transport's new link
(:meth:`~fdg_schedule.exchange.link.Transport.create`; 0, 0: none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError

HEADER_INTS = 256
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]  # fmt: skip
LINK_INTS = 2  # the header's last ints: a new link's set-up (Transport.create; 0, 0: none)

Meta = list[tuple[torch.Size, torch.dtype]]


def meta_of(tensors: Sequence[Tensor]) -> Meta:
    return [(t.shape, t.dtype) for t in tensors]


@dataclasses.dataclass
class PeerMessage:
    """What a tick sends to, and receives from, one more rank than the neighbours (tied gradients).

    ``recvs`` are filled in place by :meth:`NeighbourExchange.wait_peers`; ``words_out`` / ``words_in``
    are small int64 tensors in host memory (control words, Note [control words on the host]).
    """

    peer: int  # global rank
    stage: int  # its stage, for messages
    sends: list[Tensor]
    recvs: list[Tensor]
    words_out: list[Tensor] = dataclasses.field(default_factory=list)
    words_in: list[Tensor] = dataclasses.field(default_factory=list)


def loss_message(loss: Tensor | None) -> Tensor:
    assert loss is not None, "gradients travel with the loss they belong to"
    return loss.detach().float().reshape(-1)  # (loss,) or, under fp16, (loss, scale)


def wire(t: Tensor) -> Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


def unwire(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.view(torch.bool) if dtype == torch.bool else t


def encode(meta: Meta, token: int = 0, capacity: int = 0) -> Tensor:
    """The header: the activation's shapes and dtypes, then a new link's token and slot bytes (0, 0: none)."""
    ints = [len(meta)]
    for shape, dtype in meta:
        ints += [DTYPES.index(dtype), len(shape), *shape]
    if len(ints) > HEADER_INTS - LINK_INTS:
        raise FDGRuntimeError(f"activation header too long ({len(ints)} ints): send fewer or flatter tensors")
    return torch.tensor(ints + [0] * (HEADER_INTS - LINK_INTS - len(ints)) + [token, capacity], dtype=torch.int64)


def decode(ints: list[int]) -> tuple[Meta, int, int]:
    """The header's ints (read on the host) as :func:`encode` wrote them."""
    meta, i = [], 1
    for _ in range(ints[0]):
        dtype, ndim = DTYPES[ints[i]], ints[i + 1]
        meta.append((torch.Size(ints[i + 2 : i + 2 + ndim]), dtype))
        i += 2 + ndim
    return meta, ints[-2], ints[-1]
