"""fdg_schedule.runtime (see docs/architecture.md)."""
