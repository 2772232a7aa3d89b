"""Keep freed host memory in the process instead of handing it back to the kernel (glibc only).

Training on CPU allocates and frees a micro-batch's activations every step. glibc's ``malloc`` returns
the freed top of its heap to the kernel (``M_TRIM_THRESHOLD``, adjusted as the program runs) and serves
large blocks from fresh ``mmap`` regions it unmaps on ``free`` (``M_MMAP_THRESHOLD``). Either way the
next micro-batch faults the same pages in again, and the kernel zeroes each one. Measured with
``benchmarks/throughput/throughput.py`` (its ``usage`` columns): ResNet-32 backprop at micro-batch 32 took
14,400 page faults and 41 ms of kernel time per micro-batch (17 % of its time), a conv stack 18,600 and
44 ms; a K = 2 pipeline's first stage, which holds the wide activations, paid nearly all of it again.

:func:`retain_freed_memory` sets ``M_MMAP_MAX = 0`` (every block comes from the heap) and
``M_TRIM_THRESHOLD`` to its largest value (the heap is never trimmed), so after the first steps a
process reuses the pages it already has: the faults go to zero. The cost is that the process keeps its
peak heap until it exits, as a caching GPU allocator keeps device memory.

The same settings without a code change, for any job (the ``deepspeed`` launcher passes the
environment to its ranks; set them before the processes start)::

    export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=18446744073709551615

It is a process-wide setting, the same for every schedule: an FDG run and the 1F1B or BP run it is
compared with should both have it, or both not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt(3) parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_LARGEST = -1  # mallopt takes an int; glibc stores the trim threshold as a size_t, so -1 is its largest value

_applied = False


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory in this process (see the module docstring); returns whether it did.

    False, and nothing changed, where the C library is not glibc (musl, macOS, Windows). Idempotent.
    Call it early, before the model is built and profiled: layer timings taken without it include
    the page faults and mislead a time-balanced split.
    """
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, _LARGEST) != 1:
        return False
    _applied = True
    return True


def describe() -> str:
    """How this process's allocator treats freed memory, for logs, profile metadata and cache keys."""
    if _applied:
        return "retained (mallopt: M_MMAP_MAX=0, M_TRIM_THRESHOLD=max)"
    if os.environ.get("MALLOC_MMAP_MAX_") == "0" and os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return (
            f"retained (environment: MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_={os.environ['MALLOC_TRIM_THRESHOLD_']})"
        )
    return "system default"
