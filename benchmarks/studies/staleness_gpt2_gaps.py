"""GPT-2's best FDG settings against BP, seed by seed: the paired gap along the run, from the recorded evidence.

    python -m benchmarks.studies.staleness_gpt2_gaps  # writes docs/results/staleness/staleness_gpt2_gaps.png, the table

Reads the validation curves that benchmarks/convergence/lm_convergence.py recorded
(docs/results/staleness/staleness_gpt2_*.json, the evidence of the staleness experiment log; no training here)
and, for each setting below, divides every seed's validation loss by that of the BP run with the same seed and
protocol (``parse_run(name).baseline``: the same learning rate, micro-batches per step and schedule) at the same
token count. The picture draws each seed's relative gap thin and the mean over seeds bold; the table gives the
mean at each evaluation and the final gap per seed.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

from benchmarks.common.lm_runs import parse_run

DOCS = Path(__file__).resolve().parents[2] / "docs" / "results" / "staleness"  # the evidence of the experiment log
# Where each curve is read, first file first: a run recorded twice (a BP curve copied into a later
# section's file, rounded) is read from the file of the section that reported it first.
SOURCES = ("accumulate", "splits", "cosine", "stashed_predict", "first_stage", "protocols", "raise", "delay_lr")
K4 = "ref_k4_b1.0_stashed_dlr1600_p0.0_first_parts0-1-2-3-8"
K4_0124 = "ref_k4_b1.0_stashed_dlr1600_p0.0_first_parts0-1-2-4-8"
# the same with the delayed stages' momentum raised (pipeline.fdg.delay_momentum_raise 1)
K4_RAISED = "ref_k4_b1.0_stashed_dlr1600_p0.0_first_r1_parts0-1-2-3-8"
K4_0124_RAISED = "ref_k4_b1.0_stashed_dlr1600_p0.0_first_r1_parts0-1-2-4-8"
FIVE = (1234, 1, 2, 3, 4)
SEVEN = (1234, 1, 2, 3, 4, 5, 6)
TEN = (1234, 1, 2, 3, 4, 5, 6, 7, 8, 9)
# the best setting per K with the decoder blocks spread evenly (lm_convergence's default split, no _parts)
K2_EVEN = "ref_k2_b1.0_stashed_p0.0_first"
K3_EVEN = "ref_k3_b1.0_stashed_dlr1600_p0.0_first"
K4_EVEN = "ref_k4_b1.0_stashed_dlr1600_p0.0_first"
# (label, run name without its seed suffix, seeds, the BP run to pair with without its seed suffix:
# None for the run's own protocol)
Setting = tuple[str, str, tuple[int, ...], str | None]
SETTINGS: tuple[Setting, ...] = (
    (
        "K = 2, split 0,3,8, 1 micro-batch per step",
        f"{K2_EVEN}_parts0-3-8",
        FIVE,
        None,
    ),
    ("K = 4, split 0,1,2,3,8, 1 micro-batch per step", K4, SEVEN, None),
    ("K = 4, split 0,1,2,3,8, 1 per step, momentum raised (c = 1)", K4_RAISED, SEVEN, None),
    ("K = 4, split 0,1,2,4,8, 1 per step, momentum raised (c = 1)", K4_0124_RAISED, SEVEN, None),
    ("K = 2, split 0,5,8 (balanced), 1 per step", f"{K2_EVEN}_parts0-5-8", (1234, 1, 2), None),
    (
        "K = 2, split 0,5,8 (balanced), 1 per step, momentum raised (c = 1)",
        f"{K2_EVEN}_r1_parts0-5-8",
        FIVE,
        None,
    ),
    ("K = 4, split 0,1,2,3,8, 1 per step, warm-up + cosine", f"{K4}_cos", (1234, 1, 2), None),
    (
        "K = 4, split 0,1,2,3,8, 1 per step, warm-up + cosine, momentum raised (c = 1)",
        f"{K4_RAISED}_cos",
        (1234, 1, 2),
        None,
    ),
    (
        "K = 2, split 0,5,8 (balanced), 1 per step, momentum raised (c = 2)",
        f"{K2_EVEN}_r2_parts0-5-8",
        (1234, 1, 2),
        None,
    ),
    ("K = 2, blocks evenly (0,4,8), 1 per step", K2_EVEN, TEN, None),
    ("K = 2, blocks evenly (0,4,8), 1 per step, momentum raised (c = 1)", f"{K2_EVEN}_r1", TEN, None),
    ("K = 3, blocks evenly (0,3,5,8), 1 per step", K3_EVEN, FIVE, None),
    ("K = 3, blocks evenly (0,3,5,8), 1 per step, momentum raised (c = 1)", f"{K3_EVEN}_r1", FIVE, None),
    ("K = 3, split 0,4,6,8, 1 per step, momentum raised (c = 1)", f"{K3_EVEN}_r1_parts0-4-6-8", (1234, 1, 2), None),
    ("K = 4, blocks evenly (0,3,5,6,8), 1 per step", K4_EVEN, FIVE, None),
    (
        "K = 4, blocks evenly (0,3,5,6,8), 1 per step, momentum raised (c = 1)",
        f"{K4_EVEN}_r1",
        FIVE,
        None,
    ),
    ("K = 4, split 0,1,2,3,8, 4 micro-batches per step", f"{K4}_a4", SEVEN, None),
    ("K = 4, split 0,1,2,3,8, 4 per step, warm-up + cosine", f"{K4}_a4_cos", (1234, 1), None),
    ("K = 4, split 0,1,2,3,8, 1 per step, against BP at 4 per step", K4, SEVEN, "bp_a4"),
    ("K = 4, split 0,1,2,4,8, 1 per step, against BP at 4 per step", K4_0124, SEVEN, "bp_a4"),
    (
        "K = 4, split 0,1,2,3,8, 1 per step, momentum raised (c = 1), against BP at 4 per step",
        K4_RAISED,
        SEVEN,
        "bp_a4",
    ),
)
# The same K = 4 setting over 1,400 micro-batches (1,433,600 tokens, 0.98 epoch; delay_lr over twice the run)
K4_LONG = "ref_k4_b1.0_stashed_dlr2800_p0.0_first_parts0-1-2-3-8"
K4_LONG_RAISED = "ref_k4_b1.0_stashed_dlr2800_p0.0_first_r1_parts0-1-2-3-8"
K4_LONG_0124_RAISED = K4_LONG_RAISED.replace("parts0-1-2-3-8", "parts0-1-2-4-8")
# the files of the runs over 1,400 micro-batches
LONG_SOURCES = ("long", "raise_long", "split_long", "dlr_long", "seeds56_long")
LONG: tuple[Setting, ...] = (
    ("K = 4, split 0,1,2,3,8, 1 micro-batch per step", K4_LONG, FIVE, None),
    ("K = 4, split 0,1,2,3,8, 1 per step, momentum raised (c = 1)", K4_LONG_RAISED, FIVE, None),
    (
        "K = 4, split 0,1,2,3,8, 1 per step, momentum raised (c = 2)",
        K4_LONG_RAISED.replace("_r1_", "_r2_"),
        (1234, 1),
        None,
    ),
    (
        "K = 4, split 0,1,2,3,8, 1 per step, warm-up + cosine, momentum raised (c = 1)",
        f"{K4_LONG_RAISED}_cos",
        (1234, 1, 2),
        None,
    ),
    ("K = 4, split 0,1,2,4,8, 1 per step, momentum raised (c = 1)", K4_LONG_0124_RAISED, SEVEN, None),
    (
        "K = 4, split 0,1,2,4,8, 1 per step, momentum raised (c = 1), delay_lr over four times the run (T = 5600)",
        K4_LONG_0124_RAISED.replace("_dlr2800_", "_dlr5600_"),
        (1234, 1),
        None,
    ),
    (
        "K = 4, split 0,1,2,4,8, 1 per step, warm-up + cosine, momentum raised (c = 1)",
        f"{K4_LONG_0124_RAISED}_cos",
        SEVEN,
        None,
    ),
    ("K = 4, split 0,1,2,3,8, 1 per step, warm-up + cosine", f"{K4_LONG}_cos", (1234, 1, 2), None),
    (
        "K = 4, split 0,1,2,4,8, 1 per step, warm-up + cosine, momentum raised (c = 1), against BP at a constant rate",
        f"{K4_LONG_0124_RAISED}_cos",
        SEVEN,
        "bp",
    ),
    ("K = 4, split 0,1,2,3,8, 4 micro-batches per step", f"{K4_LONG}_a4", FIVE, None),
    ("K = 4, split 0,1,2,3,8, 1 per step, against BP at 4 per step", K4_LONG, FIVE, "bp_a4"),
    ("BP at 4 micro-batches per step, against BP at 1", "bp_a4", FIVE, "bp"),
)
Curve = list[tuple[int, float]]  # (tokens, value) at each evaluation


def curves(sources: tuple[str, ...] = SOURCES) -> dict[str, Curve]:
    found: dict[str, Curve] = {}
    for source in sources:
        path = DOCS / f"staleness_gpt2_{source}.json"
        if not path.exists():
            continue
        for name, run in json.loads(path.read_text())["runs"].items():
            found.setdefault(name, [(int(tokens), float(loss)) for tokens, loss in run["val"]])
    return found


def seeded(name: str, seed: int) -> str:
    return name if seed == 1234 else f"{name}_s{seed}"


def paired_gap(fdg: Curve, bp: Curve) -> Curve:
    """FDG's validation loss over BP's at each token count both evaluated, minus 1, in percent."""
    bp_at = dict(bp)
    return [(tokens, 100 * (loss / bp_at[tokens] - 1)) for tokens, loss in fdg if tokens in bp_at]


def setting_gaps(found: dict[str, Curve], name: str, seeds: tuple[int, ...], against: str | None = None) -> list[Curve]:
    """The paired gap curve of every seed of one setting whose run and BP run are both recorded."""
    gaps = []
    for seed in seeds:
        run = seeded(name, seed)
        baseline = parse_run(run).baseline if against is None else seeded(against, seed)
        if run not in found or baseline not in found:
            print(f"skipped {run}: not recorded in {DOCS} (or its BP run {baseline} is not)", file=sys.stderr)
            continue
        gaps.append(paired_gap(found[run], found[baseline]))
    return gaps


def mean_curve(gaps: list[Curve]) -> Curve:
    """The mean over seeds at each token count every seed evaluated (matched by tokens, not by position)."""
    by_tokens = [dict(gap) for gap in gaps]
    return [
        (tokens, sum(g[tokens] for g in by_tokens) / len(gaps))
        for tokens, _ in gaps[0]
        if all(tokens in g for g in by_tokens)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--long", action="store_true", help="the runs over 1,400 micro-batches (staleness_gpt2_long.json, _raise_long)"
    )
    parser.add_argument("--picture", type=Path, default=None, help=f"default {DOCS}/staleness_gpt2_gaps[_long].png")
    args = parser.parse_args()
    settings, sources, budget = (
        (LONG, LONG_SOURCES, "1,433,600 tokens") if args.long else (SETTINGS, SOURCES, "819,200 tokens")
    )
    picture = args.picture or DOCS / f"staleness_gpt2_gaps{'_long' if args.long else ''}.png"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = curves(sources)
    # left: each run against BP of its own protocol; right: against another BP (the `against` settings)
    fig, (same, other) = plt.subplots(1, 2, figsize=(15, 5 + 0.17 * len(settings)), sharey=True)  # room for the legend
    lines = [
        "| setting | seeds | mean gap at each evaluation, every 102,400 tokens (%) | final gap per seed (%) | mean |",
        "|---|---:|---|---|---:|",
    ]
    # the default 10 colours, solid, then dashed: every setting is drawn, however many there are
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = itertools.cycle([(color, dash) for dash in ("-", "--", ":") for color in palette])
    for (label, name, seeds, against), (color, dash) in zip(settings, styles):
        gaps = setting_gaps(found, name, seeds, against)
        if not gaps:
            continue
        ax = same if against is None else other
        for gap in gaps:
            ax.plot(*zip(*gap, strict=True), color=color, alpha=0.25, linewidth=0.8)
        mean = mean_curve(gaps)
        ax.plot(
            *zip(*mean, strict=True),
            color=color,
            linestyle=dash,
            marker="o",
            linewidth=2,
            label=f"{label} ({len(gaps)} seeds)",
        )
        along = " / ".join(f"{value:+.2f}" for _, value in mean)
        finals = ", ".join(f"{g[-1][1]:+.2f}" for g in gaps)
        lines.append(f"| {label} | {len(gaps)} | {along} | {finals} | **{mean[-1][1]:+.2f}** |")
    titles = ("against BP of the same protocol", "against BP of another protocol")
    for ax, title in zip((same, other), titles, strict=True):
        for target, text in ((1, "K = 2 target (1 %)"), (2, "K = 4 target (2 %)")):
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
            ax.text(0.005, target, text, transform=ax.get_yaxis_transform(), fontsize=8, color="grey", va="bottom")
        ax.set(xlabel="tokens", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.12))  # below the axes: many settings
    same.set_ylabel("validation loss over the paired BP run's, same seed (%)")
    fig.suptitle(f"GPT-2 (AdamW), {budget}: FDG against BP, per seed (thin) and mean (bold)")
    fig.tight_layout()
    fig.savefig(picture, dpi=110, bbox_inches="tight")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
