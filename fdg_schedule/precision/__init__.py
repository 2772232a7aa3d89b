"""fdg_schedule.precision (see docs/architecture.md)."""
