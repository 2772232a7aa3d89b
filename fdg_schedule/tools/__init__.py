"""fdg_schedule.tools (see docs/architecture.md)."""
