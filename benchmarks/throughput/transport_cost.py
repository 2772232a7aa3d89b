"""What one FDG tick's exchange costs through gloo and through shared memory, by message size.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.transport_cost
    ... --sizes 1,16 --rounds 3 --ticks 50          # fewer, for a quick look

Two ranks, each an FDG stage's :class:`fdg_schedule.exchange.comm.NeighbourExchange` (the engine's own class),
exchange as the engine does at K = 2 and nothing else: each tick stage 0 waits for the gradient of
the tick before, then posts an activation of the given size (fp32) and the gradient's receive;
stage 1 waits for the activation, then posts a gradient of the same size and its loss with the next
activation's receive. With no compute in the tick, its wall time is the exchange's latency, and each
rank's CPU time (user + system, every thread of the process: gloo's transport threads count) is
what the exchange takes from the cores a stage would compute on.

Rounds alternate the transports (``pipeline.fdg.transport`` "process_group", i.e. gloo, and "shm")
so drift on a shared machine falls on both; the table gives medians over rounds and the paired ratio
shm / gloo per round. Prints one Markdown table; ``--out`` also writes it and the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TRANSPORTS = ("process_group", "shm")


def ticks_of_exchange(rank: int, transport: str, mib: float, ticks: int) -> dict[str, float]:
    """``ticks`` ticks of the K = 2 exchange on this rank; its wall and CPU seconds per tick."""
    import torch
    import torch.distributed as dist

    from fdg_schedule.exchange.comm import NeighbourExchange

    comm = NeighbourExchange(
        prev_rank=None if rank == 0 else 0, next_rank=1 if rank == 0 else None, device=torch.device("cpu"),
        dynamic_shape=False, stage_id=rank, timeout_s=120, transport=transport,
    )  # fmt: skip
    numel = int(mib * 2**20 / 4)
    message = torch.randn(numel)
    meta = [(message.shape, message.dtype)]
    warmup = 3
    if rank == 1:
        comm.post(None, None, None, recv_activation=True, recv_grad_meta=None)
    for tick in range(warmup + ticks):
        if tick == warmup:
            dist.barrier()
            start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        last = tick == warmup + ticks - 1
        if rank == 0:
            if tick:
                comm.wait_grad()
            comm.post((message,), None, None, recv_activation=False, recv_grad_meta=meta)
        else:
            comm.wait_activation()
            comm.post(None, (message,), torch.tensor(0.5), recv_activation=not last, recv_grad_meta=None)
    if rank == 0:
        comm.wait_grad()
    comm.complete()
    wall = time.perf_counter() - start
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (end.ru_utime - usage.ru_utime) + (end.ru_stime - usage.ru_stime)
    dist.barrier()
    comm.close_links()
    return {"wall_ms": 1e3 * wall / ticks, "cpu_ms": 1e3 * cpu / ticks}


def all_rounds(rank: int, world: int, sizes: list[float], rounds: int, ticks: int) -> list[dict[str, Any]]:
    out = []
    for round_ in range(rounds):
        for mib in sizes:
            order = TRANSPORTS if round_ % 2 == 0 else TRANSPORTS[::-1]
            for transport in order:
                out.append({"round": round_, "mib": mib, "transport": transport,
                            **ticks_of_exchange(rank, transport, mib, ticks)})  # fmt: skip
    return out


def summarize(per_rank: list[list[dict[str, Any]]], sizes: list[float]) -> list[dict[str, Any]]:
    """Per size: medians over rounds of each transport's tick and of each rank's CPU per tick; shm / gloo paired."""
    rows = []
    for mib in sizes:
        row: dict[str, Any] = {"mib": mib}
        for transport in TRANSPORTS:
            runs = [[r for r in rank if r["mib"] == mib and r["transport"] == transport] for rank in per_rank]
            row[transport] = {
                "wall_ms": statistics.median(max(a["wall_ms"], b["wall_ms"]) for a, b in zip(*runs, strict=True)),
                "cpu_ms": [statistics.median(r["cpu_ms"] for r in rank_runs) for rank_runs in runs],
            }
        rows.append(row)
        for key in ("wall_ms", "cpu_ms"):
            pairs = []
            for rank in per_rank:
                by = {(r["round"], r["transport"]): r[key] for r in rank if r["mib"] == mib}
                pairs += [by[(n, "shm")] / by[(n, "process_group")] for n, transport in by if transport == "shm"]
            row[f"shm_over_gloo_{key}"] = statistics.median(pairs)
    return rows


def markdown(rows: list[dict[str, Any]], ticks: int, rounds: int) -> str:
    lines = [
        f"Per tick of the K = 2 exchange, medians over {rounds} rounds of {ticks} ticks; CPU: user + system of the "
        "whole process (stage 0 / stage 1).",
        "",
        "| message each way | gloo: tick ms | gloo: CPU ms per tick | shm: tick ms | shm: CPU ms per tick "
        "| shm / gloo: tick | shm / gloo: CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        gloo, shm = row["process_group"], row["shm"]
        lines.append(
            f"| {row['mib']:g} MiB | {gloo['wall_ms']:.2f} | {gloo['cpu_ms'][0]:.2f} / {gloo['cpu_ms'][1]:.2f} "
            f"| {shm['wall_ms']:.2f} | {shm['cpu_ms'][0]:.2f} / {shm['cpu_ms'][1]:.2f} "
            f"| {row['shm_over_gloo_wall_ms']:.2f} | {row['shm_over_gloo_cpu_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.25,1,4,16,64", help="MiB of each message, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ticks", type=int, default=100)
    parser.add_argument("--out", default=None, help="a directory for transport_cost.md and .json")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    from benchmarks.common.provenance import engine_version  # the commit the engine ran at
    from fdg_schedule.tools.launch import run

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    per_rank = run(all_rounds, 2, sizes, args.rounds, args.ticks, deadline_s=1800)
    rows = summarize(per_rank, sizes)
    engine = engine_version()
    text = f"Measured {date} on {platform.node()}, {os.cpu_count()} CPUs, engine {engine}.\n\n"
    text += markdown(rows, args.ticks, args.rounds)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        given = " ".join(sys.argv[1:] if argv is None else argv)
        command = f"DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.throughput.transport_cost {given}"
        (out / "transport_cost.md").write_text(f"    {command}\n\n{text}\n")
        report = {"command": command, "date": date, "engine": engine, "rows": rows, "raw": per_rank}
        (out / "transport_cost.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
