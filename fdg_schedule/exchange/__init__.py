"""fdg_schedule.exchange (see docs/architecture.md)."""
