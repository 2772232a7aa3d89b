"""Validation of the ``pipeline`` / ``pipeline.fdg`` config block (pure, no process group)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from fdg_schedule.base.config import KEYS, FDGConfig, FDGConfigError, Key, parse


def _ds(fdg: dict | None = None, **extra) -> dict:
    pipeline: dict = {"schedule": "fdg"}
    if fdg is not None:
        pipeline["fdg"] = fdg
    return {"train_micro_batch_size_per_gpu": 2, "pipeline": pipeline, **extra}


def test_defaults_are_the_paper_without_shrinking() -> None:
    assert parse(_ds()) == FDGConfig(grad_shrink=1.0, weights="current", activations="stored", accumulate=1)
    full = {"grad_shrink": 0.5, "weights": "stashed", "activations": "recomputed", "accumulate": 4}
    assert parse(_ds(full)) == FDGConfig(**full)


def test_staleness_corrections_are_off_by_default_and_read_from_the_block() -> None:
    default = parse(_ds())
    assert default is not None
    assert default.delay_lr_ticks == 0 and default.predict_decay is None and default.staleness_every == 100
    assert parse(_ds({"staleness_every": 0})) == FDGConfig(staleness_every=0)
    config = parse(_ds({"delay_lr_ticks": 2000, "predict_decay": 0.9}))
    assert config == FDGConfig(delay_lr_ticks=2000, predict_decay=0.9)
    assert parse(_ds({"predict_decay": 0})) == FDGConfig(predict_decay=0)  # gamma 0: delta is the last step
    assert parse(_ds({"predict_decay": None})) == FDGConfig()
    assert default.predict_horizon == "own"
    scaled = {"predict_decay": 0.0, "predict_scale": 0.5, "predict_momentum": 0.9}
    assert parse(_ds(scaled)) == FDGConfig(predict_decay=0.0, predict_scale=0.5, predict_momentum=0.9)
    assert parse(_ds({"predict_scale": 1.0})) == FDGConfig()  # the default alone needs no prediction
    first = {"predict_decay": 0.0, "predict_horizon": "first_stage"}
    assert parse(_ds(first)) == FDGConfig(predict_decay=0.0, predict_horizon="first_stage")
    assert default.delay_momentum is False
    assert default.transport == "auto"  # Note [the fastest transport by default]
    assert parse(_ds({"transport": "shm"})) == FDGConfig(transport="shm")
    assert parse(_ds({"transport": "process_group"})) == FDGConfig(transport="process_group")
    assert default.host_memory == "retain"
    assert parse(_ds({"host_memory": "system"})) == FDGConfig(host_memory="system")
    assert parse(_ds({"delay_momentum": True})) == FDGConfig(delay_momentum=True)
    assert default.delay_momentum_peak_lr is None
    both = {"delay_momentum": True, "delay_momentum_peak_lr": 0.1}
    assert parse(_ds(both)) == FDGConfig(delay_momentum=True, delay_momentum_peak_lr=0.1)
    assert default.delay_momentum_raise is None
    assert parse(_ds({"delay_momentum_raise": 2})) == FDGConfig(delay_momentum_raise=2.0)


@pytest.mark.parametrize("pipeline", [None, {}, {"schedule": "1f1b"}, {"schedule": "1F1B", "stages": 2}])
def test_no_fdg_means_stock_deepspeed(pipeline) -> None:
    cfg = {} if pipeline is None else {"pipeline": pipeline}
    assert parse(cfg) is None


@pytest.mark.parametrize(
    "ds_config,message",
    [
        (_ds({"grad_shrink": 1.5}), "grad_shrink must be in (0, 1], got 1.5 (pipeline.fdg.grad_shrink"),
        (_ds({"grad_shrink": 0}), "grad_shrink must be in (0, 1], got 0"),
        (_ds({"grad_shrink": float("nan")}), "grad_shrink must be in (0, 1], got nan"),
        (_ds({"grad_shrink": "0.5"}), "grad_shrink must be a number, got str '0.5'"),
        (_ds({"grad_shrink": True}), "grad_shrink must be a number, got bool True"),
        (_ds({"weights": "old"}), "weights must be one of ['current', 'stashed'], got 'old'"),
        (_ds({"activations": "checkpointed"}), "activations must be one of ['stored', 'recomputed']"),
        (_ds({"accumulate": 0}), "accumulate must be an integer >= 1, got 0"),
        (_ds({"accumulate": 2.0}), "accumulate must be an integer, got float 2.0"),
        (_ds({"beta": 0.5}), "unknown key(s) ['beta'] in pipeline.fdg of ds_config; known keys: ['grad_shrink',"),
        (_ds([0.5]), "pipeline.fdg must be a JSON object, got list"),
        ({"pipeline": {"schedule": "gpipe"}}, "pipeline.schedule must be one of ['1f1b', 'fdg'], got 'gpipe'"),
        ({"pipeline": {"fdg": {"grad_shrink": 0.5}}}, 'pipeline.fdg is set but pipeline.schedule is not "fdg"'),
        (_ds(amp={"enabled": True}), 'amp.enabled=true is not supported with pipeline.schedule="fdg"; use "fp16"'),
        (
            _ds(torch_autocast={"enabled": True, "dtype": "fp16"}),
            "torch_autocast.enabled=true (dtype 'fp16') is not supported with pipeline.schedule=\"fdg\": "
            "DeepSpeed scales the last stage's loss",
        ),
        (
            _ds(torch_autocast={"enabled": True, "dtype": "torch.float16"}),
            'remove torch_autocast and use "fp16": {"enabled": true} (fp16 weights with fp32 masters and a loss scale',
        ),
        (_ds(torch_autocast={"enabled": True, "dtype": "bfloat16"}), "autocast's forward-time weight casts"),
        (_ds(torch_autocast={"enabled": True}), "remove torch_autocast and use bf16"),
        (_ds(zero_optimization={"stage": 2}), "zero_optimization.stage=2 is not supported"),
        (_ds(zero_optimization={"stage": 3}), "set zero_optimization.stage to 1"),
        (_ds({"delay_momentum": 1}), "delay_momentum must be true or false, got int 1 (pipeline.fdg.delay_momentum"),
        (_ds({"delay_momentum": "true"}), "got str 'true' (pipeline.fdg.delay_momentum in ds_config); false turns"),
        (
            _ds({"delay_momentum_peak_lr": 0.1}),
            "delay_momentum_peak_lr is 0.1 but delay_momentum is false (pipeline.fdg in ds_config); set delay_momentum",
        ),
        (
            _ds({"delay_momentum": True, "delay_momentum_peak_lr": 0}),
            "delay_momentum_peak_lr must be a learning rate > 0 or null, got 0 (pipeline.fdg.delay_momentum_peak_lr",
        ),
        (
            _ds({"delay_momentum": True, "delay_momentum_peak_lr": "0.1"}),
            "delay_momentum_peak_lr must be a number, got str '0.1' (pipeline.fdg.delay_momentum_peak_lr in ds_config)",
        ),
        (
            _ds({"delay_momentum_raise": 0}),
            "delay_momentum_raise must be a number > 0 or null, got 0 (pipeline.fdg.delay_momentum_raise in ds_config)",
        ),
        (_ds({"delay_momentum_raise": float("inf")}), "delay_momentum_raise must be a number > 0 or null, got inf"),
        (_ds({"delay_momentum_raise": "2"}), "delay_momentum_raise must be a number, got str '2' (pipeline.fdg."),
        (
            _ds({"delay_momentum_raise": 2.0, "delay_momentum": True}),
            "delay_momentum_raise is 2.0 and delay_momentum is true (pipeline.fdg in ds_config): one lowers",
        ),
        (_ds({"delay_lr_ticks": -1}), "delay_lr_ticks must be an integer >= 0, got -1 (pipeline.fdg.delay_lr_ticks"),
        (_ds({"delay_lr_ticks": -1}), "0 turns the delay-aware learning rate off"),
        (_ds({"delay_lr_ticks": 10.5}), "delay_lr_ticks must be an integer, got float 10.5"),
        (_ds({"delay_lr_ticks": True}), "delay_lr_ticks must be an integer, got bool True (pipeline.fdg"),
        (_ds({"delay_lr_ticks": "100"}), "got str '100' (pipeline.fdg.delay_lr_ticks in ds_config); e.g. 2000"),
        (_ds({"predict_decay": 1.0}), "predict_decay must be in [0, 1) or null, got 1.0 (pipeline.fdg.predict_decay"),
        (_ds({"predict_decay": -0.1}), "got -0.1 (pipeline.fdg.predict_decay in ds_config); null turns weight"),
        (_ds({"predict_decay": float("nan")}), "predict_decay must be in [0, 1) or null, got nan"),
        (_ds({"predict_decay": "0.9"}), "predict_decay must be a number, got str '0.9' (pipeline.fdg.predict_decay"),
        (_ds({"predict_decay": False}), "predict_decay must be a number, got bool False"),
        (
            _ds({"predict_decay": 0.0, "predict_horizon": "stage0"}),
            "predict_horizon must be one of ['own', 'first_stage'], got 'stage0' (pipeline.fdg.predict_horizon",
        ),
        (
            _ds({"predict_horizon": "first_stage"}),
            "predict_horizon is 'first_stage' but predict_decay is null (pipeline.fdg in ds_config): the horizon",
        ),
        (
            _ds({"predict_decay": 0.0, "predict_scale": 0}),
            "predict_scale must be a number > 0, got 0 (pipeline.fdg.predict_scale in ds_config); e.g. 0.5",
        ),
        (
            _ds({"predict_decay": 0.0, "predict_momentum": 1.0}),
            "predict_momentum must be in (0, 1) or null, got 1.0 (pipeline.fdg.predict_momentum in ds_config); set "
            "it to the optimizer's momentum",
        ),
        (
            _ds({"predict_scale": 0.5}),
            "predict_scale is 0.5 but predict_decay is null (pipeline.fdg in ds_config): it shapes the weight "
            "prediction; set predict_decay (e.g. 0.0: the last applied update), or set predict_scale to 1.0",
        ),
        (
            _ds({"predict_momentum": 0.9}),
            "predict_momentum is 0.9 but predict_decay is null (pipeline.fdg in ds_config): it shapes the weight "
            "prediction; set predict_decay (e.g. 0.0: the last applied update), or set predict_momentum to null",
        ),
        (
            _ds({"corrections": "auto", "predict_scale": 0.5}),
            "pipeline.fdg.corrections is 'auto' and pipeline.fdg sets ['predict_scale'] too",
        ),
        (_ds({"staleness_every": -5}), "staleness_every must be an integer >= 0, got -5 (pipeline.fdg.staleness_every"),
        (_ds({"staleness_every": 1.5}), "staleness_every must be an integer, got float 1.5 (pipeline.fdg"),
        (_ds({"nonfinite": "ignore"}), "nonfinite must be one of ['error', 'skip'], got 'ignore'"),
        (_ds({"timeout": 0}), "timeout must be > 0 seconds, got 0 (pipeline.fdg.timeout"),
        (
            _ds({"transport": "tcp"}),
            "transport must be one of ['auto', 'process_group', 'shm'], got 'tcp' "
            "(pipeline.fdg.transport in ds_config)",
        ),
        (_ds({"timeout": "60"}), "timeout must be a number, got str '60'"),
        (_ds({"check_every": -1}), "check_every must be an integer >= 0, got -1 (pipeline.fdg.check_every"),
        (_ds({"check_every": 2.5}), "check_every must be an integer, got float 2.5"),
        (_ds({"trace": {"tick": 3}}), "unknown key(s) ['tick'] in pipeline.fdg.trace; known keys:"),
        (_ds({"trace": {"ticks": 0}}), "trace.ticks must be an integer >= 1, got 0"),
        (_ds({"trace": "yes"}), "trace must be a JSON object or null, got 'yes'"),
    ],
)
def test_bad_config_is_rejected_with_value_key_and_fix(ds_config: dict, message: str) -> None:
    with pytest.raises(FDGConfigError) as err:
        parse(ds_config)
    assert message in str(err.value)


def test_supported_precision_and_zero() -> None:
    assert parse(_ds(bf16={"enabled": True}, zero_optimization={"stage": 1})) is not None
    assert parse(_ds(fp16={"enabled": False})) is not None
    # fp16 with DeepSpeed's loss-scale keys, with and without ZeRO-1 (Note [loss scale per stage])
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2, "min_loss_scale": 1}
    assert parse(_ds(fp16=fp16)) is not None
    assert parse(_ds(fp16=fp16, zero_optimization={"stage": 1})) is not None
    assert parse(_ds(torch_autocast={"enabled": False, "dtype": "fp16"})) is not None


# Written out apart from config.KEYS, so that a wrong or missing row fails: for every pipeline.fdg key a value of the
# wrong type, and values of the right type outside the key's range (none where the type is all it asks).
WRONG_VALUES: dict[str, tuple[Any, list[Any]]] = {
    "grad_shrink": ("0.5", [1.5, 0, -0.5, math.nan]),
    "weights": (1, ["old"]),
    "activations": (True, ["checkpointed"]),
    "accumulate": (2.0, [0, -1]),
    "delay_lr_ticks": (True, [-1]),
    "predict_decay": ("0.9", [1.0, -0.1, math.nan]),
    "predict_horizon": (0, ["stage0"]),
    "predict_scale": ("1", [0, -0.5, math.inf, math.nan]),
    "predict_momentum": (True, [0, 1.0, -0.1, math.nan]),
    "delay_momentum": (1, []),
    "delay_momentum_peak_lr": ("0.1", [0, -0.1, math.inf, math.nan]),
    "delay_momentum_raise": ([2.0], [0, -1.0, math.inf, math.nan]),
    "corrections": (1, ["Auto"]),
    "staleness_every": (1.5, [-5]),
    "nonfinite": (None, ["ignore"]),
    "timeout": ("60", [0, -1.0, math.nan]),
    "transport": (0, ["tcp"]),
    "host_memory": (False, ["keep"]),
    "check_every": (2.5, [-1]),
    "trace": ("yes", []),  # its own keys' ranges: test_bad_config_is_rejected_with_value_key_and_fix
}
NULLABLE = {"predict_decay", "predict_momentum", "delay_momentum_peak_lr", "delay_momentum_raise", "corrections",
            "trace"}  # fmt: skip
ALONGSIDE = {  # what a key needs to be accepted (config.RULES)
    "delay_momentum_peak_lr": {"delay_momentum": True},
    "predict_scale": {"predict_decay": 0.0},
    "predict_momentum": {"predict_decay": 0.0},
}


def test_the_table_has_a_row_for_every_key_in_the_dataclass_order() -> None:
    fields = [field.name for field in dataclasses.fields(FDGConfig) if not field.name.startswith("_")]
    assert [key.name for key in KEYS] == fields
    assert sorted(WRONG_VALUES) == sorted(fields)
    assert {key.name for key in KEYS if key.nullable} == NULLABLE


def _rejected(block: dict[str, Any]) -> str:
    with pytest.raises(FDGConfigError) as err:
        FDGConfig.from_dict(block)
    return str(err.value)


@pytest.mark.parametrize("key", KEYS, ids=lambda key: key.name)
def test_every_key_rejects_a_wrong_type_and_an_out_of_range_value_naming_the_value_and_the_key(key: Key) -> None:
    wrong_type, out_of_range = WRONG_VALUES[key.name]
    for value in [wrong_type, *out_of_range]:
        assert f"{value!r} (pipeline.fdg.{key.name} in ds_config)" in _rejected({key.name: value})
    if key.name in NULLABLE:
        FDGConfig.from_dict({key.name: None})  # off
    else:
        assert f"None (pipeline.fdg.{key.name} in ds_config)" in _rejected({key.name: None})


def _just_inside_and_outside(key: Key) -> tuple[list[float], list[float]]:
    """Values at or next to each bound of a row: the ones it allows, and the ones it does not."""

    def next_to(bound: float, direction: int) -> float:
        return bound + direction if key.kind == "integer" else math.nextafter(bound, direction * math.inf)

    inside: list[float] = []
    outside: list[float] = []
    if key.at_least is not None:
        inside.append(key.at_least)
        outside.append(next_to(key.at_least, -1))
    if key.above is not None:
        inside.append(next_to(key.above, +1))
        outside.append(key.above)
    if key.at_most is not None:
        inside.append(key.at_most)
        outside.append(next_to(key.at_most, +1))
    if key.below is not None:
        inside.append(next_to(key.below, -1))
        outside.append(key.below)
    return inside, outside


@pytest.mark.parametrize("key", [key for key in KEYS if key.kind in ("integer", "number")], ids=lambda key: key.name)
def test_the_bounds_of_each_row_are_the_ones_its_error_names(key: Key) -> None:
    inside, outside = _just_inside_and_outside(key)
    assert outside, f"{key.name} has no bound"
    alongside = ALONGSIDE.get(key.name, {})
    for value in inside:
        FDGConfig.from_dict({key.name: value, **alongside})
    for value in outside + ([math.nan] if key.kind == "number" else []):
        message = _rejected({key.name: value, **alongside})
        assert message.startswith(f"{key.name} must be {key.allowed}") and f"got {value!r} (pipeline" in message


def test_every_key_is_checked_before_the_rules_between_keys() -> None:
    # predict_horizon without predict_decay breaks a rule; the bad timeout, a later key, is reported first
    assert "timeout must be > 0 seconds" in _rejected({"predict_horizon": "first_stage", "timeout": 0})
