"""FDG's tick over a link slowed on purpose: the exchange at the tick's end (before) against each message sent when
it exists (after), side by side in one run, and the planner's prediction of both (issue 46, item 3).

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.slow_link --before 21ad385 --out docs/results/performance/slow_link

Two stages of a plain conv net (a stem, 8 conv blocks, a head; 4 blocks a stage, a 4 MiB boundary at micro-batch
32), K = 2, stored activations, SGD, ``pipeline.fdg.transport: "shm"``, each rank bound to its own core. The link
is slowed in the benchmark's ranks, not in the library: every message's READY record (Note [shared-memory
transport] in fdg_schedule/exchange/shm_link.py) goes through a wire thread that delivers message i at
``max(posted_i, delivered_{i-1}) + c``, one direction of one link serialised as a link of ``c`` seconds per
message would be. ``c`` runs over fractions of the slower stage's backward, measured here in plain torch first.

The before code is ``--before``'s commit, checked out as a git worktree under runs/; the after code is this
checkout. Each round launches both trees' jobs in turn (order rotated per round); each job runs every link time,
in an order rotated per round, one warm-up call and ``--calls`` timed calls of ``--gas`` micro-batches each. The
tick is rank 0's call time over ``--gas``; a cell is the median over rounds of the per-round medians.

The planner's prediction: each tree's own simulator (``fdg_schedule.plan``, run with that tree on PYTHONPATH)
on the stages' measured forward, backward and step, with the link ``c`` per message. What the planner does not
model (the engine's per-tick overhead and the transport's own copies) is fitted once per tree at ``c = 0`` and
folded into the step; every ``c > 0`` is then a prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

MICRO, WIDTH, IMAGE, BLOCKS = 32, 32, 32, 8


# -- the model: a plain conv net, blocks as single layers so that "uniform" splits it 4 + 4 -------------------------


class Stem(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(3, WIDTH, 3, padding=1), nn.ReLU())


class Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(WIDTH, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU())


class Head(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTH, 10))


def layer_classes() -> list[type[nn.Module]]:
    return [Stem, *[Block] * BLOCKS, Head]


PARTS = [0, 1 + BLOCKS // 2, BLOCKS + 2]


def micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(MICRO, 3, IMAGE, IMAGE, generator=g), torch.randint(0, 10, (MICRO,), generator=g))
        for _ in range(n)
    ]


# -- the rank side: run with a tree's fdg_schedule on PYTHONPATH, nothing of benchmarks imported ---------------------


class Wire:
    """Deliver one link's READY records ``delay_s`` after the previous one was delivered (or it was posted)."""

    delay_s = 0.0

    def __init__(self, link: Any, post: Any) -> None:
        self.link, self.post = link, post
        self.lock = threading.Lock()
        self.records: queue.Queue[tuple[float, tuple[Any, ...]]] = queue.Queue()
        self.free_at = 0.0
        self.queued = 0
        threading.Thread(target=self._run, daemon=True).start()

    def send(self, *record: Any) -> None:
        with self.lock:
            if Wire.delay_s <= 0 and self.queued == 0:  # nothing ahead of it: the link as it is
                self.post(self.link, *record)
                return
            self.queued += 1
        self.records.put((time.monotonic(), record))

    def _run(self) -> None:
        while True:
            posted, record = self.records.get()
            self.free_at = max(posted, self.free_at) + Wire.delay_s
            time.sleep(max(0.0, self.free_at - time.monotonic()))
            with self.lock:
                self.post(self.link, *record)
                self.queued -= 1


def install_wire() -> None:
    from fdg_schedule.exchange import shm_link

    post = shm_link.Link._post

    def delayed_post(self: Any, kind: Any, direction: Any, seq: int, nbytes: int) -> None:
        if kind != shm_link.Kind.READY:
            post(self, kind, direction, seq, nbytes)
            return
        if "_bench_wire" not in self.__dict__:
            self._bench_wire = Wire(self, post)
        self._bench_wire.send(kind, direction, seq, nbytes)

    shm_link.Link._post = delayed_post  # type: ignore[method-assign]


def worker(links: list[float], gas: int, calls: int, out: str, trace: str) -> None:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    import fdg_schedule  # noqa: F401  (selects the engine from pipeline.schedule)

    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # type: ignore[operator]
    install_wire()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = PipelineModule(
        layers=[LayerSpec(cls) for cls in layer_classes()], num_stages=2, loss_fn=nn.CrossEntropyLoss(),
        partition_method="uniform",
    )  # fmt: skip
    assert model.parts == PARTS, model.parts
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
        "pipeline": {"schedule": "fdg", "fdg": {"transport": "shm"}},
    }
    if trace:  # three ticks of the second timed call
        config["pipeline"]["fdg"]["trace"] = {"start_tick": 2 * gas, "ticks": 3, "dir": trace}  # type: ignore[index]
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    data = micro_batches(gas)
    ticks: dict[str, list[float]] = {}
    for c in links:
        Wire.delay_s = c
        engine.train_batch(iter(data))  # warm-up: the previous link time's messages leave the wire
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            engine.train_batch(iter(data))
            times.append((time.perf_counter() - start) / gas)
        ticks[repr(c)] = times
    Wire.delay_s = 0.0
    engine.drain()
    torch.distributed.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(ticks))


# -- the launcher side ----------------------------------------------------------------------------------------------


def stage_costs(reps: int = 15) -> list[dict[str, float]]:
    """Per stage: forward, backward (with the loss on the last) and SGD step, median seconds, in plain torch."""
    os.sched_setaffinity(0, {0})
    torch.manual_seed(0)
    layers = [cls() for cls in layer_classes()]
    stages = [nn.Sequential(*layers[a:b]) for a, b in zip(PARTS[:-1], PARTS[1:])]
    x, y = micro_batches(1)[0]
    costs = []
    for k, stage in enumerate(stages):
        opt = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)
        inp = x if k == 0 else stages[0](x).detach()
        f, b, s = [], [], []
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            out = stage(inp.requires_grad_(k > 0))
            t1 = time.perf_counter()
            loss = nn.functional.cross_entropy(out, y) if k == len(stages) - 1 else out
            loss.backward(None if k == len(stages) - 1 else torch.ones_like(out))
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            f.append(t1 - t0)
            b.append(t2 - t1)
            s.append(t3 - t2)
        costs.append({n: statistics.median(v[3:]) for n, v in (("forward", f), ("backward", b), ("step", s))})
    return costs


def tree_at(commit: str, runs: Path) -> Path:
    """A worktree of ``commit`` under ``runs`` (made once)."""
    tree = runs / f"tree-{commit}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True)
    return tree


def launch(
    tree: Path, links: list[float], args: argparse.Namespace, out: Path, port: int, trace: str = ""
) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # fmt: skip
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--links", json.dumps(links),
               "--gas", str(args.gas), "--calls", str(args.calls), "--worker-out", str(out),
               "--trace", trace]  # fmt: skip
    ranks = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    errors = [p.communicate(timeout=args.deadline_s)[1] for p in ranks]
    if any(p.returncode for p in ranks):
        raise RuntimeError(f"{tree}: a rank failed:\n" + "\n".join(e[-3000:] for e in errors))
    return json.loads(out.read_text())


PREDICT = """
import json, sys
from fdg_schedule.plan import streams as st
from fdg_schedule.plan.predict import fdg_window
from fdg_schedule.plan.simulate import ChunkCosts, Link, simulate
q = json.load(sys.stdin)

def tick(c, overhead):
    chunks = [ChunkCosts(s["forward"], s["backward"], s["step"] + overhead,
                         to_next=Link(c, 0.0, 1.0, False, "down") if k == 0 else None,
                         to_prev=Link(c, 0.0, 1.0, False, "up") if k == 1 else None)
              for k, s in enumerate(q["stages"])]
    ticks, first, length = fdg_window(2, 1)
    ends = simulate(st.fdg_streams(2, ticks, 1, drain=False), chunks).ends(0, st.Op.FORWARD)
    return (ends[first + length] - ends[first]) / length

low, high = 0.0, q["measured_c0"]  # the overhead at which the prediction at c = 0 is the measured tick
for _ in range(40):
    mid = (low + high) / 2
    low, high = (mid, high) if tick(0.0, mid) < q["measured_c0"] else (low, mid)
overhead = (low + high) / 2
print(json.dumps({"overhead_s": overhead, "ticks": [tick(c, overhead) for c in q["links"]]}))
"""


def predict(tree: Path, stages: list[dict[str, float]], links: list[float], measured_c0: float) -> dict[str, Any]:
    """``tree``'s planner on the measured stages, with the overhead it does not model fitted at c = 0 (folded into
    the step): ``{"overhead_s", "ticks"}``, a tick per link time."""
    query = json.dumps({"stages": stages, "links": links, "measured_c0": measured_c0})
    done = subprocess.run([sys.executable, "-c", PREDICT], input=query, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(tree)})  # fmt: skip
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="21ad385", help="the commit whose exchange runs at the tick's end")
    parser.add_argument("--fractions", default="0,0.25,0.5,1,1.5", help="link times, in the slower backward")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gas", type=int, default=8)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--deadline_s", type=float, default=900)
    parser.add_argument("--out", default="runs/slow_link")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--links", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--trace", default="", help=argparse.SUPPRESS)
    parser.add_argument("--trace-fraction", type=float, default=1.0, help="the link time of the timeline picture")
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.links), args.gas, args.calls, args.worker_out, args.trace)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path("runs/slow_link")
    runs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    trees = {"before": tree_at(args.before, runs), "after": Path(__file__).resolve().parents[2]}
    stages = stage_costs()
    backward = max(s["backward"] for s in stages)
    fractions = [float(f) for f in args.fractions.split(",")]
    links = [f * backward for f in fractions]
    print(f"stages {stages}; link times {[round(c * 1e3, 2) for c in links]} ms", flush=True)
    ticks: dict[str, dict[str, list[float]]] = {name: {repr(c): [] for c in links} for name in trees}
    for r in range(args.rounds):
        names = list(trees)[r % 2 :] + list(trees)[: r % 2]
        order = links[r % len(links) :] + links[: r % len(links)]
        for name in names:
            got = launch(trees[name], order, args, runs / f"{name}.json", 29500 + 7 * r + (name == "after"))
            for c in links:
                ticks[name][repr(c)].append(statistics.median(got[repr(c)]))
            print(f"round {r} {name}: " + ", ".join(f"{statistics.median(got[repr(c)]) * 1e3:.1f}" for c in links),
                  flush=True)  # fmt: skip
    result: dict[str, Any] = {"commit": commit, "before": args.before, "stages": stages, "fractions": fractions,
                              "links_s": links, "args": vars(args), "ticks": ticks, "predicted": {}}  # fmt: skip
    for name, tree in trees.items():
        result["predicted"][name] = predict(tree, stages, links, statistics.median(ticks[name][repr(links[0])]))
    traced = args.trace_fraction * backward
    for name, tree in trees.items():
        directory = runs / f"trace-{name}"
        launch(tree, [traced], args, runs / f"{name}-traced.json", 29600 + (name == "after"), trace=str(directory))
    draw(runs / "trace-before", runs / "trace-after", out / "slow_link_timeline.png", result, traced)
    (out / "slow_link.json").write_text(json.dumps(result, indent=1))
    (out / "slow_link.md").write_text(report(result))
    print(report(result))


def draw(before: Path, after: Path, out: Path, result: dict[str, Any], link_s: float) -> None:
    """Three ticks of each, one above the other on one time scale."""
    from fdg_schedule.observability import timeline

    link = f"link {link_s * 1e3:.1f} ms a message"
    titles = [
        f"before ({result['before']}): the exchange at the tick's end; {link}",
        f"after ({result['commit']}): each message when it exists; {link}",
    ]
    timeline.stacked([before, after], out, titles, xlabel="ms from each run's first recorded event (three ticks)")


def report(result: dict[str, Any]) -> str:
    from benchmarks.common.stats import spread

    links, ticks, predicted = result["links_s"], result["ticks"], result["predicted"]
    base = {n: statistics.median(ticks[n][repr(links[0])]) for n in ticks}
    lines = [
        f"Measured at {result['commit']} (after) against {result['before']} (before), "
        f"`python -m benchmarks.throughput.slow_link --before {result['before']} --rounds {result['args']['rounds']}`.",
        "Stages (plain torch, ms): "
        + "; ".join(
            f"{k}: forward {s['forward'] * 1e3:.1f}, backward {s['backward'] * 1e3:.1f}, step {s['step'] * 1e3:.1f}"
            for k, s in enumerate(result["stages"])
        ),
        "",
        "| link c | c / backward | before: tick ms | before: × c = 0 | after: tick ms | after: × c = 0 "
        "| after / before | predicted before | predicted after | after: predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (c, frac) in enumerate(zip(links, result["fractions"])):
        cells = [f"{c * 1e3:.1f} ms", f"{frac:g}"]
        median = {n: statistics.median(ticks[n][repr(c)]) for n in ticks}
        for n in ("before", "after"):
            cells += [spread(ticks[n][repr(c)], 1e3), f"{median[n] / base[n]:.3f}"]
        after, before = median["after"], median["before"]
        pb, pa = predicted["before"]["ticks"][i], predicted["after"]["ticks"][i]
        cells += [f"{after / before:.3f}", f"{pb * 1e3:.1f}", f"{pa * 1e3:.1f}", f"{pa / after:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Fitted at c = 0 (the engine's overhead the planner does not model, folded into the step): before "
        f"{predicted['before']['overhead_s'] * 1e3:.1f} ms, after {predicted['after']['overhead_s'] * 1e3:.1f} ms.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
