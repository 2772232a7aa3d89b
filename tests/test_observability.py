"""Observability: per-stage W&B runs read back from the offline files, traces and charts, CSV monitor.

One real 2-rank job (K = 2, toy model) trains under FDG with W&B (offline), a trace window and
DeepSpeed's CSV monitor all on, then the same ranks trace a stock 1F1B engine; the tests below
check what those runs left on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import toy
from dist_harness import run_ranks

from fdg_schedule.observability import tracking
from fdg_schedule.observability.view import MicroBatchNumbers
from fdg_schedule.sched.schedule import AdvanceTick

GAS, CALLS, WINDOW = 3, 3, {"start_tick": 1, "ticks": 6}
_COLLECTIVES = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
                "all_gather_into_tensor", "reduce_scatter_tensor", "barrier", "reduce", "gather")  # fmt: skip


# -- rank side ------------------------------------------------------------------------------------


def _config(tmp: Path, schedule: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    if schedule == "fdg":
        trace = {**WINDOW, "dir": str(tmp / "fdg_trace")}
        # the staleness corrections and metric on: their keys in W&B and the trace, no new collective
        fdg = {"grad_shrink": 0.5, "trace": trace, "staleness_every": 2, "delay_lr_ticks": 100, "predict_decay": 0.5}
        cfg["pipeline"] = {"schedule": "fdg", "fdg": fdg}
        cfg["wandb"] = {"enabled": True, "project": "fdg-test"}
        cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp / "csv"), "job_name": "fdg"}
    return cfg


def _engine(cfg: dict[str, Any]) -> tuple[Any, list[Any]]:
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(layers=toy.layers(), num_stages=2, loss_fn=toy.loss_fn, partition_method="uniform")
    optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=optimizer, model_parameters=model.parameters())
    return engine, toy.micro_batches(GAS * CALLS, 4)


@contextlib.contextmanager
def _collectives_recorded() -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Record every torch.distributed collective called inside the block, with its group's ranks."""
    import torch.distributed as dist

    seen: list[tuple[str, tuple[int, ...]]] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            ranks = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
            seen.append((name, tuple(ranks)))
            return fn(*args, **kwargs)

        return traced

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class _ViewsSeen:
    """An observer that keeps what it is handed (Note [observers see a view])."""

    def __init__(self) -> None:
        self.views: list[Any] = []
        self.ends: list[Any] = []

    def on_instruction(self, view: Any, cmd: Any, start: float, end: float) -> None:
        self.views.append(view)

    def on_call_end(self, view: Any, seconds: float) -> None:
        self.ends.append(view)

    def summary(self, engine: Any) -> dict[str, Any]:
        import dataclasses
        import types

        from fdg_schedule.observability.view import StageView

        try:
            self.ends[-1].global_steps = 0
            frozen = False
        except dataclasses.FrozenInstanceError:
            frozen = True
        return {
            "all_views": all(type(v) is StageView for v in self.views + self.ends),
            "distinct": len({id(v) for v in self.views + self.ends}) == len(self.views) + len(self.ends),
            "engine_or_state_seen": any(v is engine or v is engine.fdg_state for v in self.views + self.ends),
            "frozen": frozen,
            "end_ticks": [v.stats["ticks"] for v in self.ends],
            "end_steps": [v.global_steps for v in self.ends],
            "end_held": [v.held_bytes for v in self.ends],
            "end_in_flight": [v.in_flight for v in self.ends],
            "end_loss_is_the_calls": [v.loss is not None for v in self.ends],
            "ids": dataclasses.asdict(self.ends[-1].ids),
            "stats_read_only": isinstance(self.ends[-1].stats, types.MappingProxyType),
        }


def observed_job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """FDG with W&B + trace + CSV (not logged in: offline by default), then a traced stock 1F1B job."""
    import fdg_schedule
    from fdg_schedule.observability import observe, timeline

    tmp_path = Path(tmp)
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_RUN_GROUP"):
        os.environ.pop(key, None)
    os.environ.update(
        NETRC=str(tmp_path / "no-netrc"),  # nobody is logged in
        WANDB_DIR=str(tmp_path),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        WANDB_SILENT="true",
    )
    cfg = _config(tmp_path, "fdg")
    observe.before_engine(cfg)  # what the engine selection does before DeepSpeed starts its monitors
    engine, data = _engine(cfg)
    assert isinstance(engine, fdg_schedule.FDGPipelineEngine)
    views = _ViewsSeen()
    engine.observers.append(views)
    it = iter(data)
    engine.train_batch(it)
    with _collectives_recorded() as collectives:  # steady state, both observers on
        for _ in range(CALLS - 1):
            engine.train_batch(it)
    engine.drain()
    observe.close_observers(engine)
    fdg = {
        "stage_id": engine.stage_id,
        "mode": os.environ.get("WANDB_MODE"),
        "hint": tracking._hint_printed,
        "collectives": collectives,
        "views": views.summary(engine),
    }

    one_f_one_b, data = _engine(_config(tmp_path, "1f1b"))
    assert type(one_f_one_b).__name__ == "PipelineEngine"
    recorder = timeline.trace_one_f_one_b(one_f_one_b, start_tick=0, ticks=2 * GAS, dir=tmp_path / "1f1b_trace")
    it = iter(data)
    for _ in range(2):
        one_f_one_b.train_batch(it)
    recorder.write()
    import wandb

    if wandb.run is not None:  # DeepSpeed's own run on rank 0
        wandb.run.finish()
    return fdg


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("observed")
    results = run_ranks(observed_job, 2, tmp, str(tmp), deadline_s=150)
    return tmp, results


# -- reading W&B's offline transaction log ----------------------------------------------------------


def _wandb_runs(tmp: Path) -> dict[str, dict[str, Any]]:
    runs = [tracking.read_offline_run(d) for d in sorted((tmp / "wandb").glob("offline-run-*"))]
    return {run["name"] or f"deepspeed-{i}": run for i, run in enumerate(runs)}


# -- tests ------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_observers_get_a_read_only_view_built_per_call(job: tuple[Path, list[dict[str, Any]]]) -> None:
    """Issue 65 part 5: never the engine nor its StageState; a new frozen StageView at every call, its values
    those of that moment."""
    _, results = job
    for stage, result in enumerate(results):
        views = result["views"]
        assert views["all_views"] and views["distinct"] and views["frozen"] and views["stats_read_only"], views
        assert not views["engine_or_state_seen"]
        assert views["end_ticks"] == [3, 6, 9, 11] and views["end_steps"] == [3, 6, 9, 11]
        assert views["end_in_flight"] == ([2, 2, 2, 0] if stage == 0 else [0, 0, 0, 0])
        assert (views["end_held"][0] > 0) == (stage == 0) and views["end_held"][-1] == 0
        assert all(views["end_loss_is_the_calls"])
        assert views["ids"] == {"stage_id": stage, "num_stages": 2, "global_rank": stage, "dp_id": 0,
                                "dp_world_size": 1}  # fmt: skip


@pytest.mark.distributed
def test_wandb_runs_per_stage_in_one_group(job: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, results = job
    for rank, result in enumerate(results):  # only the stage's own data-parallel group (itself here)
        assert {ranks for _, ranks in result["collectives"]} <= {(rank,)}, result["collectives"]
    assert [r["mode"] for r in results] == ["offline", "offline"]  # not logged in -> offline
    assert results[0]["hint"] and not results[1]["hint"]  # the sync hint on rank 0 only
    runs = _wandb_runs(tmp)
    assert {"stage0-dp0", "stage1-dp0"} <= set(runs), sorted(runs)
    assert len(runs) == 3, sorted(runs)  # + DeepSpeed's own rank-0 run
    groups = {run["group"] for run in runs.values()}
    assert len(groups) == 1 and groups.pop().startswith("fdg-"), [r["group"] for r in runs.values()]
    deepspeed_run = next(r for name, r in runs.items() if not name.startswith("stage"))
    assert any("Train/Samples/train_loss" in row for row in deepspeed_run["history"])
    for stage, run in ((0, runs["stage0-dp0"]), (1, runs["stage1-dp0"])):
        assert run["config"]["fdg"]["grad_shrink"] == 0.5
        assert run["config"]["stage_id"] == stage and run["config"]["delay"] == 2 - 2 * stage
        rows = [row for row in run["history"] if "fdg/tick" in row]
        assert len(rows) == CALLS + 1, rows  # one row per train_batch() and one for the drain
        assert [row["fdg/tick"] for row in rows] == [3, 6, 9, 11]
        assert all(row["fdg/delay"] == 2 - 2 * stage for row in rows)
        assert rows[-1]["fdg/steps"] == GAS * CALLS and rows[-1]["fdg/skipped"] == 0
        assert all(row["fdg/lr"] == pytest.approx(0.1) for row in rows)
        assert all(row["fdg/grad_norm"] > 0 for row in rows if "fdg/grad_norm" in row)
        assert "fdg/grad_norm" in rows[0]
        for row in rows:
            assert row["fdg/tick_s"] >= row["fdg/compute_s"] > 0
            assert 0 <= row["fdg/wait_fraction"] <= 1
        assert all(row["fdg/max_memory_allocated"] >= row["fdg/memory_allocated"] > 0 for row in rows)
        held = [row["fdg/held_bytes"] for row in rows]
        assert (held[0] > 0) == (stage == 0) and held[-1] == 0  # stage 0 holds 2 micro-batches until drained
        # The delay-aware lr at each call's last tick t: tau = 2 on stage 0, 1 on the last stage.
        tau = 2.0 if stage == 0 else 1.0
        assert [row["fdg/lr_factor"] for row in rows] == pytest.approx(
            [tau ** -(1 - (t - 1) / 100) for t in (3, 6, 9, 11)]
        )
        # Staleness (every 2 ticks): the micro-batch that entered stage 0 at tick 0 came back at tick 2
        # before any step (0), later ones after two steps; the last stage has none.
        staleness = [row["fdg/staleness"] for row in rows]
        assert staleness[0] == 0.0 and (
            all(0 < s < 0.5 for s in staleness[1:]) if stage == 0 else set(staleness) == {0.0}
        )
    # The micro-batch each loss belongs to: stage 1 back-propagates b at tick b + 1, stage 0 at b + 2.
    rows0 = [row for row in runs["stage0-dp0"]["history"] if "fdg/tick" in row]
    rows1 = [row for row in runs["stage1-dp0"]["history"] if "fdg/tick" in row]
    # Calls are ticks 0-2, 3-5, 6-8, and the drain 9-10 (micro-batches 0-8 entered).
    assert [row["fdg/loss_micro_batch"] for row in rows1] == [1, 4, 7, 8]
    assert [row["fdg/loss_micro_batch"] for row in rows0] == [0, 3, 6, 8]
    assert rows0[-1]["fdg/loss_last"] == pytest.approx(rows1[-1]["fdg/loss_last"])  # both micro-batch 8
    assert all(row["fdg/loss"] > 0 for row in rows0 + rows1)


@pytest.mark.distributed
def test_fdg_trace_has_both_ranks_in_schedule_order(job: tuple[Path, list[dict[str, Any]]]) -> None:
    from fdg_schedule.observability import timeline

    tmp, _ = job
    merged = timeline.merge(tmp / "fdg_trace")
    trace = json.loads(merged.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    ticks = {e["args"]["tick"] for e in spans}
    assert ticks == set(range(WINDOW["start_tick"], WINDOW["start_tick"] + WINDOW["ticks"]))
    kinds = {pid: {e["cat"] for e in spans if e["pid"] == pid} for pid in (0, 1)}
    assert kinds[0] >= {"forward", "backward", "step", "wait", "load", "exchange"}
    assert kinds[1] >= {"forward", "backward", "step", "wait", "load", "exchange"}
    start = {(e["pid"], e["name"]): e for e in spans}
    for e in spans:  # stage k forwards b at tick b + k; backward at b + 2(K-1) - k
        b, stage = e["args"].get("micro_batch"), e["pid"]
        if e["cat"] == "forward":
            assert e["args"]["tick"] == b + stage
        elif e["cat"] == "backward":
            assert e["args"]["tick"] == b + 2 - stage
    for b in range(1, 6):  # stage 0's forward of b ends before stage 1's forward of b starts
        f0, f1 = start[(0, f"F{b}")], start[(1, f"F{b}")]
        assert f0["ts"] + f0["dur"] <= f1["ts"]
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]  # stage 0's staleness, measured at ticks 2, 4
    assert [(e["pid"], e["name"]) for e in counters] == [(0, "staleness")] * 2
    assert counters[0]["args"]["staleness"] == 0.0 and counters[1]["args"]["staleness"] > 0
    png = timeline.render(merged, tmp / "timeline.png")
    assert png.stat().st_size > 10_000


@pytest.mark.distributed
def test_one_f_one_b_trace_and_comparison(job: tuple[Path, list[dict[str, Any]]]) -> None:
    from fdg_schedule.observability import timeline

    tmp, _ = job
    trace = timeline.load(tmp / "1f1b_trace")
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for pid in (0, 1):
        names = [e["name"] for e in spans if e["pid"] == pid]
        assert [n for n in names if n.startswith("F")] == [f"F{b}" for b in range(2 * GAS)]
        assert [n for n in names if n.startswith("B")] == [f"B{b}" for b in range(2 * GAS)]
        assert names.count("S") == 2  # one optimizer step per batch
    out = tmp / "compare.png"
    timeline.main(
        ["compare", "--fdg", str(tmp / "fdg_trace"), "--one-f-one-b", str(tmp / "1f1b_trace"), "--out", str(out)]
    )
    assert out.stat().st_size > 10_000


@pytest.mark.distributed
def test_csv_monitor_still_writes_train_loss_on_rank_0(job: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, _ = job
    lines = (tmp / "csv" / "fdg" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert lines[0].split(",")[-1] == "train_loss"
    assert len(lines) - 1 == CALLS + 1  # every call and the drain returned a loss on stage 0 (K = 2)


def test_offline_by_default_without_login(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setattr(tracking, "_hint_printed", False)
    group = tracking.prepare({"wandb": {"enabled": True}})
    assert os.environ["WANDB_MODE"] == "offline" and group.startswith("fdg-")
    assert os.environ["WANDB_RUN_GROUP"] == group == tracking.prepare({"wandb": {"enabled": True}})
    monkeypatch.setenv("WANDB_MODE", "online")  # a user's choice is kept
    assert tracking.prepare({"wandb": {"enabled": True, "group": "mine"}}) == "mine"
    assert os.environ["WANDB_MODE"] == "online"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert tracking._logged_in()


def test_micro_batch_numbers_continue_across_drains() -> None:
    numbers = MicroBatchNumbers()
    for _ in range(3):  # a train_batch() call: three micro-batches enter
        numbers.watch(AdvanceTick(entered=True))
    numbers.end_call()
    assert numbers(2) == 2
    numbers.watch(AdvanceTick(entered=False))  # a drain
    numbers.end_call()
    numbers.watch(AdvanceTick(entered=True))
    assert numbers(0) == 3  # the next segment's micro-batch 0


def test_the_instruction_hook_observes_a_stock_engine_without_patching_its_class() -> None:
    """dispatch.observe: DeepSpeed's PipelineEngine gets the hook on its instance; the class map is untouched."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    from fdg_schedule.base import dispatch

    class Stock:
        _INSTRUCTION_MAP = {
            ForwardPass: lambda self, buffer_id: self.ran.append(("F", buffer_id)),
            BackwardPass: lambda self, buffer_id: self.ran.append(("B", buffer_id)),
        }

        def __init__(self) -> None:
            self.ran: list[tuple[str, int]] = []

    class_map = dict(Stock._INSTRUCTION_MAP)
    engine, seen, also = Stock(), [], []
    dispatch.observe(engine, lambda view, cmd, start, end: seen.append((view, type(cmd), cmd.buffer_id, end >= start)))
    dispatch.observe(engine, lambda view, cmd, start, end: also.append(type(cmd)))
    engine._INSTRUCTION_MAP[ForwardPass](engine, buffer_id=3)
    engine._INSTRUCTION_MAP[BackwardPass](engine, buffer_id=1)
    assert engine.ran == [("F", 3), ("B", 1)]
    assert seen == [(engine, ForwardPass, 3, True), (engine, BackwardPass, 1, True)]
    assert also == [ForwardPass, BackwardPass]  # a second observer: called once each, not wrapped twice
    assert class_map == Stock._INSTRUCTION_MAP and class_map == Stock()._INSTRUCTION_MAP


def test_the_instruction_hook_joins_an_fdg_engines_observers() -> None:
    from fdg_schedule.base import dispatch

    class FDGLike:
        fdg_stats: dict[str, float] = {}

        def __init__(self) -> None:
            self.observers: list[object] = []

    engine, seen = FDGLike(), []
    dispatch.observe(engine, lambda view, cmd, start, end: seen.append((view, cmd, start, end)))
    (observer,) = engine.observers
    observer.on_instruction(engine, "cmd", 1.0, 2.0)
    observer.on_call_end(engine, 1.0)
    assert seen == [(engine, "cmd", 1.0, 2.0)]
