"""FDG on PyTorch's own pipelining (``torch.distributed.pipelining``): a schedule for a PipelineStage, and checkpoints.

    from fdg_schedule.torch_pipelining import ScheduleFDG
    schedule = ScheduleFDG(stage, n_microbatches, loss_fn=loss_fn, optimizer=optimizer, grad_shrink=0.5)
    schedule.step(x, target=y, losses=losses)      # instead of Schedule1F1B(...).step(...) + optimizer.step()

Public names: :class:`ScheduleFDG`, :func:`save_checkpoint`, :func:`load_checkpoint`. The guide is
docs/torch-pipelining.md.
"""

from __future__ import annotations

from fdg_schedule.torch_pipelining.checkpoint import load_checkpoint, save_checkpoint
from fdg_schedule.torch_pipelining.schedule import ScheduleFDG

__all__ = ["ScheduleFDG", "load_checkpoint", "save_checkpoint"]
