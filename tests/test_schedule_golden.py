"""Issue 43: the schedule representation changes, the instructions, grids and planner streams do not."""

from __future__ import annotations

import json

from schedule_golden import PATH, cases


def test_schedule_outputs_equal_recorded() -> None:
    recorded = json.loads(PATH.read_text())
    now = cases()
    assert sorted(now) == sorted(recorded)
    differing = [key for key in now if json.loads(json.dumps(now[key])) != recorded[key]]
    assert not differing, differing[:5]
