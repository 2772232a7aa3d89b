"""A timeline of what every stage did: Chrome/Perfetto traces per rank, merged, drawn as a Gantt chart.

Turned on by ``"pipeline": {"fdg": {"trace": {"start_tick": 0, "ticks": 64, "dir": "fdg_trace"}}}``.
Each rank records its instructions during ticks ``[start_tick, start_tick + ticks)`` and writes
``<dir>/trace-rank<r>.json`` when the window closes (or at exit); no rank waits for another. After
the run::

    python -m fdg_schedule.observability.timeline merge fdg_trace            # -> fdg_trace/trace.json + timeline.png
    python -m fdg_schedule.observability.timeline compare --fdg fdg_trace --one-f-one-b 1f1b_trace --out fig.png

``trace.json`` opens in https://ui.perfetto.dev or chrome://tracing (one track per rank). Event
names use the schedule's compact text (``F3`` forward of micro-batch 3, ``B1`` backward, ``S``
optimizer step, ``R`` gradient all-reduce, ``A3`` / ``G1`` waiting for micro-batch 3's activation /
1's gradient, ``L3`` data loading, ``X`` posting the exchange); micro-batches are numbered run-wide.
A stock DeepSpeed 1F1B engine can be traced the same way with :func:`trace_one_f_one_b`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import MethodType
from typing import Any

from deepspeed.runtime.pipe import schedule as ds

from fdg_schedule.base import dispatch
from fdg_schedule.observability.view import MicroBatchNumbers, StageIds, StageView
from fdg_schedule.sched import ticks
from fdg_schedule.sched.actions import Op
from fdg_schedule.sched.schedule import AdvanceTick, Kind, op_of

# kind -> colour in the Gantt chart (and the trace's "cat")
COLOURS = {
    Kind.FORWARD.value: "#4c72b0",
    Kind.BACKWARD.value: "#dd8452",
    Kind.STEP.value: "#55a868",
    Kind.REDUCE.value: "#937860",
    Kind.WAIT.value: "#d0d0d0",
    Kind.LOAD.value: "#8172b3",
    Kind.EXCHANGE.value: "#64b5cd",
}
# DeepSpeed's 1F1B instructions (named by schedule.DEEPSPEED_OPS): on a stage, forward-side ones come in
# micro-batch order, and so do backward-side ones, so counting them numbers the micro-batches.
_SIDES = {
    **dict.fromkeys((Op.LOAD, Op.RECV_ACTIVATION, Op.FORWARD, Op.SEND_ACTIVATION), "forward"),
    **dict.fromkeys((Op.RECV_GRAD, Op.BACKWARD, Op.SEND_GRAD), "backward"),
}


class TraceRecorder:
    """Chrome trace events of one rank; times are wall-clock microseconds, comparable across ranks."""

    def __init__(self, ids: StageIds, schedule: str, directory: str | Path, start_tick: int, ticks_: int) -> None:
        self.path = Path(directory) / f"trace-rank{ids.global_rank}.json"
        self.rank = ids.global_rank
        self.meta = {
            "schedule": schedule,
            "rank": ids.global_rank,
            "stage_id": ids.stage_id,
            "stages": ids.num_stages,
            "dp_id": ids.dp_id,
            "dp_world_size": ids.dp_world_size,
            "delay": ticks.delay(ids.num_stages, ids.stage_id) if schedule == "fdg" else None,
            "start_tick": start_tick,
            "ticks": ticks_,
        }
        self.start_tick, self.end_tick = start_tick, start_tick + ticks_
        self.events: list[dict[str, Any]] = []
        self.written = False
        self._to_wall_us = (time.time() - time.perf_counter()) * 1e6  # perf_counter -> epoch, per process
        atexit.register(self.write)

    def add(self, kind: str, name: str, start: float, end: float, **args: Any) -> None:
        self.events.append(
            {
                "name": name,
                "cat": kind,
                "ph": "X",
                "ts": start * 1e6 + self._to_wall_us,
                "dur": (end - start) * 1e6,
                "pid": self.rank,
                "tid": 0,
                "args": args,
            }
        )

    def mark(self, name: str, at: float, **args: Any) -> None:
        ts = at * 1e6 + self._to_wall_us
        self.events.append({"name": name, "cat": "tick", "ph": "i", "s": "p", "ts": ts, "pid": self.rank, "args": args})

    def counter(self, name: str, at: float, value: float) -> None:
        """A counter track (``ph: C``): a value that holds from ``at`` on, drawn as a step chart."""
        ts = at * 1e6 + self._to_wall_us
        self.events.append({"name": name, "ph": "C", "ts": ts, "pid": self.rank, "args": {name: value}})

    def write(self) -> Path | None:
        """Write this rank's part once (nothing if no event was recorded); returns its path."""
        if self.written or not self.events:
            return None
        self.written = True
        label = f"stage {self.meta['stage_id']} dp {self.meta['dp_id']} (rank {self.rank})"
        header = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": label}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trace = {"traceEvents": header + self.events, "displayTimeUnit": "ms", "otherData": self.meta}
        self.path.write_text(json.dumps(trace))
        return self.path


class FDGTimeline:
    """An observer that records the instructions of the trace window of ticks on this rank."""

    def __init__(self, view: StageView, start_tick: int = 0, ticks: int = 64, dir: str = "fdg_trace") -> None:  # noqa: A002
        self.recorder = TraceRecorder(view.ids, "fdg", dir, start_tick, ticks)
        self.numbers = MicroBatchNumbers()
        self._staleness_tick = math.nan

    def on_instruction(self, view: StageView, cmd: Any, start: float, end: float) -> None:
        self.numbers.watch(cmd)
        rec = self.recorder
        tick = int(view.stats["ticks"])  # ticks finished before this instruction's tick
        if isinstance(cmd, AdvanceTick):
            tick -= 1  # it has already counted itself
            if rec.start_tick <= tick < rec.end_tick:
                rec.mark(f"tick {tick}", end, tick=tick, entered=cmd.entered)
            return
        op = op_of(cmd)
        if not rec.start_tick <= tick < rec.end_tick or op is None or op.kind is None:
            return
        micro_batch = getattr(cmd, "micro_batch", None)
        if micro_batch is None:
            rec.add(op.kind.value, op.value, start, end, tick=tick)
        else:
            number = self.numbers(micro_batch)
            rec.add(op.kind.value, f"{op.value}{number}", start, end, tick=tick, micro_batch=number)

    def on_call_end(self, view: StageView, seconds: float) -> None:
        self.numbers.end_call()
        measured = view.stats.get("staleness_tick", math.nan)  # a new staleness measurement this call
        if measured != self._staleness_tick and self.recorder.start_tick <= measured < self.recorder.end_tick:
            self.recorder.counter("staleness", time.perf_counter(), view.stats["staleness"])
        self._staleness_tick = measured
        if view.stats["ticks"] >= self.recorder.end_tick:
            self.recorder.write()

    def close(self) -> None:
        self.recorder.write()


def trace_one_f_one_b(
    engine: Any, start_tick: int = 0, ticks: int = 64, dir: str | Path = "1f1b_trace"
) -> TraceRecorder:
    """Record the instructions of a stock DeepSpeed ``PipelineEngine`` (1F1B) into a trace.

    Replaces ``_exec_schedule`` on this instance only with DeepSpeed's dispatch loop plus timing.
    1F1B has no ticks: the window is micro-batches ``[start_tick, start_tick + ticks)`` rounded out
    to whole ``train_batch()`` calls. Call ``.write()`` on the result (or let it write at exit).
    """
    recorder = TraceRecorder(StageIds.of(engine), "1f1b", dir, start_tick, ticks)
    original = engine._exec_schedule
    calls = [0]
    in_window = [False]  # is the current train_batch() call recorded

    def exec_schedule(self: Any, pipe_schedule: Any) -> None:
        if not isinstance(pipe_schedule, ds.TrainSchedule):
            return original(pipe_schedule)  # evaluation
        first = calls[0] * pipe_schedule.micro_batches
        calls[0] += 1
        in_window[0] = recorder.start_tick < first + pipe_schedule.micro_batches and first < recorder.end_tick
        if not in_window[0]:
            return original(pipe_schedule)
        counts = {"forward": {}, "backward": {}}  # type: dict[str, dict[type, int]]

        def record(cmd: Any, start: float, end: float) -> None:
            op = op_of(cmd)
            kind, prefix = ("other", type(cmd).__name__) if op is None or op.kind is None else (op.kind.value, op.value)
            side = _SIDES.get(op) if op is not None else None
            if side is None:
                recorder.add(kind, prefix, start, end, call=calls[0] - 1)
                return
            seen = counts[side].get(type(cmd), 0)
            counts[side][type(cmd)] = seen + 1
            number = first + seen
            recorder.add(kind, f"{prefix}{number}", start, end, call=calls[0] - 1, micro_batch=number)

        dispatch.execute(self, pipe_schedule, record)

    engine._exec_schedule = MethodType(exec_schedule, engine)
    if hasattr(engine, "_aggregate_total_loss"):  # the per-batch loss broadcast: every stage waits
        aggregate = engine._aggregate_total_loss

        def aggregate_total_loss() -> Any:
            start = time.perf_counter()
            loss = aggregate()
            if in_window[0]:
                recorder.add("wait", "loss", start, time.perf_counter(), call=calls[0] - 1)
            return loss

        engine._aggregate_total_loss = aggregate_total_loss
    return recorder


# -- after the run: merge and draw ----------------------------------------------------------------


def merge(directory: str | Path, out: str | Path | None = None) -> Path:
    """Combine ``trace-rank*.json`` in ``directory`` into one trace (default ``<directory>/trace.json``)."""
    directory = Path(directory)
    parts = sorted(directory.glob("trace-rank*.json"), key=lambda p: int(p.stem.removeprefix("trace-rank")))
    if not parts:
        raise FileNotFoundError(
            f"no trace-rank*.json in {directory}; was pipeline.fdg.trace set and the window reached?"
        )
    events: list[dict[str, Any]] = []
    ranks: dict[str, Any] = {}
    for part in parts:
        trace = json.loads(part.read_text())
        events += trace["traceEvents"]
        ranks[str(trace["otherData"]["rank"])] = trace["otherData"]
    schedules = sorted({meta["schedule"] for meta in ranks.values()})
    path = Path(out) if out is not None else directory / "trace.json"
    merged = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": schedules, "ranks": ranks}}
    path.write_text(json.dumps(merged))
    return path


def load(path: str | Path) -> dict[str, Any]:
    """A merged trace from ``trace.json``, or merged on the fly from a directory of parts."""
    path = Path(path)
    if path.is_dir():
        merged = path / "trace.json"
        path = merged if merged.exists() else merge(path)
    return json.loads(path.read_text())


def gantt(trace: dict[str, Any], ax: Any, title: str = "", span_ms: float | None = None) -> None:
    """Draw one row per rank (stage order), bars coloured by kind, labelled with micro-batch numbers."""
    ranks = trace["otherData"]["ranks"]
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        raise ValueError("the trace has no events to draw")
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    order = sorted(ranks.values(), key=lambda m: (m["stage_id"], m["dp_id"]))
    rows = {meta["rank"]: i for i, meta in enumerate(order)}
    # A label is drawn where it fits: about 5.5 px per character at fontsize 6.
    fig = ax.get_figure()
    px_per_ms = fig.get_figwidth() * fig.dpi * ax.get_position().width / (span_ms or (t1 - t0) / 1e3)
    for e in spans:
        row, left, width = rows[e["pid"]], (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        ax.barh(row, width, left=left, height=0.8, color=COLOURS.get(e["cat"], "#444444"), linewidth=0)
        if e["cat"] in ("forward", "backward") and width * px_per_ms >= 5.5 * len(e["name"]) + 2:
            ax.text(left + width / 2, row, e["name"], ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(order)))
    dp = max(m["dp_world_size"] for m in order)
    ax.set_yticklabels([f"stage {m['stage_id']}" + (f" dp {m['dp_id']}" if dp > 1 else "") for m in order])
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms")
    if title:
        ax.set_title(title, loc="left", fontsize=10)


def _legend(fig: Any) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=colour, label=kind) for kind, colour in COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)


def render(trace_path: str | Path, out: str | Path) -> Path:
    """Draw a merged trace (or a directory of parts) as a PNG Gantt chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = load(trace_path)
    rows = len(trace["otherData"]["ranks"])
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.5 * rows))
    gantt(trace, ax, title=_title(trace))
    fig.subplots_adjust(bottom=0.35 if rows < 4 else 0.2)
    _legend(fig)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def compare(fdg: str | Path, one_f_one_b: str | Path, out: str | Path) -> Path:
    """The same job under 1F1B (top) and FDG (bottom) on one time scale, as a PNG."""
    return stacked([one_f_one_b, fdg], out, xlabel="ms from each schedule's first recorded event")


def stacked(paths: Sequence[str | Path], out: str | Path, titles: Sequence[str] = (), xlabel: str = "ms") -> Path:
    """Traces one above the other on one time scale, as a PNG; a title per trace (default: its schedule, stages,
    micro-batches and span), the total span appended to a given one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [load(p) for p in paths]
    heights = [len(t["otherData"]["ranks"]) for t in traces]
    span_ms = max(_busy_ms(t["traceEvents"]) for t in traces)
    fig, axes = plt.subplots(len(traces), 1, figsize=(14, 1.6 + 0.5 * sum(heights)), height_ratios=heights, sharex=True)
    for i, (ax, trace) in enumerate(zip(axes, traces)):
        title = f"{titles[i]}, {_busy_ms(trace['traceEvents']):.0f} ms" if titles else _title(trace)
        gantt(trace, ax, title=title, span_ms=span_ms)
        ax.set_xlabel("")
    axes[-1].set_xlabel(xlabel)
    axes[-1].set_xlim(0, span_ms)  # shared by every row
    fig.subplots_adjust(bottom=0.22, hspace=0.45)
    _legend(fig)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def _title(trace: dict[str, Any]) -> str:
    metas = list(trace["otherData"]["ranks"].values())
    schedule = "FDG" if metas[0]["schedule"] == "fdg" else "1F1B"
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "micro_batch" in e.get("args", {})]
    numbers = [e["args"]["micro_batch"] for e in spans]
    seen = f", micro-batches {min(numbers)}-{max(numbers)}" if numbers else ""
    total_ms = _busy_ms(trace["traceEvents"])
    return f"{schedule}: {metas[0]['stages']} stages{seen}, {total_ms:.0f} ms"


def _busy_ms(events: Iterable[dict[str, Any]]) -> float:
    spans = [e for e in events if e.get("ph") == "X"]
    return (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e3


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fdg_schedule.observability.timeline", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("merge", help="combine trace-rank*.json into trace.json and draw timeline.png")
    p.add_argument("dir")
    p.add_argument("--png", default=None, help="chart path (default <dir>/timeline.png)")
    p = sub.add_parser("compare", help="draw 1F1B above FDG for the same job")
    p.add_argument("--fdg", required=True, help="FDG trace directory or trace.json")
    p.add_argument("--one-f-one-b", required=True, help="1F1B trace directory or trace.json")
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "merge":
        merged = merge(args.dir)
        png = render(merged, args.png or Path(args.dir) / "timeline.png")
        print(f"wrote {merged} (open in https://ui.perfetto.dev) and {png}")
    else:
        print(f"wrote {compare(args.fdg, args.one_f_one_b, args.out)}")


if __name__ == "__main__":
    main()
