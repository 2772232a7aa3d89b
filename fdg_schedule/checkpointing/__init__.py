"""fdg_schedule.checkpointing (see docs/architecture.md)."""

from __future__ import annotations

from typing import Any

from fdg_schedule import _moved


def __getattr__(name: str) -> Any:
    """A module that moved out of this subpackage, with a warning (Note [old module paths] in fdg_schedule._moved)."""
    return _moved.resolve(__name__, name)
