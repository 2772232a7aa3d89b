"""The ``pipeline.fdg`` config block: a frozen dataclass read from the DeepSpeed JSON, validated once.

The public keys::

    "pipeline": {
      "schedule": "fdg",              # "fdg" | "1f1b"; absent = "1f1b" (stock DeepSpeed)
      "fdg": {
        "grad_shrink": 0.5,           # beta in (0, 1]; default 1.0
        "weights": "current",         # "current" | "stashed"
        "activations": "stored",      # "stored" | "recomputed"
        "accumulate": 1,              # backward passes per optimizer step, >= 1
        "delay_lr_ticks": 0,          # T: delayed stages start at a lower learning rate, full at tick T; 0 = off
        "predict_decay": null,        # gamma in [0, 1): forwards run on predicted weights; null = off
        "predict_horizon": "own",     # "own" | "first_stage": the tick the prediction aims at
        "predict_scale": 1.0,         # p > 0: forwards on w + p * H * delta (H the horizon in steps)
        "predict_momentum": null,     # mu in (0, 1): H counts its steps as mu + mu**2 + ... + mu**H; null = off
        "delay_momentum": false,      # momentum mu of stage k taken as mu ** (1 + h_k) in its steps
        "delay_momentum_peak_lr": null,  # rho > 0: mu ** (1 + h_k * min(1, lr / rho)) instead; null = off
        "delay_momentum_raise": null, # c > 0: mu of stage k taken as mu ** (1 / (1 + c * h_k)); null = off
        "corrections": null,          # "auto": the rule's keys above chosen per stage (Note [the auto rule]);
                                      # "auto-v1" / "auto-v2": a named rule ("auto" is the newest, v2);
                                      # "none": none of the eight keys above; null: the explicit keys
        "staleness_every": 100,       # measure ||w_fwd - w_bwd|| / ||w|| every N ticks; 0 = off
        "nonfinite": "error",         # "error" | "skip": a non-finite loss or gradient on a stage
        "timeout": 60,                # seconds a stage waits for a neighbour before failing
        "transport": "auto",          # "auto" | "process_group" | "shm": same-host neighbours through shared memory
        "host_memory": "retain",      # "retain" | "system": on a CPU device, keep freed host memory in the process
        "check_every": 0,             # ticks between host reads of the non-finite flags; 0 = once per call
        "trace": null                 # {"start_tick": 0, "ticks": 64, "dir": "fdg_trace"}: a timeline
      }
    }

:func:`check_deepspeed_config` also rejects DeepSpeed settings FDG cannot honour, so that every
rank raises the same error inside ``deepspeed.initialize`` before any rank waits on another.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

SCHEDULES = ("1f1b", "fdg")
TRACE_KEYS = {"start_tick": 0, "ticks": 64, "dir": "fdg_trace"}
CORRECTIONS = ("none", "auto", "auto-v1", "auto-v2")  # "auto": the newest rule (auto_corrections.RULE_OF)
TRANSPORTS = ("auto", "process_group", "shm")  # "auto" and fdg_schedule.exchange.transports.TRANSPORTS' names
# The staleness-correction keys ``corrections`` decides (Note [the auto rule] in
# fdg_schedule.corrections.auto_corrections).
CORRECTION_KEYS = (
    "delay_lr_ticks", "predict_decay", "predict_horizon", "predict_scale", "predict_momentum", "delay_momentum",
    "delay_momentum_peak_lr", "delay_momentum_raise",
)  # fmt: skip


class FDGConfigError(ValueError):
    """A ``pipeline`` / ``pipeline.fdg`` setting FDG cannot run with; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of :data:`KEYS`: a ``pipeline.fdg`` key, the values it takes, and the fix its errors end with.

    ``kind``: "bool", "integer", "number" (an integer or a float), "choice" (one of ``choices``) or "trace" (an
    object, :func:`_check_trace`). An integer or number must be ``>= at_least``, ``> above``, ``<= at_most`` and
    ``< below`` where those are set (NaN never is; ``below=math.inf`` rules out infinity); ``allowed`` says that in
    words. ``nullable``: null (off) is allowed too.
    """

    name: str
    kind: Literal["bool", "integer", "number", "choice", "trace"]
    allowed: str = ""
    fix: str = ""
    choices: tuple[str, ...] = ()
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    nullable: bool = False


# Every pipeline.fdg key, in the order they are checked (the dataclass's). The rules between keys are RULES.
# fmt: off
KEYS: tuple[Key, ...] = (
    Key("grad_shrink", "number", "in (0, 1]", above=0, at_most=1, fix="1.0 disables gradient shrinking"),
    Key("weights", "choice", choices=("current", "stashed")),
    Key("activations", "choice", choices=("stored", "recomputed")),
    Key("accumulate", "integer", "an integer >= 1", at_least=1, fix="1 steps after every backward pass"),
    Key("delay_lr_ticks", "integer", "an integer >= 0", at_least=0,
        fix="e.g. 2000 (0 turns the delay-aware learning rate off)"),
    Key("predict_decay", "number", "in [0, 1)", at_least=0, below=1, nullable=True,
        fix="null turns weight prediction off, e.g. 0.9 turns it on"),
    Key("predict_horizon", "choice", choices=("own", "first_stage")),
    Key("predict_scale", "number", "a number > 0", above=0, below=math.inf,
        fix="e.g. 0.5 (1.0 predicts the whole horizon)"),
    Key("predict_momentum", "number", "in (0, 1)", above=0, below=1, nullable=True,
        fix="set it to the optimizer's momentum (e.g. 0.9, Adam's first beta), or null for a straight line"),
    Key("delay_momentum", "bool", fix="false turns it off"),
    Key("delay_momentum_peak_lr", "number", "a learning rate > 0", above=0, below=math.inf, nullable=True,
        fix="set it to the schedule's peak lr (e.g. 0.1), or null for off"),
    Key("delay_momentum_raise", "number", "a number > 0", above=0, below=math.inf, nullable=True,
        fix="e.g. 2.0, or null for off"),
    Key("corrections", "choice", choices=CORRECTIONS, nullable=True, fix="omit it to set the correction keys yourself"),
    Key("staleness_every", "integer", "an integer >= 0", at_least=0, fix="e.g. 100 (0 turns the staleness metric off)"),
    Key("nonfinite", "choice", choices=("error", "skip")),
    Key("timeout", "number", "> 0 seconds", above=0, fix="e.g. 60"),
    Key("transport", "choice", choices=TRANSPORTS),
    Key("host_memory", "choice", choices=("retain", "system")),
    Key("check_every", "integer", "an integer >= 0", at_least=0,
        fix="0 reads the non-finite flags once per train_batch() call"),
    Key("trace", "trace", nullable=True),
)
# fmt: on


@dataclasses.dataclass(frozen=True)
class FDGConfig:
    """How the FDG schedule trains. Defaults are the paper's algorithm without gradient shrinking."""

    grad_shrink: float = 1.0
    """beta: the gradient entering each non-last stage is multiplied by it, so stage k's gradient
    carries ``grad_shrink ** (K-1-k)``. In (0, 1]."""

    weights: str = "current"
    """Weights the delayed backward differentiates through: ``"current"`` (values at backward time,
    what the authors' code computed) or ``"stashed"`` (the weights the forward used: the exact
    delayed gradient; costs one copy of the stage's weights per micro-batch in flight)."""

    activations: str = "stored"
    """``"stored"`` keeps the forward's autograd graph until the delayed backward; ``"recomputed"``
    keeps only the stage input and RNG state and reruns the forward at backward time."""

    accumulate: int = 1
    """Backward passes per optimizer step on every stage (1 = the paper; >1 = accumulated
    decoupled learning, gradients averaged over the passes)."""

    delay_lr_ticks: int = 0
    """T, the delay-aware learning rate (Note [staleness corrections] in reference.py): the step of
    stage k in tick t uses ``lr(t) * tau_k ** -max(0, 1 - t/T)``, tau_k = max(1, delay_k / accumulate),
    so deeper-delayed stages start slower and reach the full rate at tick T. 0 turns it off."""

    predict_decay: float | None = None
    """gamma, weight prediction (Note [staleness corrections] in reference.py): each stage keeps
    ``delta <- gamma * delta + (1 - gamma) * (w_after - w_before)`` over its optimizer steps and runs
    every forward on ``w + (delay_k / accumulate) * delta``. In [0, 1); None turns it off. Costs one
    parameter-sized tensor per stage."""

    predict_horizon: str = "own"
    """How far ahead the prediction of ``predict_decay`` aims (an extension of issue 11's formula, which is
    ``"own"``). ``"own"``: stage k predicts ``h_k = delay_k / accumulate`` steps ahead, to its own update
    with the micro-batch's gradient; the last stage predicts nothing. ``"first_stage"``: stage k predicts
    ``(2(K-1) - k) / accumulate`` steps ahead, to the tick stage 0 applies the micro-batch's gradient, so
    every stage of one micro-batch's forward runs on weights aimed at one time, the last stage too
    (``(K-1) / accumulate`` steps ahead; under ``"stashed"`` its gradient is taken there, under
    ``"current"`` its backward reads the live weights). Needs ``predict_decay``."""

    predict_scale: float = 1.0
    """p > 0, how much of the horizon the prediction of ``predict_decay`` covers (an extension, issue 64): every
    forward of stage k runs on ``w + p * H_k * delta``, H_k the horizon in steps (``predict_horizon``; with
    ``predict_momentum`` its discounted count). With ``predict_decay`` 0, delta is the last applied update (for
    Muon the orthogonalised step, weight decay included) and p 1 or 0.5 are the two extrapolations of the
    marin report (2026). 1.0 (the default) is the prediction as before, bit for bit. Needs ``predict_decay``."""

    predict_momentum: float | None = None
    """mu in (0, 1), a momentum look-ahead for the prediction of ``predict_decay`` (an extension, issue 64): the
    horizon's h steps count as ``mu + mu**2 + ... + mu**h = mu * (1 - mu**h) / (1 - mu)`` (for any real h),
    so every forward of stage k runs on ``w + p * mu * (1 - mu**h) / (1 - mu) * delta``. With ``predict_decay``
    0 and SGD with momentum mu, delta is the heavy-ball velocity and h = 1 gives Nesterov's look-ahead point
    ``w + mu * v``; a larger h follows that velocity as it decays over the h steps the gradient is delayed by, if
    no new gradient came. Set mu to the optimizer's momentum (Adam's first beta). None: ``h`` itself (a straight
    line). Needs ``predict_decay``."""

    delay_momentum: bool = False
    """Delay-aware momentum (Note [staleness corrections] in reference.py): the step of stage k uses
    momentum ``mu ** (1 + h_k)``, h_k = delay_k / accumulate, where mu is each param group's
    ``momentum`` (SGD, RMSprop) or first beta (Adam, AdamW, Lion): a delayed gradient already carries
    the memory of h_k steps, so the stage keeps less of it. False turns it off."""

    delay_momentum_peak_lr: float | None = None
    """rho, with ``delay_momentum``: the step of stage k uses momentum ``mu ** (1 + h_k * min(1, lr / rho))``,
    where lr is the param group's learning rate in that step as the optimizer and scheduler give it
    (before ``delay_lr_ticks``' factor). At or above rho the stage steps as with ``delay_momentum``
    alone; as a schedule decays the lr below rho the delayed stage's momentum returns towards mu,
    since a step of a smaller lr moves the weights less while its gradient waits. Set rho to the
    schedule's peak lr. None: ``mu ** (1 + h_k)`` at every lr."""

    delay_momentum_raise: float | None = None
    """c > 0: the step of stage k uses momentum ``mu ** (1 / (1 + c * h_k))``, h_k = delay_k / accumulate, mu
    each param group's ``momentum`` or first beta as for ``delay_momentum``: the opposite direction. The
    stage's momentum then averages over about ``1 + c * h_k`` times as many steps (for mu near 1,
    ``1 - mu ** (1/n)`` is about ``(1 - mu) / n``), so its steps turn more slowly and the steps still to
    come while a micro-batch's gradient travels are closer to the ones already taken (what weight
    prediction extrapolates). The last stage (h = 0) keeps mu. Cannot be combined with ``delay_momentum``.
    An extension of issue 11's corrections, added on the GPT-2 (AdamW) evidence in docs/staleness.md.
    None: off."""

    corrections: str | None = None
    """``"auto"``: the staleness-correction keys (``delay_lr_ticks``, ``predict_decay``, ``predict_horizon``,
    ``delay_momentum``, ``delay_momentum_peak_lr``, ``delay_momentum_raise``) are chosen at
    ``deepspeed.initialize`` for each stage from its optimizer, K, ``accumulate`` and the LR scheduler (Note
    [the auto rule] in :mod:`fdg_schedule.corrections.auto_corrections`; it leaves ``predict_scale`` and
    ``predict_momentum`` at their defaults), by the newest rule (v2); ``"auto-v1"`` / ``"auto-v2"``: by that rule;
    ``"none"``: none of them (the paper's FDG); None: the keys as given. With ``"auto"``, a named rule or ``"none"``
    the block sets none of those keys (nor ``predict_scale``, ``predict_momentum``) itself."""

    _resolved: bool = dataclasses.field(default=False, repr=False)
    """Internal: ``corrections: "auto"`` has filled in its keys
    (:func:`fdg_schedule.corrections.auto_corrections.resolve`);
    resolving again keeps them. Not a ``pipeline.fdg`` key."""

    staleness_every: int = 100
    """N: every N ticks each delayed stage measures its staleness, the relative distance
    ``||w_fwd - w_bwd|| / ||w_bwd||`` between the weights the forward of the micro-batch entering it
    at that tick used and the weights that micro-batch's gradient is applied to (measured at its
    backward). Reported in ``engine.fdg_stats["staleness"]``, W&B and the trace; 0 turns it off."""

    nonfinite: str = "error"
    """A non-finite loss or gradient on a stage: ``"error"`` stops with an error naming the stage and
    tick; ``"skip"`` drops that stage's optimizer step (counted in ``engine.fdg_stats["skipped"]``)."""

    timeout: float = 60.0
    """Seconds a stage waits for a neighbour's message before it fails with an error naming the
    neighbour (a rank that died or stopped sending)."""

    transport: str = "auto"
    """How a stage's per-tick messages reach its neighbours: ``"process_group"`` through DeepSpeed's
    process group (gloo or NCCL); ``"shm"``: neighbours on the same host through shared memory, with
    no transport thread (Note [shared-memory transport] in :mod:`fdg_schedule.exchange.shm_link`; Linux, host
    memory and gloo only), neighbours on other hosts through the group as before; ``"auto"`` (the default):
    ``"shm"`` where it can run (Linux, a stage on the CPU with gloo: the exchange's blocking path), else
    ``"process_group"`` (Note [the fastest transport by default] in :mod:`fdg_schedule.exchange.transports`). The
    math is the same. A new transport: its name in :data:`TRANSPORTS` and in ``exchange.transports.TRANSPORTS``."""

    host_memory: str = "retain"
    """On a CPU device, what the process does with freed host memory (:mod:`fdg_schedule.base.host_memory`):
    ``"retain"`` (the default) keeps it, as a caching allocator keeps device memory, so a tick's tensors reuse
    pages already mapped instead of faulting fresh zeroed ones in (page faults cost FDG's CPU stages 10-15 %
    of a tick on the plain conv net of docs/performance.md); ``"system"``: glibc's default, which hands large
    freed blocks back to the kernel. Process-wide, set when the engine is built; nothing on other devices."""

    check_every: int = 0
    """Ticks between host reads of the non-finite flags (Note [no host sync in a tick] in
    :mod:`fdg_schedule.base.guards`): 0 reads them once, at the end of each ``train_batch()`` / ``drain()``
    call; N >= 1 also every N ticks inside a call (an earlier stop, one host synchronisation each)."""

    trace: Mapping[str, Any] | None = None
    """Opt-in timeline of per-stage events: ``{"start_tick": 0, "ticks": 64, "dir": "fdg_trace"}``
    (any key may be omitted); None records nothing."""

    def __post_init__(self) -> None:
        for key in KEYS:
            value = getattr(self, key.name)
            if value is None and key.nullable:
                continue
            if key.kind == "trace":
                object.__setattr__(self, key.name, _check_trace(value))
            else:
                _check_key(key, value)
        for rule in RULES:
            rule(self)

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None) -> FDGConfig:
        """Build from the ``pipeline.fdg`` dict, rejecting unknown keys."""
        block = {} if block is None else block
        if not isinstance(block, Mapping):
            raise FDGConfigError(f"pipeline.fdg must be a JSON object, got {type(block).__name__} {block!r}")
        known = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise FDGConfigError(f"unknown key(s) {unknown} in pipeline.fdg of ds_config; known keys: {known}")
        explicit, mode = [key for key in CORRECTION_KEYS if key in block], block.get("corrections")
        if mode in CORRECTIONS and explicit:
            raise FDGConfigError(
                f"pipeline.fdg.corrections is {mode!r} and pipeline.fdg sets {explicit} too (ds_config): "
                f'"{mode}" decides those keys itself; remove {explicit}, or remove corrections to set the keys yourself'
            )
        return cls(**block)


def _horizon_needs_prediction(config: FDGConfig) -> None:
    if config.predict_horizon != "own" and config.predict_decay is None:
        raise FDGConfigError(
            f"predict_horizon is {config.predict_horizon!r} but predict_decay is null (pipeline.fdg in "
            "ds_config): the horizon is that of the weight prediction; set predict_decay (e.g. 0.0), "
            'or remove predict_horizon (default "own")'
        )


def _prediction_keys_need_prediction(config: FDGConfig) -> None:
    for key, off in (("predict_scale", "1.0"), ("predict_momentum", "null")):
        value = getattr(config, key)
        if value != getattr(FDGConfig, key) and config.predict_decay is None:
            raise FDGConfigError(
                f"{key} is {value!r} but predict_decay is null (pipeline.fdg in ds_config): it shapes the weight "
                f"prediction; set predict_decay (e.g. 0.0: the last applied update), or set {key} to {off}"
            )


def _peak_lr_needs_delay_momentum(config: FDGConfig) -> None:
    if config.delay_momentum_peak_lr is not None and not config.delay_momentum:
        raise FDGConfigError(
            f"delay_momentum_peak_lr is {config.delay_momentum_peak_lr!r} but delay_momentum is false "
            "(pipeline.fdg in ds_config); set delay_momentum to true, or remove delay_momentum_peak_lr"
        )


def _raise_excludes_delay_momentum(config: FDGConfig) -> None:
    if config.delay_momentum_raise is not None and config.delay_momentum:
        raise FDGConfigError(
            f"delay_momentum_raise is {config.delay_momentum_raise!r} and delay_momentum is true (pipeline.fdg "
            "in ds_config): one lowers the delayed stages' momentum, the other raises it; keep one of them"
        )


def _no_corrections_sets_no_correction_keys(config: FDGConfig) -> None:
    moved = [k for k in CORRECTION_KEYS if getattr(config, k) != getattr(FDGConfig, k)]
    if config.corrections == "none" and moved:
        raise FDGConfigError(
            f'pipeline.fdg.corrections is "none" but {moved} are set (pipeline.fdg in ds_config): "none" is FDG '
            "without staleness corrections; remove those keys, or remove corrections to use them"
        )


def _shm_needs_linux(config: FDGConfig) -> None:
    if config.transport == "shm" and not sys.platform.startswith("linux"):
        raise FDGConfigError(
            f'transport "shm" needs Linux (/dev/shm and abstract Unix sockets); this is {sys.platform} '
            '(pipeline.fdg.transport in ds_config): remove the key or set it to "process_group"'
        )


# Checked in this order once every key has passed its row of KEYS: rules between keys, or beyond a key's values.
RULES = (_horizon_needs_prediction, _prediction_keys_need_prediction, _peak_lr_needs_delay_momentum,
         _raise_excludes_delay_momentum, _no_corrections_sets_no_correction_keys, _shm_needs_linux)  # fmt: skip


def schedule_name(pipeline: Mapping[str, Any] | None) -> str:
    """The schedule a ``pipeline`` block asks for: ``"fdg"`` or ``"1f1b"`` (the default)."""
    name = (pipeline or {}).get("schedule", "1f1b")
    if not isinstance(name, str) or name.lower() not in SCHEDULES:
        raise FDGConfigError(
            f"pipeline.schedule must be one of {list(SCHEDULES)}, got {name!r} (ds_config); "
            "omit it for DeepSpeed's own 1F1B schedule"
        )
    return name.lower()


def parse(ds_config: Mapping[str, Any]) -> FDGConfig | None:
    """The FDG settings of a whole DeepSpeed config dict, or None when it does not ask for FDG.

    Raises :class:`FDGConfigError` for a bad ``pipeline`` block or a DeepSpeed setting FDG cannot
    run with (see :func:`check_deepspeed_config`).
    """
    pipeline = ds_config.get("pipeline") or {}
    if schedule_name(pipeline) != "fdg":
        if "fdg" in pipeline:
            raise FDGConfigError(
                'pipeline.fdg is set but pipeline.schedule is not "fdg"; add "schedule": "fdg" '
                "to the pipeline block, or remove pipeline.fdg to train with 1F1B"
            )
        return None
    fdg = FDGConfig.from_dict(pipeline.get("fdg"))
    check_deepspeed_config(ds_config)
    return fdg


def check_deepspeed_config(ds_config: Mapping[str, Any]) -> None:
    """Reject DeepSpeed settings FDG cannot honour (fp16 is supported: Note [loss scale per stage])."""
    if (ds_config.get("amp") or {}).get("enabled", False):
        raise FDGConfigError(
            'amp.enabled=true is not supported with pipeline.schedule="fdg"; use "fp16": {"enabled": true} '
            "(DeepSpeed's fp16 with a loss scale per stage), bf16 or fp32"
        )
    _check_autocast(ds_config.get("torch_autocast") or {})
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1):
        raise FDGConfigError(
            f'zero_optimization.stage={stage!r} is not supported with pipeline.schedule="fdg" '
            "(DeepSpeed pipelines allow ZeRO 0 or 1); set zero_optimization.stage to 1 to shard "
            "optimizer state"
        )
    if "gradient_accumulation_dtype" in (ds_config.get("data_types") or {}):
        dtype = ds_config["data_types"]["gradient_accumulation_dtype"]
        if dtype not in ("fp32", "float32", "torch.float32"):
            raise FDGConfigError(
                f"data_types.gradient_accumulation_dtype={dtype!r} is not supported with FDG; "
                "remove it (fp32 accumulation)"
            )


def _check_autocast(autocast: Mapping[str, Any]) -> None:
    """Note [no autocast]: DeepSpeed's ``torch_autocast`` cannot train FDG correctly, in either dtype.

    fp16: DeepSpeed scales the last stage's loss with a ``GradScaler`` and unscales only in its own
    optimizer step, which FDG's stage-local step does not run, so every stage would train on
    gradients times the scale. bf16: autocast caches a low-precision copy of each weight at forward
    time and autograd saves that copy, so the delayed backward of ``weights="current"`` would read
    forward-time weights, not current ones. DeepSpeed's ``bf16`` mode (bf16 weights, fp32 master
    copy) has neither problem, nor its ``fp16`` mode (fp16 weights, fp32 masters, a loss scale per
    stage: Note [loss scale per stage] in fdg_schedule.precision.loss_scale).
    """
    if not autocast.get("enabled", False):
        return
    dtype = autocast.get("dtype", "bfloat16")
    if str(dtype) in ("fp16", "float16", "torch.float16", "half"):
        why = (
            "DeepSpeed scales the last stage's loss and unscales it only in its own optimizer step, so every stage "
            "would train on scaled gradients"
        )
        fix = (
            'use "fp16": {"enabled": true} (fp16 weights with fp32 masters and a loss scale per stage, first-stage '
            'inputs in fp16), bf16 ("bf16": {"enabled": true}) or fp32'
        )
    else:
        why = "autocast's forward-time weight casts are what the delayed backward would read, not the current weights"
        fix = 'use bf16 ("bf16": {"enabled": true}, first-stage inputs in bf16) or fp32'
    raise FDGConfigError(
        f'torch_autocast.enabled=true (dtype {dtype!r}) is not supported with pipeline.schedule="fdg": {why}; '
        f"remove torch_autocast and {fix}"
    )


def _check_trace(trace: Any) -> dict[str, Any]:
    if not isinstance(trace, Mapping):
        raise FDGConfigError(f"trace must be a JSON object or null, got {trace!r} (pipeline.fdg.trace in ds_config)")
    unknown = sorted(set(trace) - set(TRACE_KEYS))
    if unknown:
        raise FDGConfigError(f"unknown key(s) {unknown} in pipeline.fdg.trace; known keys: {sorted(TRACE_KEYS)}")
    merged = {**TRACE_KEYS, **trace}
    _check_key(Key("trace.start_tick", "integer", "an integer >= 0", at_least=0), merged["start_tick"])
    _check_key(Key("trace.ticks", "integer", "an integer >= 1", at_least=1), merged["ticks"])
    if not isinstance(merged["dir"], str):
        raise FDGConfigError(f"trace.dir must be a path string, got {merged['dir']!r} (pipeline.fdg.trace.dir)")
    return merged


# Each kind of value: how an error says it, and the Python types JSON gives it (true/false only to "bool").
_KINDS = {"bool": ("true or false", (bool,)), "integer": ("an integer", (int,)), "number": ("a number", (int, float))}


def _check_key(key: Key, value: Any) -> None:
    """Raise :class:`FDGConfigError` unless ``value`` is of ``key``'s kind and within its bounds."""
    if key.kind == "choice":
        if value not in key.choices:
            _reject(key, f"one of {list(key.choices)}", repr(value))
        return
    in_words, types = _KINDS[key.kind]
    if not isinstance(value, types) or (isinstance(value, bool) and key.kind != "bool"):
        _reject(key, in_words, f"{type(value).__name__} {value!r}")
    if not _within_bounds(key, value):
        _reject(key, key.allowed + (" or null" if key.nullable else ""), repr(value))


def _within_bounds(key: Key, value: Any) -> bool:
    return (
        (key.at_least is None or value >= key.at_least)
        and (key.above is None or value > key.above)
        and (key.at_most is None or value <= key.at_most)
        and (key.below is None or value < key.below)
    )


def _reject(key: Key, must_be: str, got: str) -> NoReturn:
    fix = f"; {key.fix}" if key.fix else ""
    raise FDGConfigError(f"{key.name} must be {must_be}, got {got} (pipeline.fdg.{key.name} in ds_config){fix}")
