"""The iso-loss token overhead r: the tokens a delayed run needs to first reach the synchronous run's final loss.

    python -m fdg_schedule.plan.token_overhead BP.json FDG.json [BP_2.json FDG_2.json ...] \
        [--throughput-ratio 1.15] [--json overhead.json]
    python -m fdg_schedule.plan.token_overhead runs/1f1b runs/fdg --by train_s   # time to loss, from metrics.jsonl
    python -m fdg_schedule.plan.token_overhead bp.jsonl fdg.jsonl --by samples   # recipes/train_resnet.py --metrics

Definitions (docs/token-overhead.md states them in full):

- **tokens_to_reach(curve, target)**: the validation curve is the list of (tokens, loss) evaluations, linear
  between consecutive evaluations. The first point where it reaches ``target`` (loss <= target): an evaluation's
  own tokens when the loss there is at or below it (the first evaluation included: nothing is known before it),
  else the interpolated crossing between the last evaluation above and the first at or below. Later dips and
  rises do not count: the first crossing does. None when no evaluation reaches it.
- **r** = tokens_to_reach(delayed, the baseline's final loss) / the baseline's final tokens. The delayed run's
  **cap** is its last evaluated tokens / the baseline's final tokens; a delayed run that never reaches the loss
  has r "> cap" (r is larger than the cap, by how much is not measured).
- **The band**: for f in ``FRACTIONS`` the target is the baseline's loss at f x its tokens (interpolated), and
  r(f) = tokens_to_reach(delayed, that loss) / (f x the baseline's tokens); r(1) is r. It shows whether the
  overhead grows or shrinks along the run.
- **Over seeds** (each seed a baseline and a delayed run with the same seed): the mean m and standard deviation s
  of log r, n seeds; r = exp(m) (the geometric mean), its one-sided 95 % upper bound exp(m + t(0.95, n-1) s /
  sqrt n) and the two-sided 95 % interval exp(m -+ t(0.975, n-1) s / sqrt n), t from Student's t distribution.
  A seed that does not reach the target is never dropped: it enters at log cap, a lower bound on its log r, so
  the mean so computed bounds the mean from below. The result is then "r > exp(m)", and the upper bound is
  "> exp(m)" too: nothing bounds r from above.
- **Net speed-up** = throughput ratio / r (the delayed schedule's samples/s over the synchronous one's, divided by
  r); at r's upper bound it is the net speed-up's one-sided 95 % lower bound; with r "> c" it is "< ratio / c".
  The delayed schedule reaches the loss sooner exactly when its net speed-up exceeds 1.

Torch-free (the planner uses it): only the standard library.

Long because the measure, its bounds and its command line are one definition (issue 63) read by the planner
and the benchmarks alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT = "fdg_schedule.token_overhead/1"
FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
Curve = Sequence[tuple[float, float]]  # (tokens, validation loss) at each evaluation, tokens rising


# ---------------------------------------------------------------------------------------------------
# One curve, one pair


def check_curve(curve: Curve, what: str = "curve") -> list[tuple[float, float]]:
    """The curve as a list of float pairs; refuses an empty curve, a non-finite value, or tokens that do not rise."""
    points = [(float(t), float(v)) for t, v in curve]
    if not points:
        raise ValueError(f"{what} has no evaluations; give at least one (tokens, validation loss) pair")
    bad = [p for p in points if not (math.isfinite(p[0]) and math.isfinite(p[1]))]
    if bad:
        raise ValueError(f"{what} has non-finite evaluations {bad[:3]}; a diverged run has no token overhead")
    falling = [(a[0], b[0]) for a, b in zip(points, points[1:]) if b[0] <= a[0]]
    if falling:
        raise ValueError(f"{what}: tokens must rise from one evaluation to the next, got {falling[0][0]:g} then "
                         f"{falling[0][1]:g}")  # fmt: skip
    return points


def tokens_to_reach(curve: Curve, target: float) -> float | None:
    """The tokens at which ``curve`` (linear between evaluations) first reaches ``target`` or below; None if never."""
    points = check_curve(curve)
    if points[0][1] <= target:
        return points[0][0]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if v1 <= target:  # v0 > target >= v1: the crossing lies in (t0, t1]
            return t0 + (v0 - target) / (v0 - v1) * (t1 - t0)
    return None


def value_at(curve: Curve, tokens: float) -> float:
    """The curve's loss at ``tokens`` (linear between evaluations), within its first and last evaluation."""
    points = check_curve(curve)
    if not points[0][0] <= tokens <= points[-1][0]:
        raise ValueError(f"{tokens:g} tokens lie outside the curve's evaluations ({points[0][0]:g} to "
                         f"{points[-1][0]:g})")  # fmt: skip
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return v0 + (tokens - t0) / (t1 - t0) * (v1 - v0)
    return points[-1][1]  # a curve of one evaluation


@dataclasses.dataclass(frozen=True)
class Overhead:
    """r of one delayed run against one baseline at one target; ``r`` None means "> cap" (not reached)."""

    target: float  # validation loss
    baseline_tokens: float  # the denominator: tokens at which the baseline had ``target``
    tokens: float | None  # the delayed run's first crossing of ``target``; None: not reached
    cap: float  # the delayed run's last evaluated tokens / baseline_tokens

    @property
    def r(self) -> float | None:
        return None if self.tokens is None else self.tokens / self.baseline_tokens

    @property
    def reached(self) -> bool:
        return self.tokens is not None

    def __str__(self) -> str:
        return f"> {self.cap:.3g}" if self.r is None else f"{self.r:.3f}"


def token_overhead(baseline: Curve, delayed: Curve, fraction: float = 1.0) -> Overhead:
    """r of ``delayed`` at the loss ``baseline`` had at ``fraction`` of its tokens (1: its final loss)."""
    base = check_curve(baseline, "the baseline curve")
    late = check_curve(delayed, "the delayed curve")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    at = fraction * base[-1][0]
    if at < base[0][0]:
        least = base[0][0] / base[-1][0]
        raise ValueError(f"fraction {fraction} of the baseline's {base[-1][0]:g} tokens is before its first "
                         f"evaluation ({base[0][0]:g}); use fractions of at least {least:.3g}")  # fmt: skip
    target = base[-1][1] if fraction == 1 else value_at(base, at)
    return Overhead(target=target, baseline_tokens=at, tokens=tokens_to_reach(late, target), cap=late[-1][0] / at)


# ---------------------------------------------------------------------------------------------------
# Over seeds


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile: the t with P(T <= t) = q for ``df`` degrees of freedom (bisection on the CDF)."""
    if not 0.5 <= q < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= q < 1 and df >= 1, got q={q}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom: 1 - I_x(df/2, 1/2) / 2, x = df / (df + t^2)."""
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast below this point: use the symmetry
        return 1 - _incomplete_beta(b, a, 1 - x)
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * f / a


@dataclasses.dataclass(frozen=True)
class Summary:
    """r over seeds at one target (paired: seed i's delayed run against seed i's baseline)."""

    seeds: tuple[Overhead, ...]

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def reached(self) -> int:
        return sum(s.reached for s in self.seeds)

    @property
    def logs(self) -> list[float]:
        """log r per seed; a seed that did not reach enters at log cap (a lower bound on its log r)."""
        return [math.log(s.r if s.r is not None else s.cap) for s in self.seeds]

    @property
    def mean_log(self) -> float:
        return statistics.fmean(self.logs)

    @property
    def sd_log(self) -> float | None:
        return statistics.stdev(self.logs) if self.n > 1 else None

    @property
    def r(self) -> float | None:
        """exp(mean log r), the geometric mean; None when a seed did not reach (see :attr:`at_least`)."""
        return math.exp(self.mean_log) if self.reached == self.n else None

    @property
    def at_least(self) -> float | None:
        """When a seed did not reach: r > this (not-reached seeds at their caps); else None."""
        return None if self.reached == self.n else math.exp(self.mean_log)

    def _half_width(self, q: float) -> float | None:
        sd = self.sd_log
        return None if sd is None else t_quantile(q, self.n - 1) * sd / math.sqrt(self.n)

    @property
    def upper(self) -> float | None:
        """The one-sided 95 % upper bound of r; None with one seed or when a seed did not reach."""
        half = self._half_width(0.95)
        return None if half is None or self.r is None else math.exp(self.mean_log + half)

    @property
    def interval(self) -> tuple[float, float] | None:
        """The two-sided 95 % interval of r; None with one seed or when a seed did not reach."""
        half = self._half_width(0.975)
        if half is None or self.r is None:
            return None
        return math.exp(self.mean_log - half), math.exp(self.mean_log + half)

    @property
    def cap(self) -> float:
        return min(s.cap for s in self.seeds)

    def r_text(self) -> str:
        return f"> {self.at_least:.3f}" if self.r is None else f"{self.r:.3f}"

    def upper_text(self) -> str:
        if self.r is None:
            return f"> {self.at_least:.3f}"
        return "n/a (one seed)" if self.upper is None else f"{self.upper:.3f}"


def summarize(pairs: Sequence[tuple[Curve, Curve]], fraction: float = 1.0) -> Summary:
    """r of every (baseline, delayed) pair at ``fraction`` of the baseline's tokens."""
    if not pairs:
        raise ValueError("no (baseline, delayed) pairs: give one per seed")
    return Summary(tuple(token_overhead(b, d, fraction) for b, d in pairs))


@dataclasses.dataclass(frozen=True)
class Net:
    """Net speed-up = throughput ratio / r, with its bound."""

    ratio: float  # the delayed schedule's samples/s over the synchronous one's
    value: float | None  # ratio / r; None when r is "> c"
    lower: float | None  # ratio / r's upper bound: the one-sided 95 % lower bound of the net speed-up
    at_most: float | None  # ratio / c when r is "> c"

    def __str__(self) -> str:
        if self.value is None:
            return "unknown" if self.at_most is None else f"< {self.at_most:.3f}"
        return f"{self.value:.3f}" + ("" if self.lower is None else f" (95 % lower bound {self.lower:.3f})")


def net_speedup(ratio: float, summary: Summary) -> Net:
    """The net speed-up of a schedule ``ratio`` times as fast per step as the baseline, given r over seeds."""
    if not ratio > 0:
        raise ValueError(f"the throughput ratio must be > 0, got {ratio}")
    if summary.r is None:
        return Net(ratio, None, None, ratio / (summary.at_least or 1.0))
    return Net(ratio, ratio / summary.r, None if summary.upper is None else ratio / summary.upper, None)


# ---------------------------------------------------------------------------------------------------
# A measurement: pairs, band, JSON


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a measurement measured (each field None where not stated); the planner matches on it."""

    family: str | None = None  # e.g. "gpt", "llama", "resnet"
    optimizer: str | None = None  # e.g. "adamw", "sgd", "muon"
    stages: int | None = None  # K
    corrections: str | None = None  # "auto", "none", or the keys, e.g. "delay_lr_ticks+predict_decay"
    accumulate: int | None = None  # FDG's micro-batches per optimizer step
    baseline_batch: int | None = None  # the baseline BP's micro-batches per step (the job's batch)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """r over seeds at the baseline's final loss and along the band, with what was measured and where."""

    final: Summary
    band: tuple[tuple[float, Summary], ...]  # (fraction, r over seeds)
    labels: tuple[tuple[str, str], ...]  # (baseline, delayed) per seed: where each curve came from
    setting: Setting = Setting()
    throughput_ratio: float | None = None
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        def summary(s: Summary) -> dict[str, Any]:
            return {
                **{"n": s.n, "reached": s.reached, "r": s.r, "r_at_least": s.at_least, "upper_95": s.upper},
                **{"interval_95": s.interval, "mean_log_r": s.mean_log, "sd_log_r": s.sd_log, "cap": s.cap},
            }

        out: dict[str, Any] = {
            "format": FORMAT,
            "definition": "r = tokens the delayed run needs to first reach the baseline's final validation loss "
            "(linear between evaluations) / the baseline's tokens; docs/token-overhead.md",
            "setting": dataclasses.asdict(self.setting),
            **summary(self.final),
            "seeds": [
                {
                    "baseline": b,
                    "delayed": d,
                    "target": o.target,
                    "baseline_tokens": o.baseline_tokens,
                    "tokens": o.tokens,
                    "r": o.r,
                    "cap": o.cap,
                }
                for (b, d), o in zip(self.labels, self.final.seeds)
            ],  # fmt: skip
            "band": [{"fraction": f, **summary(s)} for f, s in self.band],
        }
        if self.throughput_ratio is not None:
            net = net_speedup(self.throughput_ratio, self.final)
            out["throughput_ratio"] = self.throughput_ratio
            out["net_speedup"] = {"value": net.value, "lower_95": net.lower, "at_most": net.at_most}
        if self.notes:
            out["notes"] = self.notes
        return out


def measure(
    pairs: Sequence[tuple[Curve, Curve]],
    labels: Sequence[tuple[str, str]] | None = None,
    setting: Setting = Setting(),
    throughput_ratio: float | None = None,
    fractions: Sequence[float] = FRACTIONS,
) -> Measurement:
    """r over the seeds' (baseline, delayed) pairs, at the final loss and at each fraction of the band."""
    labels = labels or [(f"baseline {i}", f"delayed {i}") for i in range(len(pairs))]
    if len(labels) != len(pairs):
        raise ValueError(f"{len(labels)} labels for {len(pairs)} pairs")
    return Measurement(
        final=summarize(pairs),
        band=tuple((f, summarize(pairs, f)) for f in fractions),
        labels=tuple((str(b), str(d)) for b, d in labels),
        setting=setting,
        throughput_ratio=throughput_ratio,
    )


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A measurement as read back from its JSON (or from the shipped table): what the planner needs."""

    setting: Setting
    r: float | None
    r_at_least: float | None
    upper_95: float | None
    n: int
    cap: float
    source: str


def write(path: str | Path, measurement: Measurement) -> Path:
    Path(path).write_text(json.dumps(measurement.to_dict(), indent=1) + "\n")
    return Path(path)


def read(path: str | Path) -> Recorded:
    """A measurement JSON written by :func:`write` (``python -m fdg_schedule.plan.token_overhead --json``)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"no token-overhead JSON at {path}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON ({error}); write it with python -m fdg_schedule.plan.token_overhead "
                         "--json") from None  # fmt: skip
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is not a token-overhead measurement (format {found!r}, expected {FORMAT!r}); "
                         "write it with python -m fdg_schedule.plan.token_overhead --json")  # fmt: skip
    missing = [k for k in ("r", "r_at_least", "upper_95", "n", "cap") if k not in data]
    if missing or (data["r"] is None and data["r_at_least"] is None):
        raise ValueError(f"{path} lacks {missing or ['r', 'r_at_least']}; write it with python -m "
                         "fdg_schedule.plan.token_overhead --json")  # fmt: skip
    known = {f.name for f in dataclasses.fields(Setting)}
    setting = Setting(**{k: v for k, v in (data.get("setting") or {}).items() if k in known})
    return Recorded(setting, data["r"], data["r_at_least"], data["upper_95"], data["n"], data["cap"], str(path))


# ---------------------------------------------------------------------------------------------------
# Reading curves from the project's run files


def load_curve(spec: str, by: str = "tokens") -> list[tuple[float, float]]:
    """A validation curve from ``PATH[:RUN]``, against ``by``: "tokens", "samples" (images: the metrics file of
    ``recipes/train_resnet.py --metrics``) or "train_s" (the training seconds both recipes write: then r is the time
    ratio, docs/token-overhead.md).

    - a directory, or a ``.jsonl`` file: ``benchmarks/convergence/lm_convergence.py``'s and the recipes'
      ``metrics.jsonl``, rows with ``tokens`` (or ``samples``) and ``val_loss`` (``recipes/train_resnet.py``
      without ``--val-images``: ``test_loss``); rows without a loss are training rows and skipped;
    - a ``.json`` file holding ``{"runs": {RUN: {"val": [[tokens, loss], ...]}}}``, the staleness evidence
      (``docs/results/staleness/staleness_gpt2_*.json``): ``:RUN`` names the run;
    - a ``.json`` file holding a list of ``[tokens, loss]`` pairs or of rows, or a dict with one of ``val``,
      ``validation``, ``rows``, ``curve`` holding such a list.
    """
    path_text, _, run = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    path = Path(path_text)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"no curve at {path} (from {spec!r}); give PATH or PATH:RUN")
    text = path.read_text()
    if path.suffix == ".jsonl":
        return _curve([json.loads(line) for line in text.splitlines() if line.strip()], spec, by)
    if by != "tokens":
        raise ValueError(f"{path}: curves against {by!r} come from a metrics.jsonl with that column, not a .json")
    data = json.loads(text)
    if isinstance(data, dict) and "runs" in data:
        runs = {name: r for name, r in data["runs"].items() if isinstance(r, dict) and "val" in r}
        if not run and len(runs) == 1:
            run = next(iter(runs))
        if run not in runs:
            raise ValueError(f"{path} holds runs {sorted(runs)}; name one as {path}:RUN"
                             + (f" ({run!r} is not among them)" if run else ""))  # fmt: skip
        return _curve(runs[run]["val"], spec)
    if run:
        raise ValueError(f"{path} holds one curve, not named runs; drop ':{run}'")
    if isinstance(data, dict):
        for key in ("val", "validation", "rows", "curve"):
            if isinstance(data.get(key), list):
                return _curve(data[key], spec)
        raise ValueError(f"{path} has no curve: expected a list, or a dict with runs, val, validation, rows or curve")
    return _curve(data, spec)


def _curve(rows: list[Any], spec: str, by: str = "tokens") -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for row in rows:
        if isinstance(row, dict):
            loss = row.get("val_loss", row.get("validation", row.get("test_loss")))
            if loss is None:
                continue  # a training row
            if by not in row:
                raise ValueError(f"{spec}: an evaluation row has no {by!r} (the recipes write train_s; "
                                 "train_lm.py tokens, train_resnet.py samples)")  # fmt: skip
            out.append((float(row[by]), float(loss)))
        else:
            tokens, loss = row
            out.append((float(tokens), float(loss)))
    return check_curve(out, spec)


# ---------------------------------------------------------------------------------------------------
# Command line


def report(m: Measurement, by: str = "tokens") -> str:
    """The measurement as text: per seed, r over seeds, the band, and the net speed-up if a ratio was given."""
    lines = [
        f"| seed | baseline | delayed | target loss | baseline {by} | delayed {by} | r |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, ((b, d), o) in enumerate(zip(m.labels, m.final.seeds)):
        reached = "not reached" if o.tokens is None else f"{o.tokens:,.0f}"
        lines.append(f"| {i} | {b} | {d} | {o.target:.4f} | {o.baseline_tokens:,.0f} | {reached} | {o} |")
    s = m.final
    interval = "" if s.interval is None else f", two-sided 95 % interval {s.interval[0]:.3f}-{s.interval[1]:.3f}"
    sd = "" if s.sd_log is None else f", sd of log r {s.sd_log:.4f}"
    lines += ["", f"r = {s.r_text()} over {s.n} seeds ({s.reached} reached the baseline's final loss within the cap "
              f"{s.cap:.3g}x); one-sided 95 % upper bound {s.upper_text()}{interval}; mean log r "
              f"{s.mean_log:+.4f}{sd}",
              "", "band (target: the baseline's loss at f x its tokens):", ""]  # fmt: skip
    lines += [
        f"- f = {f:g}: r = {b.r_text()}, upper bound {b.upper_text()} ({b.reached}/{b.n} reached)" for f, b in m.band
    ]
    if m.throughput_ratio is not None:
        net = net_speedup(m.throughput_ratio, s)
        verdict = ("worth it" if (net.value or 0) > 1 else "not worth it") if net.value is not None else (
            "not worth it" if (net.at_most or 0) <= 1 else "undecided: r is only bounded below")  # fmt: skip
        lines += ["", f"net speed-up = {m.throughput_ratio:g} / r = {net}: {verdict}"]
    if by == "train_s" and s.r is not None:  # r is the time ratio: its inverse is the net speed-up, measured
        low = "" if s.upper is None else f" (95 % lower bound {1 / s.upper:.3f})"
        lines += ["", f"against training seconds r is the time ratio: net speed-up = 1 / r = {1 / s.r:.3f}{low}"]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fdg_schedule.plan.token_overhead",
                                description=(__doc__ or "").split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    p.add_argument("curves", nargs="+", help="BASELINE DELAYED per seed, each PATH or PATH:RUN (see load_curve)")
    p.add_argument("--throughput-ratio", type=float, default=None, help="delayed samples/s over baseline's: net")
    p.add_argument("--json", default=None, help="write the measurement here (the planner's --token-overhead reads it)")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="the band: fractions of BP's tokens")
    p.add_argument("--by", default="tokens", choices=["tokens", "samples", "train_s"],
                   help="the curves' axis: tokens, samples (images), or train_s (metrics.jsonl's training "
                        "seconds): the time ratio")  # fmt: skip
    for flag, kind in (("family", str), ("optimizer", str), ("stages", int), ("corrections", str),
                       ("accumulate", int), ("baseline-batch", int)):  # fmt: skip
        p.add_argument(f"--{flag}", type=kind, default=None, help="recorded in the JSON; the planner matches on it")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        if len(args.curves) % 2:
            raise ValueError(f"give curves in pairs, BASELINE DELAYED per seed; got {len(args.curves)}")
        fractions = [float(f) for f in args.fractions.split(",") if f]
        labels = list(zip(args.curves[::2], args.curves[1::2]))
        if args.by == "train_s" and (args.json or args.throughput_ratio is not None):
            raise ValueError("--by train_s measures time itself: its r is a time ratio, not a token overhead, so "
                             "--json (the planner's input) and --throughput-ratio do not apply; drop them")  # fmt: skip
        pairs = [(load_curve(b, args.by), load_curve(d, args.by)) for b, d in labels]
        setting = Setting(args.family, args.optimizer, args.stages, args.corrections, args.accumulate,
                          args.baseline_batch)  # fmt: skip
        m = measure(pairs, labels, setting, args.throughput_ratio, fractions)
    except (ValueError, KeyError) as error:
        p.error(str(error))
    print(report(m, args.by))
    if args.json:
        write(args.json, m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
