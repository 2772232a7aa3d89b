"""The transports ``pipeline.fdg.transport`` names: one entry each, built per exchange, and ``"auto"`` resolved.

Adding a transport (docs/architecture.md, "Where each kind of change goes"): a module with a
:class:`~fdg_schedule.exchange.link.Link` and a :class:`~fdg_schedule.exchange.link.Transport` (the shared-memory
one, :mod:`fdg_schedule.exchange.shm_transport`, is the example), its entry in :data:`TRANSPORTS`, and its name in
the config key's choices (``fdg_schedule.base.config.TRANSPORTS``; tests/test_link.py checks the two agree).

Note [the fastest transport by default]: ``pipeline.fdg.transport: "auto"`` (the default) is ``"shm"`` where
the shared-memory link can run (Linux, and the BLOCKING path: a stage on the CPU whose group is gloo), and
``"process_group"`` everywhere else (:func:`resolve_transport`). Under ``"shm"`` each side still checks that its
neighbour shares the host, and neighbours on other hosts keep the group, so "auto" never changes where a
message can go, only how. Measured at K = 2 on this project's CPU machine (docs/performance.md, issue 62's seven
nets at GAS 4), FDG over the link read 0.92-0.98 of the two-stage ceiling and over the process group 0.87-0.96:
gloo moves every message through a socket and a transport thread of its own that competes with the stages'
compute for the cores.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.exchange.link import Place, Transport
from fdg_schedule.exchange.process_group import Path, ProcessGroupTransport
from fdg_schedule.exchange.shm_transport import SharedMemoryTransport

TRANSPORTS: dict[str, Callable[[Place], Transport]] = {
    "process_group": ProcessGroupTransport,  # every message through DeepSpeed's process group
    "shm": SharedMemoryTransport,  # neighbours on one host through shared memory (Note [shared-memory transport])
}


def resolve_transport(transport: str, path: Path, platform: str = sys.platform) -> str:
    """``pipeline.fdg.transport`` as it will run: ``"auto"`` becomes ``"shm"`` on Linux on the BLOCKING path and
    ``"process_group"`` elsewhere (Note [the fastest transport by default]); the other values stay as given."""
    if transport != "auto":
        return transport
    return "shm" if path is Path.BLOCKING and platform.startswith("linux") else "process_group"


def build(transport: str, place: Place) -> Transport:
    """The transport named ``transport`` (resolved) for a stage at ``place``; building it may be collective."""
    if transport not in TRANSPORTS:
        raise FDGRuntimeError(
            f"transport must be one of {sorted(TRANSPORTS)}, got {transport!r} (pipeline.fdg.transport in ds_config)"
        )
    return TRANSPORTS[transport](place)
