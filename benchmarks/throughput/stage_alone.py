"""Predicted against measured stage time of balanced K = 3 and 4 splits: each stage alone on a core, one after another.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.stage_alone                         # resnet32, resnet56, gpt2, convstack; K = 3, 4
    python -m benchmarks.throughput.stage_alone --models resnet8_tiny --stages 3 --ticks 6    # a smoke run

This machine has two cores, so a K = 3 or 4 pipeline cannot run with a core per stage. Instead, for
each model the layers are profiled (``fdg_schedule.partitioning.profile``), split for K
(``fdg_schedule.partitioning.partition``,
FDG with stored or recomputed activations), and each stage's FDG tick then runs alone, in this one
process, one stage after another: the stage's layers, fed the activations the earlier layers compute
on fixed micro-batches, holding its delay d = 2(K-1-k) micro-batches in flight. A tick of stage k < K-1
is the backward of the oldest micro-batch (with a fixed gradient of the output's shape; under
"recomputed" its forward is rerun first), the optimizer step, then the forward of the newest (without
autograd under "recomputed"); the last stage runs forward, loss, backward and step. Nothing is sent.
All stages of a split are built at once and timed interleaved (``--rounds`` rounds, each running a
few ticks of every stage in turn), so drift on this shared machine falls on all of them alike.
Measured = median tick time over ``--ticks`` ticks per stage after the pipeline is full and
``--warmup`` more; error = measured / predicted - 1.

The error has two parts. A split's offset (its stages' measured sum over their predicted sum, - 1)
is the same on every stage of the split: the machine running faster or slower while the stages are
timed than while the layers were profiled (on a shared machine it moves by ±20 % between runs minutes
apart). It does not move the best cut. What does is the share error: a stage's share of the split's
measured time over its share of the predicted time, - 1 (0 on every stage = the cut is where the
measurement would put it).

Writes ``<out>/stage_alone.json`` and ``<out>/stage_alone.md``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"  # one thread, as one pipeline rank would have

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import bench_models  # noqa: E402
from fdg_schedule.partitioning.partition import Objective, balanced_partition  # noqa: E402
from fdg_schedule.partitioning.profile import ModelProfile, profile_layers  # noqa: E402

LR, MOMENTUM = 0.01, 0.9


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


class StageAlone:
    """One stage's FDG tick without neighbours: layers ``start:stop`` of ``layers``, delay ``delay``."""

    def __init__(
        self, layers: list[Any], inputs: list[Any], labels: list[Any], loss: Callable[..., torch.Tensor] | None,
        delay: int, recompute: bool,
    ) -> None:  # fmt: skip
        self.funcs = [_private(layer) for layer in layers]
        self.params = [p for f in self.funcs if isinstance(f, nn.Module) for p in f.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params) if self.params else None
        self.inputs, self.labels, self.loss = inputs, labels, loss
        self.delay, self.recompute = delay, recompute
        self.held: collections.deque[tuple[Any, Any]] = collections.deque()
        self.count = 0
        self.grads: list[torch.Tensor] | None = None

    def forward(self, x: Any) -> Any:
        x = _map(x, torch.clone)  # as the engine: layers may write into their input
        for f in self.funcs:
            x = f(x)
        return x

    def tick(self) -> None:
        i = self.count % len(self.inputs)
        self.count += 1
        x = _map(self.inputs[i], lambda t: t.detach().requires_grad_(t.is_floating_point()))
        if self.loss is not None:  # the last stage: delay 0
            self.loss(self.forward(x), self.labels[i]).backward()
            self._step()
            return
        if len(self.held) == self.delay:
            old_x, out = self.held.popleft()
            if self.recompute:
                out = self.forward(old_x)
            floating = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
            if self.grads is None:
                g = torch.Generator().manual_seed(0)
                self.grads = [torch.randn(t.shape, generator=g).to(t) for t in floating]
            torch.autograd.backward(floating, self.grads)
            self._step()
        if self.recompute:
            with torch.no_grad():
                self.forward(x)
            self.held.append((x, None))
        else:
            # As the engine's stored forward: saved weights are read live at backward time (after the
            # steps in between) instead of failing autograd's version check.
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                self.held.append((x, self.forward(x)))

    def _step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _private(layer: Any) -> Any:
    from deepspeed.pipe import LayerSpec

    if isinstance(layer, LayerSpec):
        return layer.build().train()
    if isinstance(layer, nn.Module):
        return copy.deepcopy(layer).train()
    return layer


def _tensors(x: Any) -> list[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    return [t for item in x for t in _tensors(item)] if isinstance(x, (tuple, list)) else []


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if torch.is_tensor(x):
        return fn(x)
    return tuple(_map(t, fn) for t in x) if isinstance(x, (tuple, list)) else x


def stage_inputs(layers: list[Any], data: list[tuple[Any, Any]], start: int) -> list[Any]:
    """What layer ``start`` receives for each fixed micro-batch (the earlier layers run without autograd)."""
    if start == 0:
        return [x for x, _ in data]
    funcs = [_private(layer) for layer in layers[:start]]
    out = []
    with torch.no_grad():
        for x, _ in data:
            for f in funcs:
                x = f(x)
            out.append(_map(x, torch.Tensor.detach))
    return out


def measure_stages(model: str, layers: list[Any], parts: list[int], recompute: bool, args: Any) -> list[list[float]]:
    """Tick times of every stage of the split ``parts``, each alone, interleaved.

    All stages are built, filled (d ticks) and warmed up; then ``--rounds`` rounds each run
    ``--ticks`` / ``--rounds`` ticks of every stage in turn (the order rotates per round), so a slow
    minute on this machine falls on all stages alike.
    """
    data = bench_models.fixed_data(model)
    stages = len(parts) - 1
    built = []
    for k, (start, stop) in enumerate(zip(parts, parts[1:])):
        last = k == stages - 1
        stage = StageAlone(
            layers[start:stop],
            stage_inputs(layers, data, start),
            [y for _, y in data],
            bench_models.loss_fn(model) if last else None,
            delay=2 * (stages - 1 - k),
            recompute=recompute and not last,
        )
        for _ in range(stage.delay + args.warmup):
            stage.tick()
        built.append(stage)
    times: list[list[float]] = [[] for _ in built]
    per_round = max(1, args.ticks // args.rounds)
    for r in range(args.rounds):
        order = list(range(stages))
        for k in order[r % stages :] + order[: r % stages]:
            for _ in range(per_round):
                start_s = time.perf_counter()
                built[k].tick()
                times[k].append(time.perf_counter() - start_s)
    del built
    gc.collect()  # the next split starts with these layers and held activations freed
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="resnet32,resnet56,gpt2,convstack")
    parser.add_argument("--stages", default="3,4")
    parser.add_argument("--activations", default="stored,recomputed")
    parser.add_argument("--ticks", type=int, default=15, help="timed ticks per stage")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the timed ticks are spread over")
    parser.add_argument("--warmup", type=int, default=3, help="ticks after the pipeline is full, not timed")
    parser.add_argument("--profile-repeats", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "out" / "stage_alone"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m benchmarks.throughput.stage_alone " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: {command}", flush=True)
    report: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "rows": [],
    }
    for model in args.models.split(","):
        layers = bench_models.model_layers(model)
        x, y = bench_models.fixed_data(model, 1)[0]
        profile: ModelProfile = profile_layers(
            layers, x, y, bench_models.loss_fn(model), optimizer=optimizer, repeats=args.profile_repeats
        )
        for stages in [int(k) for k in args.stages.split(",")]:
            for activations in args.activations.split(","):
                plan = balanced_partition(profile, stages, Objective(activations=activations))
                load = os.getloadavg()[0]
                measured = measure_stages(model, layers, plan.parts, activations == "recomputed", args)
                for s, times in zip(plan.stages, measured):
                    median = statistics.median(times)
                    row = {
                        "model": model, "stages": stages, "activations": activations, "stage": s.stage_id,
                        "parts": plan.parts, "predicted_s": s.time_s, "measured_s": median,
                        "measured_min_s": min(times), "measured_max_s": max(times),
                        "error": median / s.time_s - 1, "load_avg_1min": load,
                    }  # fmt: skip
                    report["rows"].append(row)
                    print(f"  {model} K={stages} {activations} stage {s.stage_id} layers {s.start}-{s.stop - 1}: "
                          f"predicted {s.time_s * 1e3:.1f} ms, measured {median * 1e3:.1f} ms "
                          f"({row['error']:+.1%})", flush=True)  # fmt: skip
    add_share_errors(report["rows"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage_alone.json").write_text(json.dumps(report, indent=1))
    (out / "stage_alone.md").write_text(markdown(report))
    print(markdown(report))
    return report


def add_share_errors(rows: list[dict[str, Any]]) -> None:
    """Give every row its split's ``offset`` (measured sum / predicted sum - 1) and its ``share_error``
    (measured share of the split / predicted share - 1); a split is the rows of one model, K and mode."""
    splits: dict[tuple[str, int, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        splits[(row["model"], row["stages"], row["activations"])].append(row)
    for split in splits.values():
        predicted = sum(r["predicted_s"] for r in split)
        measured = sum(r["measured_s"] for r in split)
        for r in split:
            r["offset"] = measured / predicted - 1
            r["share_error"] = (r["measured_s"] / measured) / (r["predicted_s"] / predicted) - 1


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Measured {report['date']} on {report['machine']}; command:",
        "",
        f"    {report['command']}",
        "",
        "| model | K | activations | split | stage | predicted ms | measured ms [min–max] | error | split offset "
        "| share error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['stages']} | {r['activations']} | {','.join(map(str, r['parts']))} | {r['stage']} | "
            f"{r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} [{r['measured_min_s'] * 1e3:.1f}–"
            f"{r['measured_max_s'] * 1e3:.1f}] | {r['error']:+.1%} | {r['offset']:+.1%} | {r['share_error']:+.1%} |"
        )
    errors = [abs(r["error"]) for r in report["rows"]]
    shares = [abs(r["share_error"]) for r in report["rows"]]
    if errors:
        lines += [
            "",
            f"|error|: median {statistics.median(errors):.1%}, max {max(errors):.1%}; "
            f"|share error|: median {statistics.median(shares):.1%}, max {max(shares):.1%}; over {len(errors)} stages.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
