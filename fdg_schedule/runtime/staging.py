"""DeepSpeed's own pipeline point-to-point messages through host memory, where the process group moves only host memory.

gloo has no point-to-point transfer of accelerator tensors (torch.distributed's backend table: gloo
``send`` / ``recv`` on CPU only), yet DeepSpeed's ``PipelineEngine.__init__`` sends its CUDA
``self.loss`` to the next stage with ``p2p.send`` and ``eval_batch`` sends activations the same
way. Several ranks sharing one GPU run over gloo (NCCL refuses two ranks on one device), as the
device check does; the FDG exchange already stages its own messages through host memory there (the
STAGED path, Note [three ways to wait] in :mod:`fdg_schedule.exchange.comm`). :func:`install` makes
DeepSpeed's ``p2p.send`` / ``p2p.recv`` do the same for a tensor on the path STAGED, and pass every
other call through unchanged; it is installed when an FDG engine is built on that path only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fdg_schedule.base.tensors import HOST
from fdg_schedule.exchange.comm import Path, choose_path


def staged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` travels through host memory: gloo moves it, and it is not in host memory."""
    return choose_path(dist.get_backend(), tensor.device) is Path.STAGED


def install(device: torch.device | None = None, needs: Callable[[torch.Tensor], bool] = staged) -> bool:
    """Stage DeepSpeed's pipeline ``p2p.send`` / ``p2p.recv`` of the tensors ``needs`` picks through host memory
    when a stage on ``device`` (default: the accelerator's) takes the STAGED path; idempotent. Whether it did."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.pipe import p2p

    if getattr(p2p.send, "__fdg_staged__", False):
        return True
    device = torch.device(get_accelerator().device_name()) if device is None else device
    if choose_path(dist.get_backend(), device) is not Path.STAGED:
        return False
    p2p.send, p2p.recv = _staged_send(p2p.send, needs), _staged_recv(p2p.recv, needs)
    return True


def _staged_send(send: Callable[..., Any], needs: Callable[[torch.Tensor], bool]) -> Callable[..., Any]:
    def staged_send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
        return send(tensor.to(HOST) if needs(tensor) else tensor, dest_stage, async_op)

    staged_send.__fdg_staged__ = True  # type: ignore[attr-defined]
    return staged_send


def _staged_recv(recv: Callable[..., Any], needs: Callable[[torch.Tensor], bool]) -> Callable[..., Any]:
    def staged_recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> Any:
        if not needs(tensor):
            return recv(tensor, src_stage, async_op)
        host = torch.empty_like(tensor, device=HOST)
        result = recv(host, src_stage, async_op)  # DeepSpeed's recv is blocking (async_op=False is asserted)
        tensor.copy_(host)
        return result

    return staged_recv
