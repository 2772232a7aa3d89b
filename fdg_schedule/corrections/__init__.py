"""fdg_schedule.corrections (see docs/architecture.md)."""
