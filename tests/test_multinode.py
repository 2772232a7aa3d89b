"""benchmarks/throughput/multinode.py: FDG on two launcher-started "nodes" ends with the same weights as on one node.

Each case runs DeepSpeed's own launcher three times (one node; two nodes with ``--no_ssh
--node_rank``) on 127.0.0.1 with gloo, so a case costs ~50-60 s on two cores; CI runs K = 4, and
K = 2 is marked slow.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.throughput import multinode


class Runs:
    """Each case's two runs, made on first use (the K = 2 case only when its slow test is selected)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.done: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self.done:
            self.done[name] = multinode.run_case(name, self.workdir, deadline_s=240)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("multinode"))


@pytest.mark.distributed
@pytest.mark.timeout(540)
@pytest.mark.parametrize(
    "name",
    [
        # K = 4 (two stages per node) covers what K = 2 does (a pipeline link between the nodes, two
        # launchers with --no_ssh --node_rank) and links inside a node, in half the time of both
        pytest.param("k2", marks=pytest.mark.slow),
        "k4",
    ],
)
def test_two_nodes_end_with_the_weights_of_one_node(runs: Runs, name: str) -> None:
    result = multinode.compare(name, runs[name], "current", "stored")  # raises on any difference
    assert result["equal_bitwise"] and result["close_to_reference"]
    placement = sorted((r["node"], r["stage_id"]) for r in result["ranks"])
    expected = {"k2": [(0, 0), (1, 1)], "k4": [(0, 0), (0, 1), (1, 2), (1, 3)]}[name]
    assert placement == expected, "the two launchers did not place the stages on the two nodes"
    assert all(len(r["losses"]) == multinode.CALLS + 1 for r in result["ranks"])


@pytest.mark.distributed
@pytest.mark.timeout(540)
def test_a_one_ulp_difference_is_caught(runs: Runs) -> None:
    changed = copy.deepcopy(runs["k4"])
    state = changed["two_nodes"][2]["state"]
    name = next(iter(state))
    state[name] = torch.nextafter(state[name], torch.full_like(state[name], float("inf")))
    with pytest.raises(AssertionError, match=r"rank 2 \(stage 2\) differs between one node and two nodes"):
        multinode.compare("k4", changed, "current", "stored")


@pytest.mark.distributed
@pytest.mark.timeout(540)
def test_the_two_node_commands_use_deepspeeds_launcher_without_ssh(runs: Runs) -> None:
    two = runs["k4"]["commands"]["two_nodes"]
    assert len(two) == 2
    for node, command in enumerate(two):
        assert Path(command[0]).name == "deepspeed"
        assert command[command.index("--node_rank") + 1] == str(node)
        assert "--no_ssh" in command and command[command.index("--master_addr") + 1] == "127.0.0.1"
    assert runs["k4"]["hostfile"] == "node0 slots=2\nnode1 slots=2\n"
    # each launch's ~70 MB shared-memory buffers per rank are removed (a free port per launch)
    left = [p.name for case in runs.done.values() for port in case["ports"].values()
            for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")]  # fmt: skip
    assert not left, left


def test_an_unknown_case_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        multinode.main(["--cases", "k9"])
    assert "unknown case(s) ['k9'] in --cases; known: ['k2', 'k2dp2', 'k4']" in capsys.readouterr().err
