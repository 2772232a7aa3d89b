"""``pipeline.fdg.corrections: "auto"``: the staleness corrections a stage gets from what it has.

Note [the auto rule] (docs/staleness.md, "The auto rule"; rule v1 pre-registered in
docs/results/auto-preregistration.md)
    Decided once, at ``deepspeed.initialize``, on every stage from its optimizer's class and param
    groups, K, ``accumulate`` and the LR scheduler; each stage's delay then enters the corrections'
    formulas through h_k = 2(K-1-k) / accumulate, as for the explicit keys. Nothing depends on a
    run length the engine cannot read. ``"auto"`` is the newest rule (:data:`LATEST`, v2);
    ``"auto-v1"`` and ``"auto-v2"`` name one, so that a job (and its results) keeps its rule.

    family of the stage optimizer (its class and param groups):
      muon       the class is a Muon (DeepSpeed's MuonWithAuxAdam, torch's Muon)      [rule v2; v1: uncovered]
      lion       the class is a Lion (DeepSpeed's Lion, CPU or fused)                 [rule v2; v1: betas]
      momentum   every group has ``momentum`` > 0 and no ``betas`` (SGD with momentum, RMSprop)
      betas      every group has ``betas`` (Adam, AdamW, DeepSpeed's FusedAdam, NAdam, ...)
      uncovered  anything else: no momentum (plain SGD, Adagrad), mixed groups

    +-----------+------+------------------------------------------------------------------------+
    | family    | K    | keys                                                                   |
    +-----------+------+------------------------------------------------------------------------+
    | momentum  | 2    | none                                                                   |
    | momentum  | >= 3 | delay_momentum, delay_momentum_peak_lr = rho                           |
    | betas     | 2    | predict_decay 0, predict_horizon "first_stage", delay_momentum_raise 1 |
    | betas     | >= 3 | the K = 2 keys and delay_lr_ticks = T                                  |
    | lion      | any  | predict_decay 0, predict_horizon "first_stage" (v2; the log says how   |
    |           |      | little it was measured)                                                |
    | muon      | 2    | none (v2)                                                              |
    | muon      | >= 3 | predict_decay 0, predict_horizon "first_stage" (v2)                    |
    | uncovered | any  | none, with a warning that names why                                    |
    | any       | 1    | none (nothing is delayed)                                              |
    +-----------+------+------------------------------------------------------------------------+

    Rule v1 is this table without the muon and lion rows (Muon uncovered, Lion in the betas family):
    for every other optimizer v1 and v2 choose the same keys. v2's Muon row is the candidates screen's
    (docs/results/staleness/experiment-log.md, "The first pass and the screen narrowed"): the forwards
    on the weights predicted from the last applied update (Muon's orthogonalised step) to the tick in
    which stage 0 applies the gradient; at K = 2 FDG-Muon was +0.24 % and +0.51 % from BP-Muon uncorrected.
    Lion's row too (the screen's Lion cell, one seed at K = 4: +7.51 % above BP-Lion, against +8.17 %
    uncorrected and +15.78 % with the betas family's keys, which v2 first gave Lion until that cell came in).

    rho, the peak learning rate: the largest lr the scheduler will give any param group, read from
    it at initialize (DeepSpeed's WarmupLR / WarmupDecayLR max lr, WarmupCosineLR's and torch
    schedulers' base lrs, OneCycle's max lr), else the groups' largest lr at initialize.
    T: twice the run's ticks when the scheduler says how long the run is (DeepSpeed's WarmupDecayLR /
    WarmupCosineLR ``total_num_steps``, torch's CosineAnnealingLR ``T_max``, OneCycleLR
    ``total_steps``, PolynomialLR ``total_iters``: scheduler steps, one per ``accumulate`` ticks);
    otherwise ``FOREVER`` (2**62 ticks), under which the factor tau_k ** -max(0, 1 - t/T) stays
    tau_k ** -1 (to 1e-10 over 10**8 ticks): the run-length-free form.

    weights: the rule was measured with ``"stashed"`` at K >= 3 (both families) and for the betas
    family at K = 2. ``weights`` is the user's (a memory decision); with ``"current"`` the same keys
    apply and rank 0's log line says that the tested form is ``"stashed"``.

Note [the cost of no correction]
    A K >= 3 job whose ``pipeline.fdg`` has no ``corrections`` key and no correction key of its own runs no
    staleness correction (the paper's FDG). Global rank 0 says so at start, once, with what that cost in the
    pre-registered test (docs/results/auto/report.json, at K = 4, the mean paired difference to backprop, and
    what "auto" gave on the same seeds) and the key to set: :data:`MEASURED_K4`, the one place those numbers
    live in code (tests/test_auto_corrections.py checks them against the report and docs/staleness.md).
    A Muon job gets Muon's measured cost instead (:data:`MUON_NONE_K4`, docs/results/muon/report.json) and
    that rule v2's Muon keys are not tested on held-out tasks yet. Not for K <= 2 (the test measured K = 4), an
    explicit ``"none"`` (a choice made), explicit keys, or an optimizer the rule does not cover ("auto" would choose
    no correction either).

Why: docs/staleness.md. Delayed SGD-momentum stages overshoot (a delayed gradient already carries
h_k steps of the trajectory; lower momentum keeps less of it, fully at the peak lr and returning to
mu as the lr decays); Adam-family stages gain from a longer first-moment average (the raise), a
look-ahead of every stage's forward to the tick stage 0 applies the gradient (gamma = 0: the last
step, extrapolated), and at K >= 3 a delay-aware lr over the run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fdg_schedule.base.config import CORRECTION_KEYS, FDGConfig, FDGConfigError

logger = logging.getLogger(__name__)

LATEST = "v2"
RULE_OF = {"auto": LATEST, "auto-v1": "v1", "auto-v2": "v2"}  # a corrections value -> its rule (config.CORRECTIONS)
# The keys the rules decide and a checkpoint records (:func:`recorded`): the correction keys older than the rule's
# first test. The later ones (predict_scale, predict_momentum) stay at their defaults under "auto" and are not
# recorded, so checkpoints saved before them resume.
RULE_KEYS = ("delay_lr_ticks", "predict_decay", "predict_horizon", "delay_momentum", "delay_momentum_peak_lr",
             "delay_momentum_raise")  # fmt: skip
# the forwards predicted from the last applied update to the tick in which stage 0 applies the gradient
PREDICTION: dict[str, Any] = {"predict_decay": 0.0, "predict_horizon": "first_stage"}
FOREVER = 2**62  # delay_lr_ticks without a run length: the factor stays tau ** -1 (Note [the auto rule])


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``"auto"`` chose for a stage, and why (Note [the auto rule])."""

    family: str  # "momentum" | "betas" | "lion" | "muon" | "uncovered" | "undelayed"
    keys: dict[str, Any]  # the correction keys it sets (explicit-key names and values)
    why: str  # one sentence: the facts it read
    warning: str = ""  # what the user should know (untested weights, an optimizer the rule does not cover)
    rule: str = LATEST

    def line(self) -> str:
        """The log line rank 0 prints."""
        keys = ", ".join(f"{k}={v!r}" for k, v in self.keys.items()) or "no correction"
        return f'fdg_schedule: corrections "auto" (rule {self.rule}) chose {keys}: {self.why}' + (
            f"; {self.warning}" if self.warning else ""
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What the LR scheduler says at initialize: the peak lr over the run and the run's scheduler steps."""

    peak_lr: float | None = None
    total_steps: int | None = None
    name: str = "no scheduler"


@dataclasses.dataclass(frozen=True)
class Measured:
    """One task measured at K = 4: mean paired difference to backprop of each arm (Note [the cost of no correction]),
    rounded as docs/staleness.md states it."""

    task: str  # the key in docs/results/auto/report.json
    name: str  # the task in the log line
    unit: str  # "%" of BP's test loss, or "points" of test error
    none: float  # no correction (what a block without "corrections" runs) - BP
    auto: float | None = None  # "corrections": "auto" - BP (None: not measured in a test)


MEASURED_K4 = (
    Measured("llama", "LLaMA-style", "%", 11.35, 2.30),
    Measured("gpt2", "GPT-2", "%", 17.44, 1.54),
    Measured("resnet32", "ResNet-32", "points", 1.39, 0.30),
)


def measured_costs(arm: str) -> str:
    """The arm's (``"none"`` or ``"auto"``) measured differences to BP as the log line and docs/staleness.md state
    them, e.g. ``LLaMA-style +11.35 %, GPT-2 +17.44 %, ResNet-32 +1.39 points``."""
    return ", ".join(f"{m.name} {getattr(m, arm):+.2f} {m.unit}" for m in MEASURED_K4)


MUON_NONE_K4 = (Measured("llama", "LLaMA-style", "%", 2.22), Measured("gpt2", "GPT-2", "%", 4.20))
"""FDG-Muon at K = 4 with no correction - BP-Muon, test loss in % (docs/results/muon/report.json, seeds 100-104)."""


def no_correction_line(config: FDGConfig, optimizer: Any, stages: int) -> str | None:
    """Note [the cost of no correction]: the line rank 0 logs at start, or None when the job needs none."""
    default = FDGConfig()
    if stages < 3 or config.corrections is not None or optimizer is None:
        return None
    if any(getattr(config, key) != getattr(default, key) for key in CORRECTION_KEYS):
        return None  # a correction of the user's own
    family = family_of(optimizer)[0]
    if family == "uncovered":
        return None
    start = (
        f'fdg_schedule: pipeline.fdg has no "corrections" key, so this K = {stages} job trains with no staleness '
        "correction (the paper's FDG)."
    )
    if family == "muon":
        costs = ", ".join(f"{m.name} {m.none:+.2f} {m.unit}" for m in MUON_NONE_K4)
        return (
            f"{start} With DeepSpeed's Muon at K = 4 that cost, against backprop with Muon, {costs} of test loss "
            f'(docs/staleness.md, Muon on the LM tasks). "corrections": "auto" (rule {LATEST}) predicts the '
            "forwards from Muon's last update: chosen on development tasks, not yet tested on held-out ones. Set "
            '"corrections": "auto" in pipeline.fdg, or "none" to keep no correction without this line'
        )
    return (
        f'{start} In the pre-registered test (K = 4, "weights": "stashed", grad_shrink 1) '
        f"that cost, against backprop, {measured_costs('none')} (test loss in %, test error in points); "
        f'"corrections": "auto" gave {measured_costs("auto")}. Set "corrections": "auto" in pipeline.fdg '
        '(docs/staleness.md, The pre-registered test), or "none" to keep no correction without this line'
    )


def family_of(optimizer: Any, rule: str = LATEST) -> tuple[str, str]:
    """The rule's family of an optimizer from its class and param groups, and a phrase saying why."""
    kind = type(optimizer).__name__
    groups = list(optimizer.param_groups)
    if "Muon" in kind:
        if rule == "v1":
            return "uncovered", (
                f"{kind}: rule v1 has no correction for Muon (without one, FDG-Muon at K = 4 was 2.2-4.2 % above "
                "BP-Muon's loss on the LM tasks, at K = 2 within 0.7 %: docs/staleness.md, Muon on the LM tasks)"
            )
        return "muon", kind
    if "Lion" in kind and rule != "v1":
        return "lion", f"{kind} with betas {groups[0]['betas']!r}" if groups and "betas" in groups[0] else kind
    if groups and all("betas" in g for g in groups):
        return "betas", f"{kind} with betas {groups[0]['betas']!r}"
    momenta = [g.get("momentum") for g in groups]
    if groups and all(isinstance(m, (int, float)) and m > 0 for m in momenta) and not any("betas" in g for g in groups):
        return "momentum", f"{kind} with momentum {momenta[0]!r}"
    return "uncovered", f"{kind} has neither momentum > 0 in every param group nor betas"


def schedule_of(scheduler: Any, optimizer: Any) -> Schedule:
    """Peak lr and length of the run as ``scheduler`` (DeepSpeed's or torch's, or None) states them."""
    lrs = [float(g["lr"]) for g in optimizer.param_groups]
    if scheduler is None:
        return Schedule(max(lrs, default=None))
    name = type(scheduler).__name__
    peaks: list[float] = []
    for attr in ("max_lrs", "org_lrs", "base_lrs"):  # DeepSpeed WarmupLR / OneCycle, WarmupCosineLR, torch
        value = getattr(scheduler, attr, None)
        if value:
            peaks = [float(v) for v in value]
            break
    if name == "OneCycleLR":
        peaks = [float(g.get("max_lr", 0.0)) for g in optimizer.param_groups]
    total = None
    for attr in ("total_num_steps", "T_max", "total_steps", "total_iters"):
        value = getattr(scheduler, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            total = value
            break
    if name in ("LinearLR", "ConstantLR"):  # their total_iters is a ramp, not the run
        total = None
    return Schedule(max(peaks or lrs, default=None), total, name)


def choose(
    optimizer: Any, stages: int, accumulate: int, weights: str, schedule: Schedule, rule: str = LATEST
) -> Choice:
    """Note [the auto rule]: the correction keys rule ``rule`` gives a stage with ``optimizer`` in a pipeline of
    ``stages``."""
    if stages == 1:
        return Choice("undelayed", {}, "K = 1: nothing is delayed", rule=rule)
    family, found = family_of(optimizer, rule)
    at = f"K = {stages}, accumulate {accumulate}"
    keys: dict[str, Any]
    untested = (
        f'the rule was measured with weights "stashed"; this job has "{weights}" (pipeline.fdg.weights is yours: '
        '"stashed" keeps one copy of the stage weights per micro-batch in flight)'
        if weights != "stashed" and (stages >= 3 or family in ("betas", "lion"))
        else ""
    )
    if family == "uncovered":
        return Choice(family, {}, f"{found}, {at}", "the rule does not cover this optimizer: no correction", rule)
    if family == "lion":
        keys = dict(PREDICTION)
        lion = ("rule v2's Lion keys were measured on one seed of a development task at K = 4 only (+7.5 % above "
                "BP-Lion's loss against +8.2 % uncorrected; docs/staleness.md, The auto rule)")  # fmt: skip
        return Choice(family, keys, f"{found}, {at}", f"{lion}; {untested}" if untested else lion, rule)
    if family == "muon":
        if stages == 2:
            why = f"{found}, {at}: FDG-Muon at K = 2 uncorrected was +0.24-0.51 % from BP-Muon (docs/staleness.md)"
            return Choice(family, {}, why, rule=rule)
        keys = dict(PREDICTION)
        return Choice(family, keys, f"{found}, {at}: the forwards predicted from Muon's last update", untested, rule)
    if family == "momentum":
        if stages == 2:
            return Choice(family, {}, f"{found}, {at}: SGD-momentum at K = 2 trains at BP level uncorrected", rule=rule)
        rho = schedule.peak_lr
        why = f"{found}, {at}, peak lr {rho!r} ({schedule.name})"
        return Choice(family, {"delay_momentum": True, "delay_momentum_peak_lr": rho}, why, untested, rule)
    keys = {**PREDICTION, "delay_momentum_raise": 1.0}  # the betas family
    why = f"{found}, {at}"
    if stages >= 3:
        if schedule.total_steps is not None:
            keys["delay_lr_ticks"] = 2 * schedule.total_steps * accumulate
            why += f", {schedule.total_steps} scheduler steps ({schedule.name}): T = twice the run's ticks"
        else:
            keys["delay_lr_ticks"] = FOREVER
            why += f", no run length in {schedule.name}: T = 2**62 (a constant tau ** -1)"
    return Choice(family, dict(sorted(keys.items())), why, untested, rule)


def resolve(config: FDGConfig, optimizer: Any, scheduler: Any, stages: int) -> tuple[FDGConfig, Choice | None]:
    """``config`` with the keys its ``"auto"`` rule chose for a stage with ``optimizer`` (unchanged unless it asks
    for it and has not been resolved yet: the choice is made once, at initialize, and kept)."""
    if config.corrections not in RULE_OF or config._resolved:
        return config, None
    if optimizer is None:
        raise FDGConfigError(
            f'pipeline.fdg.corrections is "{config.corrections}" but the stage has no optimizer to read; pass one to '
            'deepspeed.initialize (or an "optimizer" block), or set corrections to "none"'
        )
    schedule = schedule_of(scheduler, optimizer)
    choice = choose(optimizer, stages, config.accumulate, config.weights, schedule, RULE_OF[config.corrections])
    return dataclasses.replace(config, _resolved=True, **choice.keys), choice


def for_engine(config: FDGConfig, engine: Any) -> FDGConfig:
    """:func:`resolve` for a built engine's stage; global rank 0 logs the choice (its stage's), or what running with
    no correction cost (Note [the cost of no correction])."""
    resolved, choice = resolve(config, engine.basic_optimizer, engine.lr_scheduler, engine.num_stages)
    notice = no_correction_line(config, engine.basic_optimizer, engine.num_stages)  # Note [the cost of no correction]
    if engine.global_rank == 0:
        if choice is not None:
            (logger.warning if choice.warning else logger.info)(choice.line())
        if notice is not None:
            logger.warning(notice)
    return resolved


def recorded(config: FDGConfig) -> dict[str, Any] | None:
    """What a checkpoint keeps of ``"auto"``'s choice: the correction keys' values (None without an ``"auto"``
    rule). The rule's name is not kept: a checkpoint resumes under any rule that chooses the same keys."""
    if config.corrections not in RULE_OF:
        return None
    return {key: getattr(config, key) for key in RULE_KEYS}


def check_resume(saved: Mapping[str, Any] | None, config: FDGConfig, where: str) -> None:
    """Refuse to resume a checkpoint whose ``"auto"`` choice differs from what this job chose."""
    now = recorded(config)
    if saved is None or now is None or dict(saved) == now:
        return
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    raise FDGConfigError(
        f'{where}: pipeline.fdg.corrections "{config.corrections}" (rule {RULE_OF[str(config.corrections)]}) chose '
        f"{_pairs(now, changed)} for this job but the checkpoint was trained with {_pairs(saved, changed)}: its "
        "optimizer, scheduler, K or accumulate differ, or it was saved under another rule (a Muon or Lion job saved "
        'under rule v1 resumes with "corrections": "auto-v1"). Resume with the job that saved it, or set the keys '
        "explicitly (remove corrections) to continue with new ones"
    )


def _pairs(keys: Mapping[str, Any], names: Sequence[str]) -> str:
    return "{" + ", ".join(f"{n}: {keys.get(n)!r}" for n in names) + "}"
