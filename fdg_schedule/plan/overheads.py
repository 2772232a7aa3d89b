"""Where the planner gets FDG's token overhead r: the user's measurement, else the shipped table, else unknown.

The shipped table (:mod:`fdg_schedule.plan.measured_overheads`, written by
``python -m benchmarks.studies.token_overheads`` from curves under docs/results/) is keyed by the model family,
the optimizer, K, the corrections, FDG's ``accumulate`` and BP's micro-batches per step (the job's batch, which
every synchronous schedule computes). A setting it does not hold is unknown: nothing is interpolated or carried over
from a neighbouring K. Synchronous schedules have r = 1 by definition: they compute backprop at the job's batch.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from fdg_schedule.plan.measured_overheads import ENTRIES
from fdg_schedule.plan.token_overhead import Recorded, Setting, read

SETTING_KEYS = ("family", "optimizer", "stages", "corrections", "accumulate", "baseline_batch")
# "auto" names the newest rule, v2 (fdg_schedule.corrections.auto_corrections.RULE_OF); v1 and v2 choose the same keys
# for every optimizer but these, so a measurement under either rule stands for both of them elsewhere.
LATEST_AUTO = "auto-v2"
RULES_DIFFER_FOR = ("muon", "lion")


def same_keys(setting: Setting) -> Setting:
    """``setting`` with its corrections as the keys it sets: "auto" is rule v2; where rules v1 and v2 choose the same
    keys (every optimizer but Muon and Lion), "auto-v1", "auto-v2" and "auto" are one setting, "auto". The shipped
    table's "auto" rows were measured under rule v1 with AdamW."""
    rule = LATEST_AUTO if setting.corrections == "auto" else setting.corrections
    if rule in ("auto-v1", "auto-v2") and setting.optimizer not in RULES_DIFFER_FOR:
        rule = "auto"
    return dataclasses.replace(setting, corrections=rule)


def measured() -> list[Recorded]:
    """The shipped measurements, one per setting."""
    out = []
    for e in ENTRIES:
        setting = Setting(**{k: e[k] for k in SETTING_KEYS})
        source = (f"measured on {e['model']}, {e['n']} seeds at {e['tokens']:,} tokens ({e['evidence'][0]}; "
                  f"{e['command']})")  # fmt: skip
        out.append(Recorded(setting, e["r"], e["r_at_least"], e["upper_95"], e["n"], e["cap"], source))
    return out


def lookup(setting: Setting) -> Recorded | None:
    """The shipped measurement of exactly ``setting`` (every field equal, the corrections compared as the keys they
    set: :func:`same_keys`), or None: unknown."""
    return next((m for m in measured() if same_keys(m.setting) == same_keys(setting)), None)


@dataclasses.dataclass(frozen=True)
class TokenOverhead:
    """r for one configuration as the planner uses it."""

    r: float | None  # the point estimate (geometric mean over seeds); None when unknown or only bounded below
    at_least: float | None  # r > this: a seed did not reach the baseline's loss within its cap
    upper: float | None  # the one-sided 95 % upper bound of r
    source: str

    @property
    def known(self) -> bool:
        return self.r is not None

    @property
    def ranking(self) -> float:
        """The r the ranking divides by: r; else its lower bound (FDG's best case); else 1 (unknown: per step)."""
        return self.r if self.r is not None else self.at_least if self.at_least is not None else 1.0

    def text(self) -> str:
        if self is SYNCHRONOUS:
            return "1"
        if self.r is not None:
            return f"{self.r:.2f}" + ("" if self.upper is None or self.upper == self.r else f" (≤{self.upper:.2f})")
        return f"> {self.at_least:.2f}" if self.at_least is not None else "?"

    def net(self, ratio: float) -> str:
        """The net speed-up ``ratio`` / r as a table cell."""
        if self.r is not None:
            return f"{ratio / self.r:.2f}"  # a synchronous schedule's net is its per-step ratio
        return f"< {ratio / self.at_least:.2f}" if self.at_least is not None else "?"


SYNCHRONOUS = TokenOverhead(1.0, None, None, "synchronous: backprop at the job's batch, r = 1")


@dataclasses.dataclass(frozen=True)
class Overheads:
    """How r is found for an FDG configuration: ``--token-overhead``, else the shipped table, else unknown."""

    value: float | None = None
    """``--token-overhead R``: r for every FDG configuration."""
    recorded: Recorded | None = None
    """``--token-overhead FILE``: a measurement; it applies where its recorded K, accumulate and BP batch match."""
    family: str | None = None
    optimizer: str | None = None
    corrections: str | None = None

    def __post_init__(self) -> None:
        if self.value is not None and not (math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"--token-overhead must be a number > 0 or a measurement JSON, got {self.value}")

    def for_fdg(self, stages: int, accumulate: int, baseline_batch: int) -> TokenOverhead:
        if self.value is not None:
            return TokenOverhead(self.value, None, None, f"--token-overhead {self.value:g}")
        where = Setting(self.family, self.optimizer, stages, self.corrections, accumulate, baseline_batch)
        if self.recorded is not None and _applies(self.recorded.setting, where):
            m = self.recorded
            return TokenOverhead(m.r, m.r_at_least, m.upper_95, f"--token-overhead {m.source} ({m.n} seeds)")
        shipped = lookup(where)
        if shipped is not None:
            return TokenOverhead(shipped.r, shipped.r_at_least, shipped.upper_95, shipped.source)
        what = ", ".join(f"{k} {getattr(where, k)}" for k in SETTING_KEYS)
        return TokenOverhead(None, None, None, f"no measurement of {what}")


def _applies(recorded: Setting, where: Setting) -> bool:
    """A user's measurement applies unless it recorded a K, accumulate or BP batch other than ``where``'s."""
    return all(getattr(recorded, k) in (None, getattr(where, k)) for k in ("stages", "accumulate", "baseline_batch"))


def parse_token_overhead(text: str) -> tuple[float | None, Recorded | None]:
    """``--token-overhead``: a number (r) or the path of the measure's JSON."""
    try:
        value = float(text)
    except ValueError:
        if not Path(text).exists():
            raise ValueError(f"--token-overhead {text!r} is neither a number (r, e.g. 1.4) nor a file; write r or the "
                             "JSON of python -m fdg_schedule.plan.token_overhead --json") from None  # fmt: skip
        return None, read(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--token-overhead must be a number > 0 (r, e.g. 1.4), got {text}")
    return value, None
