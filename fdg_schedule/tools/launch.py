"""Run a function on K local ranks from Python: spawned processes, gloo, a deadline, errors that reach the caller.

For notebooks, experiments and tests: a few CPU ranks on this machine, no ``deepspeed`` launcher,
no hostfile, no port to pick::

    from fdg_schedule.tools.launch import run

    def train(rank: int, world_size: int, steps: int) -> float:
        import deepspeed, fdg_schedule     # the process group is already up (gloo)
        ...                                # deepspeed.initialize(...), train
        return last_loss

    losses = run(train, 2, 100, deadline_s=600)   # [what rank 0 returned, what rank 1 returned]

The function must be importable by name (defined at module level in a ``.py`` file, not in a
notebook cell): each rank is a fresh ``spawn``-ed process. Each rank gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` set (``LOCAL_RANK`` is the rank modulo ``FDG_LAUNCH_DEVICES`` when that is set: ``1``
puts every rank on device 0, as the device check does on a one-GPU machine; ``FDG_LAUNCH_BACKEND``
replaces gloo, e.g. ``nccl`` with one rank per GPU), ``threads`` CPU threads,
``DS_ACCELERATOR=cpu`` unless set, and DeepSpeed's
process group over gloo with a ``file://`` rendezvous in ``workdir`` (no port collisions). Return
values travel back through ``torch.save`` (tensors are fine). A rank that raises, dies, or does not
finish within ``deadline_s`` makes :func:`run` kill the others and raise :class:`RankFailed` with the
rank's traceback; a rank still running shortly before the deadline prints where it is stuck.

Note [preloaded ranks]: each ``spawn``-ed rank imports torch and DeepSpeed afresh, seconds of a short
run. With ``FDG_LAUNCH_PRELOAD=torch,deepspeed,...`` (the test suite sets it, with ``torch._dynamo``, which
every torch optimizer imports when first built: 4-7 s of a rank on two cores) the ranks are forked
from a ``forkserver`` that imported those modules once, in a clean process of its own, with the
environment of the first run: DeepSpeed picks its accelerator while imported, so set
``DS_ACCELERATOR`` before the first run. Each rank still gets the caller's environment of the
moment. A forked rank freezes the garbage collector's view of what it inherited (``gc.freeze()``): those
objects live as long as the rank, and a full collection (DeepSpeed's bf16 optimizer runs four per engine)
no longer walks torch's and DeepSpeed's objects, nor copies their pages; a cycle among them is never freed.

Note [a rank's own processes]: multiprocessing starts a child of a ``spawn``-ed or ``forkserver``-ed process
with that start method as its default, so a rank's DataLoader workers would start the same way: a fresh
interpreter (or a forkserver of the rank's own) that imports torch again, 14 s before the first batch on two
cores (DeepSpeed's ``training_data`` loader has two workers per rank). A rank therefore resets its default to
the platform's (``fork`` on Linux), as a rank under DeepSpeed's launcher or torchrun has it.

Note [the launcher's process group]: a rank sets up torch.distributed itself, then hands the group to
DeepSpeed (``deepspeed.init_distributed`` adopts an initialised one). Under gloo no device is bound
to it: DeepSpeed's own ``init_distributed`` binds ``cuda:LOCAL_RANK`` when its accelerator is CUDA,
after which torch builds every later group by splitting the default one, and gloo cannot do the
split a rank outside the new group must join (``perform_nocolor_split``): several ranks sharing one
GPU over gloo, as the device check runs them, would fail in DeepSpeed's first ``new_group``. Under
NCCL the device is bound, so the default group's communicator is made at once, by every rank.
``init_timeout_s`` bounds the rendezvous only; later operations of the default group wait up to
``timeout_s`` (torch's default for the backend unless given: 30 minutes under gloo, 10 under NCCL),
not the rendezvous' 120 s: under NCCL torch's watchdog ends a process whose operation outlives it.

Note [a rank does not import the package]: a rank runs this file as a plain script (``runpy``)
rather than importing ``fdg_schedule.tools.launch``, so a function that never imports ``fdg_schedule``
trains with stock DeepSpeed, untouched. (With the package installed, importing DeepSpeed loads the
start-up hook's guard, ``fdg_schedule.runtime.install``, which changes nothing unless a config asks for FDG;
the engine is never loaded.) This file therefore imports nothing from ``fdg_schedule``.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import multiprocessing
import os
import queue
import runpy
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

_RANK = "__fdg_schedule_rank__"  # the run name under which a rank executes this file
# Not used for the rendezvous (a file), but DeepSpeed's CPU backend names a shared-memory buffer per
# rank after MASTER_ADDR and MASTER_PORT (/dev/shm/deepspeed_allreduce_buffer_*, ~70 MB) and never
# removes it: a fixed port reuses one set of buffers instead of leaving a new set behind every run.
_MASTER_PORT = "29500"


class RankFailed(RuntimeError):
    """A rank raised, died or missed the deadline; the message names it (with its traceback if it raised)."""


def run(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline_s: float = 600,
    expect_exit: dict[int, int] | None = None,
    workdir: str | Path | None = None,
    threads: int = 1,
    init_timeout_s: float = 120,
    timeout_s: float | None = None,
) -> list[Any]:
    """``worker(rank, world_size, *args)`` on ``world_size`` local ranks; returns the results in rank order.

    Args:
        deadline_s: wall-clock limit for the whole run; afterwards every rank is killed.
        expect_exit: ranks that must die with that exit code instead of returning (their result is None).
        workdir: where the rendezvous file goes (a temporary directory if None).
        threads: CPU threads per rank (``torch.set_num_threads`` and ``OMP_NUM_THREADS``).
        init_timeout_s: how long ``init_process_group`` may wait for the other ranks.
        timeout_s: how long any later operation of the default group may wait (None: torch's default for
            the backend; Note [the launcher's process group]).
    """

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        ctx = _context()
        results: Any = ctx.Queue()
        launch = {
            "environ": dict(os.environ), "worker": worker, "world_size": world_size, "args": args,
            "results": results, "threads": threads,
            "init_file": os.path.join(tmp, "rendezvous"), "init_timeout_s": init_timeout_s, "timeout_s": timeout_s,
            "dump_after_s": max(1.0, deadline_s - 5),
        }  # fmt: skip
        procs = [
            ctx.Process(
                target=runpy.run_path,  # Note [a rank does not import the package]
                args=(__file__,),
                kwargs={"init_globals": {"_LAUNCH": {**launch, "rank": rank}}, "run_name": _RANK},
                daemon=False,  # DeepSpeed data loaders start worker processes of their own
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, deadline_s, expect_exit or {})
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)


def _context() -> Any:
    """Note [preloaded ranks]: ``spawn``, or with ``FDG_LAUNCH_PRELOAD`` set a ``forkserver`` that imported
    those modules once."""
    import torch.multiprocessing as mp

    preload = [m for m in os.environ.get("FDG_LAUNCH_PRELOAD", "").split(",") if m]
    if not preload:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)  # read when the server starts: the first run of this process
    return ctx


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (for ``MASTER_PORT`` / ``--master_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def remove_shared_memory(port: int | str, addr: str = "127.0.0.1") -> None:
    """Delete the shared-memory buffers DeepSpeed's CPU backend made for a rendezvous on ``addr:port``.

    Every rank creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (~70 MB) and
    never removes it (DeepSpeed 0.19.8). :func:`run` avoids the pile-up with a fixed port, but a
    launcher's rendezvous binds a real TCP port: a caller that launches jobs on free ports removes each
    job's buffers after it ended (tests, benchmarks), or a machine's shared memory fills up run by run.
    """
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        path.unlink(missing_ok=True)


def bound_device(backend: str, local_rank: int) -> dict[str, Any]:
    """``init_process_group``'s ``device_id`` for this rank: under NCCL its GPU, under gloo none
    (Note [the launcher's process group])."""
    import torch

    return {"device_id": torch.device("cuda", local_rank)} if backend == "nccl" else {}


def _collect(procs: list[Any], results: Any, deadline_s: float, expect_exit: dict[int, int]) -> list[Any]:
    import torch

    world_size = len(procs)
    done: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    end = time.monotonic() + deadline_s
    while len(done) < world_size:
        for r, code in expect_exit.items():
            if r not in done and procs[r].exitcode is not None:
                if procs[r].exitcode != code:
                    raise RankFailed(f"rank {r} exited with {procs[r].exitcode}, expected {code}")
                done[r] = None
        try:
            status, rank, payload = results.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
        except queue.Empty:
            if time.monotonic() > end:
                missing = sorted(set(range(world_size)) - set(done))
                raise RankFailed(f"ranks {missing} did not finish within {deadline_s:.0f} s") from None
            accounted = done.keys() | expect_exit.keys()
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in accounted]
            # A rank may abort in interpreter teardown just after its result was queued: read once
            # more before calling it dead.
            if dead and time.monotonic() - dead_since.setdefault(dead[0], time.monotonic()) > 3:
                raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            continue
        if rank in expect_exit:
            raise RankFailed(f"rank {rank} was expected to die with exit code {expect_exit[rank]}: {status}")
        if status == "error":
            raise RankFailed(f"rank {rank} raised:\n{payload}")
        done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [done[r] for r in range(world_size)]


def _rank_main(
    environ: dict[str, str],
    worker: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    results: Any,
    threads: int,
    init_file: str,
    init_timeout_s: float,
    timeout_s: float | None,
    dump_after_s: float,
) -> None:
    # A rank still running just before the deadline prints where it is stuck.
    faulthandler.dump_traceback_later(dump_after_s, exit=False)
    multiprocessing.set_start_method(None, force=True)  # Note [a rank's own processes]
    gc.freeze()  # Note [preloaded ranks]: what the forkserver imported is never garbage; collections skip it
    os.environ.clear()  # the caller's environment at run(), also from a forkserver started earlier
    os.environ.update(environ)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        OMP_NUM_THREADS=str(threads), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % int(os.environ.get("FDG_LAUNCH_DEVICES", world_size))),
        LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=_MASTER_PORT,
    )  # fmt: skip
    try:
        import deepspeed
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        backend = os.environ.get("FDG_LAUNCH_BACKEND", "gloo")  # "nccl": the device check, one rank per GPU
        bound = bound_device(backend, int(os.environ["LOCAL_RANK"]))  # Note [the launcher's process group]
        if bound:
            torch.cuda.set_device(bound["device_id"])
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=init_timeout_s), **bound)  # fmt: skip
        ops = timedelta(seconds=timeout_s) if timeout_s else dist.distributed_c10d._get_default_timeout(backend)
        (getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout)(ops)
        deepspeed.init_distributed(dist_backend=backend, timeout=ops, verbose=False)  # adopts the group
        result = worker(rank, world_size, *args)
        # Plain bytes: shared-memory tensors would need this process alive until they are read.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put(("ok", rank, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put(("error", rank, traceback.format_exc()))


if __name__ == _RANK:  # a rank (Note [a rank does not import the package])
    _rank_main(**globals()["_LAUNCH"])
