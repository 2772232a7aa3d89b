"""A benchmark rank's process: its allocator setting and cores before it measures, and where its CPU time went."""

from __future__ import annotations

import resource
from typing import Any

from benchmarks.common.cores import Cores
from fdg_schedule.base import host_memory


def prepare_process(rank: int, plan: dict[str, Any]) -> Cores:
    """This rank's allocator setting (``plan["host_memory"]``: "retain" keeps freed memory, else glibc's default),
    its threads bound to its core if ``plan["bind_cores"]`` (else the caller binds per variant)."""
    if plan.get("host_memory", "system") == "retain":
        host_memory.retain_freed_memory()
    cores = Cores(rank, bool(plan.get("bind_cores")))
    cores.bind(False)
    return cores


def usage() -> dict[str, float]:
    """Where a rank's CPU time went: user and kernel time, the main thread's share (the rest is
    other threads: gloo's transport, DeepSpeed's), page faults, and context switches
    (involuntary: the kernel took the core away)."""
    process = resource.getrusage(resource.RUSAGE_SELF)
    thread = resource.getrusage(resource.RUSAGE_THREAD)
    return {
        "user_s": process.ru_utime,
        "sys_s": process.ru_stime,
        "main_thread_s": thread.ru_utime + thread.ru_stime,
        "minor_faults": float(process.ru_minflt),
        "voluntary_switches": float(process.ru_nvcsw),
        "involuntary_switches": float(process.ru_nivcsw),
    }
