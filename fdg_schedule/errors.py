"""Exceptions fdg_schedule raises at run time (config errors live in :mod:`fdg_schedule.config`)."""


class FDGRuntimeError(RuntimeError):
    """Something went wrong while a stage ran the FDG schedule; the message names the stage."""
