"""How ``deepspeed.initialize`` comes to build an :class:`FDGPipelineEngine` when the config asks for FDG.

:func:`guard` wraps the function ``deepspeed.initialize``; DeepSpeed's classes stay DeepSpeed's. A
call whose config has no ``pipeline.schedule`` goes straight to DeepSpeed (fdg_schedule's engine is
not even imported). A call whose config asks for FDG either builds an ``FDGPipelineEngine`` or
raises :class:`FDGConfigError` saying why and how to fix it: it never trains 1F1B in its place.

Importing this module imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

from fdg_schedule.base import config as fdg_config
from fdg_schedule.base.config import FDGConfigError

# Note [the start-up hook]
# Users run DeepSpeed scripts they do not want to edit (`deepspeed train.py --deepspeed_config
# fdg.json`), so the config alone must switch the engine. Installing the package puts
# fdg_schedule_autoinstall.pth into site-packages (setup.py ships it in wheels and in editable
# installs). Python's `site` runs its one line at every interpreter start: it imports
# _fdg_schedule_autoinstall (which uses only `sys`) and puts a finder first on sys.meta_path that
# answers no import but `deepspeed`'s. When the program imports deepspeed, deepspeed/__init__.py runs
# with DeepSpeed's own loader, then guard(deepspeed) replaces the function deepspeed.initialize by
# a wrapper (DeepSpeed 0.19.8 re-exports initialize nowhere else; `from deepspeed import initialize`
# runs after the guard and gets the wrapper) and the finder leaves sys.meta_path. `import
# fdg_schedule` arms the same finder, for checkouts used through PYTHONPATH without the .pth.
#
# Nothing else changes: deepspeed.PipelineEngine stays DeepSpeed's class, except while a call that
# asks for FDG runs (under _lock): then the name DeepSpeed's initialize looks up for a PipelineModule
# is bound to a function that builds FDGPipelineEngine, a real subclass of PipelineEngine.
#
# The guard stays armed when FDG is switched off (FDG_SCHEDULE_AUTO_INSTALL=0, uninstall()): a config
# that asks for FDG is then refused, never trained with 1F1B.

AUTO_INSTALL_ENV = "FDG_SCHEDULE_AUTO_INSTALL"
UNTESTED_DEEPSPEED_ENV = "FDG_SCHEDULE_ALLOW_UNTESTED_DEEPSPEED"
TESTED_DEEPSPEED = "==0.19.8"  # pyproject.toml's deepspeed requirement; fdg_schedule uses private names
_OFF = ("0", "false", "no", "off")

_lock = threading.RLock()
_switch: bool | None = None  # install() / uninstall(); None: the environment variable decides
_stock_initialize: dict[int, Callable[..., Any]] = {}  # id(deepspeed module) -> DeepSpeed's own initialize


def guard(deepspeed: ModuleType) -> None:
    """Wrap ``deepspeed.initialize`` so that its config picks the engine (idempotent)."""
    with _lock:
        current = getattr(deepspeed, "initialize", None)
        if current is None or getattr(current, "__fdg_schedule_guard__", False):
            return
        signature = inspect.signature(current)

        @functools.wraps(current)
        def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            return _initialize(deepspeed, current, signature, args, kwargs, switch_on=switched_on)

        initialize.__fdg_schedule_guard__ = True  # type: ignore[attr-defined]
        _stock_initialize[id(deepspeed)] = current
        deepspeed.initialize = initialize  # type: ignore[attr-defined]
        from fdg_schedule.partitioning import pipe_partition

        pipe_partition.install()  # partition_method "balanced:..." / "parts:..."; DeepSpeed's own values unchanged


def install() -> None:
    """Let ``deepspeed.initialize`` build the FDG engine for configs that ask for it, whatever the environment says."""
    global _switch
    _switch = True
    watch_deepspeed()


def uninstall() -> None:
    """Make ``deepspeed.initialize`` refuse configs that ask for FDG (it never trains 1F1B in their place).

    :func:`initialize` still builds the FDG engine.
    """
    global _switch
    _switch = False
    watch_deepspeed()


def switched_on() -> bool:
    """Whether ``deepspeed.initialize`` builds the FDG engine for a config that asks for it."""
    if _switch is not None:
        return _switch
    return os.environ.get(AUTO_INSTALL_ENV, "1").strip().lower() not in _OFF


def watch_deepspeed() -> None:
    """Guard ``deepspeed.initialize`` now if DeepSpeed is imported, else when it is."""
    import _fdg_schedule_autoinstall

    _fdg_schedule_autoinstall.watch()


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize`` that honours ``pipeline.schedule``, even with ``FDG_SCHEDULE_AUTO_INSTALL=0``.

    Same arguments and return value as ``deepspeed.initialize``.
    """
    import deepspeed

    guard(deepspeed)
    stock = _stock_initialize[id(deepspeed)]
    return _initialize(deepspeed, stock, inspect.signature(stock), args, kwargs, switch_on=lambda: True)


def check_deepspeed_version(version: str) -> None:
    """Refuse a DeepSpeed outside :data:`TESTED_DEEPSPEED` unless the user accepts the risk."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        tested = Version(version) in SpecifierSet(TESTED_DEEPSPEED)
    except InvalidVersion:
        tested = False
    if tested:
        return
    risk = (
        f"fdg_schedule was tested with deepspeed{TESTED_DEEPSPEED} and relies on private parts of its "
        f"PipelineEngine and optimizer wrappers; with deepspeed {version} a silent change there could change "
        "the gradients"
    )
    if os.environ.get(UNTESTED_DEEPSPEED_ENV, "0").strip().lower() not in _OFF:
        warnings.warn(f"{risk}; running anyway because {UNTESTED_DEEPSPEED_ENV} is set", stacklevel=3)
        return
    raise FDGConfigError(
        f'pipeline.schedule="fdg" refused: {risk}. Install deepspeed{TESTED_DEEPSPEED} (pip install '
        f'"deepspeed{TESTED_DEEPSPEED}"), or set {UNTESTED_DEEPSPEED_ENV}=1 to run at your own risk and '
        "compare a few ticks against fdg_schedule.fdg_reference"
    )


def _initialize(
    deepspeed: ModuleType,
    stock: Callable[..., Any],
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    switch_on: Callable[[], bool],
) -> tuple[Any, ...]:
    ds_config, model = _config_and_model(signature, args, kwargs)
    fdg = fdg_config.parse(ds_config) if ds_config is not None and _mentions_schedule(ds_config) else None
    if ds_config is None or fdg is None:
        result = stock(*args, **kwargs)
        _check_built(result)  # in case DeepSpeed read a config where _config_and_model did not
        return result
    if not switch_on():
        raise FDGConfigError(_switched_off_message())
    check_deepspeed_version(str(getattr(deepspeed, "__version__", "unknown")))
    _check_model(deepspeed, model)
    engine_class = _fdg_engine_class(deepspeed)
    with _pipeline_engine_bound(deepspeed, _engine_factory(engine_class, deepspeed.PipelineEngine)):
        result = stock(*args, **kwargs)
    _check_built(result)
    return result


def _config_and_model(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Mapping[str, Any] | None, Any]:
    """The config dict and model ``deepspeed.initialize`` will use, read as it reads them (0.19.8).

    None when they cannot be read here: DeepSpeed then raises its own error, or builds an engine
    that :func:`_check_built` inspects.
    """
    try:
        given = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None, None
    config = given.get("config")
    if config is None:
        config = given.get("config_params")
    for name in ("deepspeed_config", "deepscale_config"):  # --deepscale_config wins, as in DeepSpeed
        path = getattr(given.get("args"), name, None)
        if path is not None:
            config = path
    if config is None or isinstance(config, Mapping):
        return config, given.get("model")
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

        return load_ds_config(config), given.get("model")
    except Exception:  # noqa: BLE001 - DeepSpeed raises its own error when it reads the same config
        return None, given.get("model")


def _mentions_schedule(ds_config: Mapping[str, Any] | None) -> bool:
    pipeline = (ds_config or {}).get("pipeline")
    return isinstance(pipeline, Mapping) and ("schedule" in pipeline or "fdg" in pipeline)


def _switched_off_message() -> str:
    if _switch is False:
        why, undo = "fdg_schedule.uninstall() was called", "call fdg_schedule.install()"
    else:
        why, undo = f"{AUTO_INSTALL_ENV}={os.environ.get(AUTO_INSTALL_ENV)} is set", f"unset {AUTO_INSTALL_ENV}"
    return (
        f'pipeline.schedule="fdg" in ds_config, but {why}, so deepspeed.initialize does not build the FDG '
        "engine, and it never trains DeepSpeed's 1F1B in its place. Call fdg_schedule.initialize(...) (same "
        f'arguments) instead of deepspeed.initialize, or {undo}, or remove "schedule": "fdg" from the pipeline '
        "block to train with 1F1B"
    )


def _check_model(deepspeed: ModuleType, model: Any) -> None:
    from deepspeed.runtime.pipe.module import PipelineModule

    dual_pipe_v = getattr(deepspeed, "DualPipeVModule", None)
    if dual_pipe_v is not None and isinstance(model, dual_pipe_v):
        raise FDGConfigError(
            'pipeline.schedule="fdg" cannot train a DualPipeVModule: DeepSpeed builds its own DualPipeVEngine '
            "for it, with its own schedule. Build a deepspeed.pipe.PipelineModule for FDG, or remove "
            '"schedule": "fdg" from the pipeline block to train with DualPipeV'
        )
    if not isinstance(model, PipelineModule):
        raise FDGConfigError(
            f'pipeline.schedule="fdg" needs a deepspeed.pipe.PipelineModule, got {type(model).__module__}.'
            f"{type(model).__qualname__}, which DeepSpeed would train without a pipeline. Build the model as "
            'PipelineModule(layers=..., num_stages=...), or remove "schedule": "fdg" from the pipeline block'
        )
    if model._grid.get_slice_parallel_world_size() > 1:
        raise FDGConfigError(
            f"tensor (slice) model parallelism of size {model._grid.get_slice_parallel_world_size()} is not "
            'supported with pipeline.schedule="fdg"; use a PipeDataParallelTopology (pipeline x data '
            'parallel only) or train with pipeline.schedule="1f1b"'
        )
    parts = list(model.parts)
    empty = [stage for stage, (a, b) in enumerate(zip(parts[:-1], parts[1:])) if a == b]
    if empty:
        raise FDGConfigError(
            f"pipeline stages {empty} would hold no layers (partition {parts}): {len(parts) - 1} stages but "
            f"{parts[-1]} layers; use at most {parts[-1]} stages (the number of ranks / data-parallel size) or "
            "split the model into more layers"
        )
    # Tied layers across stages are trained (Note [tied layers across stages] in fdg_schedule/exchange/tied.py), with an
    # optimizer of their own: a stage holding nothing else would leave the stage's optimizer empty.
    from fdg_schedule.exchange import tied

    only_tied = tied.stages_of_only_tied_layers(model)
    if only_tied:
        raise FDGConfigError(
            f"pipeline stages {only_tied} hold only tied layers ({sorted(tied.owners(model))}), whose parameters "
            'pipeline.schedule="fdg" steps with a tied optimizer of their own, so the stage\'s optimizer would '
            "have no parameters; put a layer with parameters of its own on each stage (e.g. another "
            "partition_method), or untie the layers"
        )


def _fdg_engine_class(deepspeed: ModuleType) -> type:
    """``FDGPipelineEngine``, once sure it replaces the engine DeepSpeed would build (its own)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    chosen = deepspeed.PipelineEngine
    if chosen is not PipelineEngine:
        raise FDGConfigError(
            f'pipeline.schedule="fdg" refused: deepspeed.PipelineEngine is {_name(chosen)}, not DeepSpeed\'s '
            "PipelineEngine; something replaced it, and FDG would silently drop that replacement. Remove the "
            'code that rebinds deepspeed.PipelineEngine, or remove "schedule": "fdg" from the pipeline block'
        )
    try:
        from fdg_schedule.runtime.engine import FDGPipelineEngine
    except Exception as exc:  # an untested DeepSpeed (check_deepspeed_version was overridden)
        raise FDGConfigError(
            f"fdg_schedule could not load its engine with deepspeed {deepspeed.__version__}: {exc!r}"
        ) from exc
    return FDGPipelineEngine


def _engine_factory(engine_class: type, stock_class: type) -> Callable[..., Any]:
    def build_pipeline_engine(*args: Any, **kwargs: Any) -> Any:
        # The config exactly as DeepSpeed parsed it; a concurrent stock call from another thread gets its own engine.
        ds_config = kwargs["config_class"]._param_dict
        fdg = fdg_config.parse(ds_config)
        if fdg is None:
            return stock_class(*args, **kwargs)
        from fdg_schedule.observability import observe
        from fdg_schedule.runtime import staging

        observe.before_engine(ds_config)  # W&B offline unless logged in, one group for all stages
        staging.install()  # several ranks on one GPU over gloo: DeepSpeed's own sends through host memory
        return engine_class(*args, fdg_config=fdg, **kwargs)

    return build_pipeline_engine


@contextlib.contextmanager
def _pipeline_engine_bound(deepspeed: ModuleType, factory: Callable[..., Any]) -> Iterator[None]:
    with _lock:
        stock = deepspeed.PipelineEngine
        deepspeed.PipelineEngine = factory  # type: ignore[attr-defined]
        try:
            yield
        finally:
            deepspeed.PipelineEngine = stock  # type: ignore[attr-defined]


def _check_built(result: Any) -> None:
    """Refuse an engine other than FDG's for a config that asks for FDG, however DeepSpeed read that config."""
    engine = result[0] if isinstance(result, tuple) and result else result
    ds_config = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if not isinstance(ds_config, Mapping) or not _mentions_schedule(ds_config):
        return
    if fdg_config.parse(ds_config) is None:
        return
    engine_module = sys.modules.get("fdg_schedule.runtime.engine")
    if engine_module is None or not isinstance(engine, engine_module.FDGPipelineEngine):
        raise FDGConfigError(
            f'pipeline.schedule="fdg" in the config DeepSpeed read, but deepspeed.initialize built '
            f"{_name(type(engine))}: fdg_schedule could not see that config when the call began (deepspeed "
            f"{getattr(sys.modules.get('deepspeed'), '__version__', '?')}). Pass the config as "
            "deepspeed.initialize(config=<dict or path>) or args.deepspeed_config, or call fdg_schedule.initialize"
        )


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
