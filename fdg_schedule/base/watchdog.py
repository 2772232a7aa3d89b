"""The failure timeout of stream-ordered transfers, kept by a thread so that the host never blocks on one.

Note [a timeout without a blocking wait]: under NCCL a stage's compute stream waits for a receive
(``work.wait()`` orders the stream after the transfer and returns at once), so no host wait can
time out when a neighbour dies. Instead every such transfer is handed to a :class:`Watchdog` with
a deadline: ``pipeline.fdg.timeout`` from when the stream reaches the transfer, not from when the
host posted it (the host runs ahead of its stream by up to a whole queue of ticks; a deadline from
the post would fail a healthy neighbour whenever ticks are long). The exchange records an
accelerator event on the compute stream right after each post (:func:`stream_mark`) and wraps the
work in a :class:`StreamWork`; the deadline starts when that event is first seen complete. A daemon
thread polls ``work.is_completed()`` and the events (queries, never waits); when a deadline passes
it records an :class:`~fdg_schedule.base.errors.FDGRuntimeError` naming the neighbour, logs it, and the
main thread raises it at its next exchange call. A main thread that never returns there (stuck in a device
synchronisation behind the transfer that will not come) is ended after a grace period with exit
code :data:`EXIT_CODE`, the message already in its log: a failed neighbour ends every rank, never
a hang. This path cannot run on the CPU-only machines the test suite runs on (NCCL needs GPUs);
its logic is unit-tested there with stand-in works (tests/test_comm.py).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger
from torch import Tensor

from fdg_schedule.base.errors import FDGRuntimeError

EXIT_CODE = 75  # a rank ended by its watchdog


class Work(Protocol):
    def is_completed(self) -> bool: ...


def stream_mark() -> Callable[[], bool]:
    """Whether the current stream has reached this point: an accelerator event recorded now, queried (never waited)."""
    event_class = get_accelerator().Event  # DeepSpeed's accelerator API: torch.cuda.Event, ...; None on the CPU
    if event_class is None:  # no stream: the host is where the transfer starts
        return lambda: True
    event = event_class()
    event.record()  # on the current stream, right after the post
    return event.query


class StreamWork:
    """A stream-ordered transfer with the mark of the point its stream reaches it (Note [a timeout without a
    blocking wait]): ``wait()`` orders the current stream after it, ``started()`` says whether its clock runs."""

    def __init__(self, work: Any, reached: Callable[[], bool]) -> None:
        self.work, self.reached = work, reached

    def wait(self) -> Any:
        return self.work.wait()

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def started(self) -> bool:
        return bool(self.reached())


def _started(works: Sequence[Work]) -> bool:
    """Whether the stream has reached every one of ``works`` (a work without a mark: from the start)."""
    return all(w.started() for w in works if isinstance(w, StreamWork))


def _exit(error: FDGRuntimeError) -> None:
    logger.error(f"{error}; the main thread did not return to the exchange: exiting with code {EXIT_CODE}")
    os._exit(EXIT_CODE)


class Watchdog:
    """Fails the stage when a watched transfer is not complete by its deadline.

    Args:
        timeout_s: seconds from when the stream reaches a watched transfer (from :meth:`watch` for a
            work without a mark) to its deadline.
        describe: this stage, for the message (``"stage 1 (global rank 1)"``).
        on_stuck: called with the error when the main thread has not raised it ``grace_s`` after
            the deadline (default: log and exit the process).
        poll_s: how often the thread queries the works.
    """

    def __init__(
        self,
        timeout_s: float,
        describe: str,
        on_stuck: Callable[[FDGRuntimeError], None] = _exit,
        poll_s: float = 0.05,
        grace_s: float | None = None,
    ) -> None:
        self.timeout_s, self.describe, self.on_stuck, self.poll_s = timeout_s, describe, on_stuck, poll_s
        self.grace_s = min(timeout_s, 30.0) if grace_s is None else grace_s
        self.failure: FDGRuntimeError | None = None
        self._reported = threading.Event()
        self._watched: list[tuple[list[Work], float | None, str]] = []  # works, deadline (None: not reached), what
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def watch(self, works: Sequence[Work], what: str) -> None:
        """Fail unless every one of ``works`` completes within the timeout of the stream reaching it; ``what``
        names the transfer."""
        if not works:
            return
        deadline = time.monotonic() + self.timeout_s if _started(works) else None
        with self._lock:
            self._watched.append((list(works), deadline, what))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fdg-watchdog", daemon=True)
            self._thread.start()

    def watching(self) -> int:
        """Transfers not yet seen complete."""
        with self._lock:
            return len(self._watched)

    def raise_if_failed(self) -> None:
        """Raise the recorded failure in the calling (main) thread."""
        if self.failure is not None:
            self._reported.set()
            raise self.failure

    def poll(self) -> None:
        """One look at the watched works (the thread calls it every ``poll_s``; tests call it directly)."""
        now = time.monotonic()
        with self._lock:
            pending = [(w, d, what) for w, d, what in self._watched if not all(x.is_completed() for x in w)]
            started = [d if d is not None or not _started(w) else now + self.timeout_s for w, d, _ in pending]
            self._watched = [(w, deadline, what) for (w, _, what), deadline in zip(pending, started)]
            late = [what for _, deadline, what in self._watched if deadline is not None and deadline <= now]
        if late and self.failure is None:
            self.failure = FDGRuntimeError(
                f"{self.describe}: gave up waiting for {late[0]} (timeout {self.timeout_s:g} s): that rank failed, "
                "was killed or stopped sending -- see its log (the wait is pipeline.fdg.timeout)"
            )
            logger.error(str(self.failure))

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            self.poll()
            if self.failure is not None:
                if not self._reported.wait(self.grace_s):
                    self.on_stuck(self.failure)
                return


class InFlightSends:
    """Send buffers of stream-ordered transfers, kept alive until their transfer completes.

    A stream-ordered send returns before the communication stream has read the buffer; dropping the
    last Python reference would hand its memory back to the caching allocator, and the next kernel
    on the compute stream could overwrite it mid-transfer. Each buffer stays referenced here until
    its work reports completion (:meth:`release_completed`, called at every exchange).
    """

    def __init__(self) -> None:
        self._kept: collections.deque[tuple[Any, list[Tensor]]] = collections.deque()

    def keep(self, works: Sequence[Work], tensors: Sequence[Tensor]) -> None:
        if tensors:
            self._kept.append((list(works), list(tensors)))

    def release_completed(self) -> None:
        """Forget the buffers of every completed transfer (a query per work, never a wait)."""
        self._kept = collections.deque(
            (works, tensors) for works, tensors in self._kept if not all(w.is_completed() for w in works)
        )

    def held(self) -> int:
        return sum(len(tensors) for _, tensors in self._kept)
