"""The FDG tick arithmetic: which micro-batch each stage forwards and back-propagates at each tick.

Every stage runs one tick at a time; a tick moves every micro-batch in flight one stage on.
Stage ``k`` of ``K`` forwards micro-batch ``b`` at tick ``b + k`` and back-propagates it at tick
``b + 2(K-1) - k``: its ``delay`` is ``2(K-1-k)`` ticks. The last stage has delay 0 (forward, loss
and backward in one tick). Inside a tick a non-last stage first runs its delayed backward and
optimizer step, then the forward of the newest micro-batch, so forwards see the freshest weights.

K = 3, 8 micro-batches then a drain (``Fb`` forward of micro-batch b, ``Bb`` backward, ``.`` idle):

    tick      0    1    2      3      4      5      6      7      8     9     10   11
    stage 0   F0   F1   F2     F3     B0F4   B1F5   B2F6   B3F7   B4    B5    B6   B7
    stage 1   .    F0   F1     B0F2   B1F3   B2F4   B3F5   B4F6   B5F7  B6    B7   .
    stage 2   .    .    F0B0   F1B1   F2B2   F3B3   F4B4   F5B5   F6B6  F7B7  .    .
                                                            drain starts at tick 8 ^

Micro-batch numbers here count from the start of a *segment*: the pipeline fills once at the start
of a segment and a segment ends only with a drain (``limit`` = micro-batches that entered it).
A stage holds ``delay`` micro-batches between ticks, so it needs ``delay + 1`` buffers
(``buffer_id = micro_batch % (delay + 1)``): the slot a backward frees is never the one the
forward of the same tick writes.
"""

from __future__ import annotations


def delay(stages: int, stage_id: int) -> int:
    """Ticks between a stage's forward of a micro-batch and its backward of it."""
    return 2 * (stages - 1 - stage_id)


def prediction_ticks(stages: int, stage_id: int, horizon: str = "own") -> int:
    """Ticks ahead a stage's weight prediction aims, from its forward of a micro-batch: to its own update
    with that micro-batch's gradient (``"own"``, its delay, 0 on the last stage), or to the tick stage 0
    applies that gradient (``"first_stage"``, ``2(K-1) - k``), so every stage of the micro-batch's
    forward sits at one time."""
    return delay(stages, stage_id) if horizon == "own" else 2 * (stages - 1) - stage_id


def num_buffers(stages: int, stage_id: int) -> int:
    """Pipeline buffers a stage needs: the micro-batches in flight plus the one entering."""
    return delay(stages, stage_id) + 1


def drain_ticks(stages: int) -> int:
    """Ticks from the last micro-batch entering stage 0 until stage 0 has back-propagated it."""
    return 2 * (stages - 1)


def last_tick(limit: int, stages: int) -> int:
    """The segment tick at which stage 0 back-propagates the last of a segment's ``limit`` micro-batches."""
    return limit - 1 + drain_ticks(stages)


def _valid(micro_batch: int, limit: int | None) -> int | None:
    if micro_batch < 0 or (limit is not None and micro_batch >= limit):
        return None
    return micro_batch


def forward_micro_batch(tick: int, stage_id: int, limit: int | None = None) -> int | None:
    """The micro-batch ``stage_id`` forwards at segment tick ``tick``, or None."""
    return _valid(tick - stage_id, limit)


def backward_micro_batch(tick: int, stages: int, stage_id: int, limit: int | None = None) -> int | None:
    """The micro-batch ``stage_id`` back-propagates at segment tick ``tick``, or None."""
    return _valid(tick - stage_id - delay(stages, stage_id), limit)


def steps_after_backward(micro_batch: int, accumulate: int, last_micro_batch: int | None = None) -> bool:
    """True if the optimizer steps right after the backward of ``micro_batch``.

    A stage steps after every ``accumulate`` backward passes; a drain (``last_micro_batch`` set)
    also steps after the final backward so no accumulated gradient is left behind.
    """
    return (micro_batch + 1) % accumulate == 0 or micro_batch == last_micro_batch


def scheduler_steps_after(ticks_run: int, accumulate: int) -> bool:
    """True if the LR scheduler steps at the end of the tick that brings the run to ``ticks_run`` ticks.

    Note [learning rate per optimizer step]: DeepSpeed steps an LR scheduler once per optimizer step,
    and ``WarmupLR``'s warm-up or ``OneCycle``'s budget are counted in optimizer steps. Under FDG a
    stage steps its optimizer once every ``accumulate`` backward passes, i.e. once every
    ``accumulate`` ticks in steady state, so the scheduler steps once every ``accumulate`` ticks,
    counted over the whole run (fill and drain ticks included, the same on every stage, so every
    stage has the same learning rate at the same tick). With ``accumulate`` = 1 that is every tick.
    """
    return ticks_run % accumulate == 0
