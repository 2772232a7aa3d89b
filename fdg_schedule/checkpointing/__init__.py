"""fdg_schedule.checkpointing (see docs/architecture.md)."""
