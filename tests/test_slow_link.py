"""The slowed link of benchmarks/throughput/slow_link.py: a wire thread delivers one link's records in order, each
at least ``c`` after the previous one; with no delay and nothing queued, at once. Pure: no process group."""

from __future__ import annotations

import threading
import time
from typing import Any

from benchmarks.throughput import slow_link
from benchmarks.throughput.slow_link import Wire


class FakeLink:
    def __init__(self) -> None:
        self.delivered: list[tuple[float, int]] = []
        self.done = threading.Event()


def post(link: FakeLink, kind: Any, direction: Any, seq: int, nbytes: int) -> None:
    link.delivered.append((time.monotonic(), seq))
    if seq == 3:
        link.done.set()


def test_a_slowed_link_delivers_in_order_one_link_time_apart(monkeypatch) -> None:
    monkeypatch.setattr(Wire, "delay_s", 0.02)
    link = FakeLink()
    wire = Wire(link, post)
    start = time.monotonic()
    for seq in (1, 2, 3):
        wire.send("READY", 0, seq, 8)
    assert link.done.wait(10)
    assert [seq for _, seq in link.delivered] == [1, 2, 3]
    at = [start] + [t for t, _ in link.delivered]
    assert all(b - a >= 0.02 - 1e-3 for a, b in zip(at, at[1:])), at  # sleep never ends early


def test_without_a_delay_a_record_is_posted_at_once(monkeypatch) -> None:
    monkeypatch.setattr(Wire, "delay_s", 0.0)
    link = FakeLink()
    Wire(link, post).send("READY", 0, 1, 8)
    assert [seq for _, seq in link.delivered] == [1]  # on this thread, before send returned


def test_the_report_has_a_row_per_link_time() -> None:
    links = [0.0, 0.01]
    ticks = {n: {repr(c): [0.1 + c, 0.11 + c] for c in links} for n in ("before", "after")}
    predicted = {n: {"overhead_s": 0.002, "ticks": [0.1 + c for c in links]} for n in ("before", "after")}
    stages = [{"forward": 0.02, "backward": 0.04, "step": 0.001}] * 2
    result = {"commit": "abc", "before": "def", "stages": stages, "fractions": [0, 0.25], "links_s": links,
              "args": {"rounds": 2}, "ticks": ticks, "predicted": predicted}  # fmt: skip
    rows = [line for line in slow_link.report(result).splitlines() if line.startswith("| ") and "ms" in line[:12]]
    assert len(rows) == 2 and rows[1].startswith("| 10.0 ms | 0.25 |"), rows
