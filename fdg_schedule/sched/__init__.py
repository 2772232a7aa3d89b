"""fdg_schedule.sched (see docs/architecture.md)."""
