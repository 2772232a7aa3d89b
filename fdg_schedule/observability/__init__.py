"""fdg_schedule.observability (see docs/architecture.md)."""
