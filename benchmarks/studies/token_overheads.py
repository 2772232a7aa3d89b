"""The token overheads the planner ships (fdg_schedule/plan/measured_overheads.py), derived from recorded curves.

    python -m benchmarks.studies.token_overheads          # prints the table
    python -m benchmarks.studies.token_overheads --write  # rewrites fdg_schedule/plan/measured_overheads.py

No training here: reads the GPT-2 validation curves of the staleness experiment log
(docs/results/staleness/staleness_gpt2_*.json, through benchmarks/studies/staleness_gpt2_gaps.py's reader) and the
time-to-loss test's run files (docs/results/time_to_loss/runs/), and measures r (fdg_schedule.plan.token_overhead,
docs/token-overhead.md) of each setting below against BP with the same seed. The staleness log's runs were capped
at the baseline's tokens (the cap is 1): where FDG ended above BP, r is "> 1", a lower bound. The time-to-loss
test's FDG runs are capped at 2x. tests/test_token_overhead_table.py checks that the shipped table equals what this
script computes. A new measurement enters the same way: its curves under docs/results/, a row in SETTINGS.

One row per key (family, optimizer, K, corrections, accumulate, BP's micro-batches per step); where the log
recorded a setting more than once, the row takes the longest runs, then the most seeds, and at K = 4 the split
docs/staleness.md recommends (0,1,2,4,8: the embedding alone on stage 0) where it was recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.common.lm_runs import parse_run
from benchmarks.studies.staleness_gpt2_gaps import FIVE, LONG_SOURCES, SEVEN, SOURCES, TEN, curves, seeded
from fdg_schedule.plan.token_overhead import Curve, Setting, load_curve, measure

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "fdg_schedule" / "plan" / "measured_overheads.py"
COMMAND = "python -m benchmarks.studies.token_overheads"
EVIDENCE = "docs/results/staleness/"
SHORT = (*SOURCES, "k3")  # the runs over 800 micro-batches (819,200 tokens); k3 holds ref_k3_b1.0 (seed 1234)
MODEL = "a small GPT-2 (6 blocks, width 128, vocabulary 4,096)"
DATA = "Shakespeare, micro-batches of 8 x 128 tokens (docs/results/convergence/lm_convergence.md)"
PROTOCOL = ("AdamW lr 1e-3 constant, no warm-up, for BP and FDG alike (not tuned per arm on a separate seed); "
            "FDG on fdg_reference, BP a DeepSpeed job (global clipping; FDG clips per stage)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured setting: the key, the runs (names without the seed suffix), the seeds, where the curves are.

    A staleness-log row names lm_convergence runs (``run``, ``seeds``, ``against``, ``long``). A new measurement
    gives ``curves`` instead: per seed (seed, BASELINE, DELAYED), each a ``PATH[:RUN]`` under docs/results/ that
    ``fdg_schedule.plan.token_overhead.load_curve`` reads, with its own ``model``, ``data`` and ``protocol``.
    """

    setting: Setting
    run: str  # the FDG run
    seeds: tuple[int, ...]
    against: str | None  # the BP run; None: the run's own protocol (parse_run(run).baseline)
    long: bool  # 1,400 micro-batches (1,433,600 tokens) rather than 800 (819,200)
    split: str
    weights: str
    notes: str = ""
    curves: tuple[tuple[int, str, str], ...] = ()  # (seed, baseline PATH[:RUN], delayed PATH[:RUN]); run unused
    model: str = ""  # default MODEL, DATA, PROTOCOL (the staleness log's)
    data: str = ""
    protocol: str = ""


K4_LONG_0124 = "ref_k4_b1.0_stashed_dlr2800_p0.0_first_r1_parts0-1-2-4-8"
AUTO = "auto"  # rule v1's keys for AdamW (docs/staleness.md#the-auto-rule)
AUTO_T = "delay_lr_ticks T = twice the run: what rule v1 sets when the scheduler states the run's length"

# The time-to-loss test (docs/results/time-to-loss-preregistration.md): a configuration enters once every report
# seed of it has landed, with the lr and warm-up each arm was frozen at on the tuning seed (in the run files' names)
TTL = "docs/results/time_to_loss/runs"
TTL_SEEDS = tuple(range(301, 307))
TTL_MODEL = "a LLaMA-style decoder (8 blocks, width 128, 4 heads, 2 KV heads, vocabulary 4,096)"
TTL_DATA = ("Perl 5.36's core documentation (held out), test split, micro-batches of 8 x 128 tokens "
            "(docs/results/time-to-loss-preregistration.md)")  # fmt: skip
TTL_PROTOCOL = ("lr and warm-up chosen per arm on seed 300 from one grid, WarmupCosineLR over each run's own steps; "
                "every run on fdg_reference; FDG capped at 2x the baseline's tokens with its schedule spanning the 2x "
                "run (r an upper bound on that of an FDG job scheduled to end at the crossing)")  # fmt: skip


def ttl_curves(config: str, baseline: str, delayed: str) -> tuple[tuple[int, str, str], ...]:
    """Per report seed, (seed, the baseline's run file, FDG's): ``baseline`` and ``delayed`` are run names without
    the seed, e.g. ``bp_a4_lr0.002_w0.1`` and ``fdg_k2_lr0.002_w0.1``."""
    return tuple((s, f"{TTL}/{config}/{baseline}_s{s}.json", f"{TTL}/{config}/{delayed}_s{s}.json") for s in TTL_SEEDS)


def ttl_row(setting: Setting, config: str, baseline: str, delayed: str, split: str) -> Row:
    """One configuration of the time-to-loss test against one of its baselines."""
    return Row(setting, delayed, TTL_SEEDS, baseline, False, split, "stashed",
               "corrections as rule v1 set them (the test's pinned rule)", ttl_curves(config, baseline, delayed),
               TTL_MODEL, TTL_DATA, TTL_PROTOCOL)  # fmt: skip


TTL_SETTINGS: tuple[Row, ...] = (
    ttl_row(Setting("llama", "adamw", 2, AUTO, 1, 4), "lm_adamw", "bp_a4_lr0.002_w0.1", "fdg_k2_lr0.002_w0.1",
            "blocks evenly (0,5,10)"),
    ttl_row(Setting("llama", "adamw", 2, AUTO, 1, 1), "lm_adamw", "bp_a1_lr0.002_w0.1", "fdg_k2_lr0.002_w0.1",
            "blocks evenly (0,5,10)"),
)  # fmt: skip

SETTINGS: tuple[Row, ...] = (
    Row(Setting("gpt", "adamw", 2, AUTO, 1, 1), "ref_k2_b1.0_stashed_p0.0_first_r1", TEN, None, False,
        "blocks evenly (0,4,8)", "stashed"),
    Row(Setting("gpt", "adamw", 3, AUTO, 1, 1), "ref_k3_b1.0_stashed_dlr1600_p0.0_first_r1", FIVE, None, False,
        "blocks evenly (0,3,5,8)", "stashed", AUTO_T),
    Row(Setting("gpt", "adamw", 4, AUTO, 1, 1), K4_LONG_0124, SEVEN, None, True, "0,1,2,4,8", "stashed", AUTO_T),
    Row(Setting("gpt", "adamw", 4, AUTO, 1, 4), K4_LONG_0124, FIVE, "bp_a4", True, "0,1,2,4,8", "stashed",
        AUTO_T + "; BP at 4 micro-batches per step with lr 2e-3 ended worse than at 1e-3 (seed 1234, 819,200 "
        "tokens, the experiment log)"),
    Row(Setting("gpt", "adamw", 4, "delay_lr_ticks+predict_decay", 4, 4),
        "ref_k4_b1.0_stashed_dlr2800_p0.0_first_parts0-1-2-3-8_a4", FIVE, None, True, "0,1,2,3,8", "stashed",
        "delay_lr_ticks T = twice the run, predict_decay 0, predict_horizon first_stage; no momentum raise, so not "
        "rule v1's keys"),
    Row(Setting("gpt", "adamw", 2, "none", 1, 1), "fdg_k2_b1.0", (1234, 1), None, False, "blocks evenly (0,4,8)",
        "current", "FDG on the DeepSpeed engine"),
    Row(Setting("gpt", "adamw", 3, "none", 1, 1), "ref_k3_b1.0", (1234, 1), None, False, "blocks evenly (0,3,5,8)",
        "current"),
    Row(Setting("gpt", "adamw", 4, "none", 1, 1), "ref_k4_b1.0", (1, 2), None, False, "blocks evenly (0,3,5,6,8)",
        "current"),
    *TTL_SETTINGS,
)  # fmt: skip


def derive(row: Row) -> dict[str, Any]:
    """The shipped entry of one row: r over its seeds, the band, and where the curves are."""
    pairs: list[tuple[Curve, Curve]]
    if row.curves:
        seeds = tuple(seed for seed, _, _ in row.curves)
        labels = [(b, d) for _, b, d in row.curves]
        pairs = [(load_curve(str(ROOT / b)), load_curve(str(ROOT / d))) for b, d in labels]
        files = sorted({spec.split(":")[0] for pair in labels for spec in pair})
        baseline, delayed = labels[0]
    else:
        seeds, pairs, labels = row.seeds, [], []
        found = curves(LONG_SOURCES if row.long else SHORT)
        for seed in row.seeds:
            run = seeded(row.run, seed)
            base = parse_run(run).baseline if row.against is None else seeded(row.against, seed)
            missing = [name for name in (run, base) if name not in found]
            if missing:
                raise SystemExit(f"token_overheads: {missing} not recorded in {EVIDENCE} (row {row.run})")
            pairs.append((found[base], found[run]))
            labels.append((base, run))
        files = sources([name for pair in labels for name in pair], LONG_SOURCES if row.long else SHORT)
        baseline, delayed = row.against or parse_run(row.run).baseline, row.run
    m = measure(pairs, labels, row.setting)
    final = m.final
    return {
        **dataclasses.asdict(row.setting),
        "r": _round(final.r),
        "r_at_least": _round(final.at_least),
        "upper_95": _round(final.upper),
        "interval_95": None if final.interval is None else [_round(x) for x in final.interval],
        "n": final.n,
        "reached": final.reached,
        "cap": _round(final.cap),
        "tokens": int(pairs[0][0][-1][0]),
        "seeds": [[seed, _round(o.r), _round(o.cap)] for seed, o in zip(seeds, final.seeds)],
        "band": [[f, _round(s.r), _round(s.at_least), _round(s.upper)] for f, s in m.band],
        "delayed": delayed,
        "baseline": baseline,
        "model": row.model or MODEL,
        "data": row.data or DATA,
        "protocol": row.protocol or PROTOCOL,
        "split": row.split,
        "weights": row.weights,
        "notes": row.notes,
        "evidence": files,
        "command": COMMAND,
    }


def sources(names: list[str], order: tuple[str, ...]) -> list[str]:
    """The evidence files the curves of ``names`` are read from (the first file in ``order`` holding each)."""
    files = set()
    for name in names:
        for source in order:
            path = ROOT / EVIDENCE / f"staleness_gpt2_{source}.json"
            if path.exists() and name in json.loads(path.read_text())["runs"]:
                files.add(f"{EVIDENCE}{path.name}")
                break
    return sorted(files)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def table() -> list[dict[str, Any]]:
    keys = [dataclasses.astuple(row.setting) for row in SETTINGS]
    if len(set(keys)) != len(keys):
        raise SystemExit(f"token_overheads: two rows share a key: {sorted(k for k in keys if keys.count(k) > 1)}")
    return [derive(row) for row in SETTINGS]


def module_text(entries: list[dict[str, Any]]) -> str:
    """The data module's source, laid out as ``ruff format`` lays it out (one key per line, long strings wrapped)."""
    lines = [
        '"""Token overheads measured in this repository (data only), written by',
        "``python -m benchmarks.studies.token_overheads --write``.",
        "",
        "Do not edit by hand: tests/test_token_overhead_table.py checks that this equals what the script computes from",
        "the recorded curves. Read it through :mod:`fdg_schedule.plan.overheads`.",
        '"""',
        "",
        "from typing import Any",
        "",
        "ENTRIES: list[dict[str, Any]] = [",
    ]
    for entry in entries:
        lines.append("    {")
        for key, value in entry.items():
            lines += _item(f"{json.dumps(key)}: ", value, 8)
        lines.append("    },")
    return "\n".join([*lines, "]", ""])


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _item(head: str, value: Any, indent: int) -> list[str]:
    """``head value,`` on one line if it fits in 120 columns, else the value's parts one per line."""
    pad = " " * indent
    one = f"{pad}{head}{_literal(value)},"
    if len(one) <= 120:
        return [one]
    if isinstance(value, str):
        parts = textwrap.wrap(value, 120 - indent - 6, drop_whitespace=False)
        return [f"{pad}{head}(", *(f"{pad}    {json.dumps(p)}" for p in parts), f"{pad}),"]
    out = [f"{pad}{head}["]
    for v in value:
        out += _item("", v, indent + 4)
    return [*out, f"{pad}],"]


def markdown(entries: list[dict[str, Any]]) -> str:
    """The table docs/token-overhead.md shows (tests/test_token_overhead_table.py checks that it does)."""
    lines = [
        "| family | optimizer | K | corrections | accumulate | BP's micro-batches per step | r | 95 % upper bound "
        "| n (reached) | cap | tokens | band: r at f = 0.5 / 0.7 / 0.9 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        r = _r(e["r"], e["r_at_least"])
        upper = f"{e['upper_95']:.3f}" if e["upper_95"] is not None else (r if e["r"] is None else "n/a")
        band = " / ".join(_r(b[1], b[2]) for b in e["band"] if b[0] in (0.5, 0.7, 0.9))
        lines.append(f"| {e['family']} | {e['optimizer']} | {e['stages']} | {e['corrections']} | {e['accumulate']} "
                     f"| {e['baseline_batch']} | {r} | {upper} | {e['n']} ({e['reached']}) | {e['cap']:g} "
                     f"| {e['tokens']:,} | {band} |")  # fmt: skip
    return "\n".join(lines)


def _r(r: float | None, at_least: float | None) -> str:
    return f"{r:.3f}" if r is not None else f"> {at_least:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {TABLE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    entries = table()
    print(markdown(entries))
    if args.write:
        TABLE.write_text(module_text(entries))
        print(f"wrote {TABLE}", file=sys.stderr)


if __name__ == "__main__":
    main()
