"""fdg_schedule.partitioning (see docs/architecture.md)."""
