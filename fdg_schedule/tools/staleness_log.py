"""Every stage's staleness metric, summarised for a recipe's log: one line per epoch on global rank 0.

The engine keeps each stage's latest measurement of ``pipeline.fdg.staleness_every`` in
``engine.fdg_stats["staleness"]`` (with ``"staleness_tick"``, the tick of the backward it was measured
at). A recipe makes one :class:`StalenessLog` per FDG engine, calls :meth:`collect` after every
``train_batch()`` and ``drain()``, and :meth:`line` at the end of an epoch on every rank (a gather)::

    staleness: stage 0 4.520e-03 (8), stage 1 2.113e-03 (8)

the median, per delayed stage, of the measurements collected since the previous line (how many in
brackets). The last stage has no delay and is left out. ``benchmarks/convergence/resnet_reference.py`` prints the
same line from ``fdg_reference``'s weights, and tests/test_recipe_resnet.py checks that the two agree.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

import torch.distributed as dist


class StalenessLog:
    """The measurements one stage's engine reported, between two :meth:`line` calls."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.values: list[float] = []
        self._tick = math.nan  # the tick of the last measurement collected

    def collect(self) -> None:
        """Keep the measurement the last ``train_batch()`` / ``drain()`` reported, if it is new.

        The engine reports at most one per call: with ``staleness_every`` below the ticks of one call
        the others are not seen here (they are in W&B and the trace alike).
        """
        tick = self.engine.fdg_stats.get("staleness_tick", math.nan)
        if not math.isnan(tick) and tick != self._tick:
            self.values.append(float(self.engine.fdg_stats["staleness"]))
            self._tick = tick

    def line(self) -> str | None:
        """Every rank calls it (a gather to global rank 0). Global rank 0 gets the line, or None when no
        delayed stage measured anything since the last call; other ranks get None."""
        median = statistics.median(self.values) if self.values and not self.engine.is_last_stage() else None
        mine = (self.engine.stage_id, median, len(self.values))
        self.values = []
        if dist.get_rank() != 0:
            dist.gather_object(mine, None, dst=0)
            return None
        rows: list[Any] = [None] * dist.get_world_size()
        dist.gather_object(mine, rows, dst=0)
        per_stage: dict[int, tuple[float, int]] = {}
        for stage, median, count in rows:  # data-parallel replicas of a stage measure the same weights
            if median is not None:
                per_stage.setdefault(stage, (median, count))
        return format_line(per_stage)


def format_line(per_stage: dict[int, tuple[float, int]]) -> str | None:
    """``staleness: stage 0 2.262e-02 (8), ...`` from ``{stage: (median, count)}``; None when empty."""
    if not per_stage:
        return None
    cells = [f"stage {stage} {median:.3e} ({count})" for stage, (median, count) in sorted(per_stage.items())]
    return "staleness: " + ", ".join(cells)


def per_epoch(output: str) -> list[dict[int, float] | None]:
    """A recipe's log read back: for each ``epoch N/M:`` line, ``{stage: median}`` of the staleness line
    that follows it (None for an epoch without one); ``[]`` when the log has no staleness line at all.
    DeepSpeed's ``[rankN]:`` prefixes are ignored."""
    epochs: list[dict[int, float] | None] = []
    found = False
    for line in re.sub(r"^\[rank\d+\]:", "", output, flags=re.M).splitlines():
        if re.match(r"epoch \d+/\d+: ", line):
            epochs.append(None)
        elif line.startswith("staleness: ") and epochs:
            cells = re.findall(r"stage (\d+) (\S+) \(\d+\)", line)
            epochs[-1] = {int(stage): float(value) for stage, value in cells}
            found = True
    return epochs if found else []
