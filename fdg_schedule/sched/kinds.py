"""The kinds an instruction's time counts as, torch-free (the planner reads traces by them)."""

import enum


class Kind(enum.Enum):
    """What an instruction's time counts as: ``fdg_stats["<kind>_s"]``, W&B ``fdg/<kind>_s``, trace category."""

    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"
    REDUCE = "reduce"
    WAIT = "wait"
    LOAD = "load"
    EXCHANGE = "exchange"
