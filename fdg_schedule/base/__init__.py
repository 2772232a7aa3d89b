"""fdg_schedule.base: the ground floor, the leaf helpers every other subpackage uses (see docs/architecture.md).

Nothing here imports a module of the package outside ``base`` (tests/test_layering.py).
"""
