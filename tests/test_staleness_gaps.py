"""benchmarks/studies/staleness_gpt2_gaps.py: the GPT-2 headline gaps of the staleness experiment log follow from its
curves.

The log and the curves: docs/results/staleness/ (experiment-log.md, staleness_gpt2_*.json).
"""

from __future__ import annotations

import pytest

from benchmarks.studies.staleness_gpt2_gaps import (
    FIVE,
    K2_EVEN,
    K3_EVEN,
    K4,
    K4_0124,
    K4_0124_RAISED,
    K4_EVEN,
    K4_LONG,
    K4_LONG_0124_RAISED,
    K4_LONG_RAISED,
    K4_RAISED,
    LONG_SOURCES,
    SEVEN,
    TEN,
    curves,
    mean_curve,
    paired_gap,
    setting_gaps,
)


def test_paired_gap_divides_at_equal_tokens() -> None:
    fdg = [(100, 5.5), (200, 5.1), (300, 5.0)]
    bp = [(100, 5.0), (300, 4.0)]  # no evaluation at 200: that point is left out, not misaligned
    assert paired_gap(fdg, bp) == [(100, pytest.approx(10.0)), (300, pytest.approx(25.0))]
    assert mean_curve([[(1, 1.0), (2, 3.0)], [(1, 3.0), (2, 5.0)]]) == [(1, 2.0), (2, 4.0)]


@pytest.mark.parametrize(
    ("name", "seeds", "against", "final_mean"),
    [
        (f"{K2_EVEN}_parts0-3-8", FIVE, None, 0.22),  # K = 2 target: met
        (K4, SEVEN, None, 3.72),  # K = 4 at one micro-batch per step: not met
        (K4_RAISED, SEVEN, None, 1.87),  # the same with the momentum raised: met
        (K4_0124_RAISED, SEVEN, None, 1.33),  # and with the faster split 0,1,2,4,8
        (f"{K2_EVEN}_r1_parts0-5-8", FIVE, None, 1.21),  # K = 2, fast split: not met
        (f"{K4}_a4", SEVEN, None, 1.13),  # K = 4 at a pipeline job's batch (BP _a4)
        (f"{K4}_cos", (1234, 1, 2), None, 2.72),  # warm-up + cosine, both: not met
        # one micro-batch per step against the 1F1B job's batch, with the split 0,1,2,3,8 and the faster 0,1,2,4,8
        (K4, SEVEN, "bp_a4", 0.27),
        (K4_0124, SEVEN, "bp_a4", 0.12),
        (K4_RAISED, SEVEN, "bp_a4", -1.52),  # the same with the momentum raised
        (f"{K4_RAISED}_cos", (1234, 1, 2), None, 1.97),  # raised, under warm-up + cosine
        (f"{K2_EVEN}_r1", TEN, None, 0.73),  # K = 2, the blocks spread evenly, raised: met on the mean
        (K2_EVEN, TEN, None, 1.11),  # the same without the raise
        (K3_EVEN, FIVE, None, 4.92),  # K = 3, the blocks spread evenly
        (f"{K3_EVEN}_r1", FIVE, None, 1.65),  # the same with the momentum raised
        (f"{K3_EVEN}_r1_parts0-4-6-8", (1234, 1, 2), None, 3.15),  # K = 3 at K = 4's speed (2.33 x), raised
        (f"{K4_EVEN}_r1", FIVE, None, 3.73),  # K = 4, the blocks spread evenly, raised: not met
    ],
)
def test_the_targets_table_follows_from_the_recorded_curves(
    name: str, seeds: tuple[int, ...], against: str | None, final_mean: float
) -> None:
    gaps = setting_gaps(curves(), name, seeds, against)
    assert len(gaps) == len(seeds)  # every seed and its own BP run are recorded
    assert mean_curve(gaps)[-1] == (819_200, pytest.approx(final_mean, abs=0.005))


@pytest.mark.parametrize(
    ("name", "seeds", "against", "final_mean"),
    [
        (K4_LONG, FIVE, None, 3.30),
        (f"{K4_LONG}_a4", FIVE, None, 0.80),
        (K4_LONG, FIVE, "bp_a4", -0.47),
        (K4_LONG_RAISED, FIVE, None, 2.69),
        (f"{K4_LONG_RAISED}_cos", (1234, 1, 2), None, 2.23),  # under warm-up + cosine, against BP under it
        (K4_LONG_0124_RAISED, FIVE, None, 2.24),  # the faster split 0,1,2,4,8, raised: not met over an epoch
        (K4_LONG_0124_RAISED, SEVEN, None, 2.01),  # ... with seeds 5 and 6: at the target's edge, not within it
        (K4_LONG_0124_RAISED.replace("_dlr2800_", "_dlr5600_"), (1234, 1), None, 1.76),  # T four times the run
        (K4_LONG_0124_RAISED, (1234, 1), None, 1.81),  # ... and the same two seeds at T = 2800: no gain
        (f"{K4_LONG}_cos", (1234, 1, 2), None, 2.76),  # warm-up + cosine without the raise
        (f"{K4_LONG_0124_RAISED}_cos", SEVEN, None, 1.74),  # 0,1,2,4,8 raised under cosine: within 2 % of BP under it
        (f"{K4_LONG_0124_RAISED}_cos", FIVE, "bp", 2.59),  # ... not of BP at a constant rate
        (f"{K4_LONG_0124_RAISED}_cos", SEVEN, "bp", 2.46),
    ],
)
def test_the_whole_epoch_rows_follow_from_the_recorded_curves(
    name: str, seeds: tuple[int, ...], against: str | None, final_mean: float
) -> None:
    gaps = setting_gaps(curves(LONG_SOURCES), name, seeds, against)
    assert len(gaps) == len(seeds)
    assert mean_curve(gaps)[-1] == (1_433_600, pytest.approx(final_mean, abs=0.005))
