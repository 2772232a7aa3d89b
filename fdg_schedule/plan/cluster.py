"""The machines a plan runs on: devices per node, links inside and between nodes, and where each rank sits.

Ranks are laid out as DeepSpeed's ``PipeDataParallelTopology`` does (pipe-major): the rank of stage
``s``, data-parallel replica ``d`` is ``s * dp + d``, and node ``n`` holds ranks ``n * G ... n * G + G - 1``
(``G`` = ``gpus_per_node``). So a stage's data-parallel group is ``dp`` consecutive ranks: on one
node when ``dp`` divides ``G``, and a stage boundary crosses nodes where ``(s+1) * dp`` does.

Note [link model]: a message of ``b`` bytes takes ``latency + b / bandwidth``. Inside a node each
rank has its own link (NVLink/NVSwitch-like: no sharing). Between nodes a node's network bandwidth
is one figure (all its NICs together) shared by the data-parallel replicas of the stage that send at
the same time; messages from one rank leave in the order they were posted. A data-parallel
all-reduce is a ring: ``2 (p-1)/p * bytes`` through the slowest link of the ring plus ``2 (p-1)``
latencies; a ring that leaves the node shares the node's network with the other stages on that node
whose rings leave it too. Point-to-point traffic and all-reduces do not slow each other.
"""

from __future__ import annotations

import dataclasses
import re

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes of identical devices; bandwidths are bytes per second in one direction."""

    gpus_per_node: int = 8
    """Devices (ranks) per node."""
    intra_bandwidth: float = 150 * GB
    """Per device, to another device of its node (bytes/s)."""
    intra_latency: float = 5e-6
    """Seconds per message inside a node."""
    inter_bandwidth: float = 12.5 * GB
    """Per node, all its network interfaces together, to other nodes (bytes/s)."""
    inter_latency: float = 10e-6
    """Seconds per message between nodes."""
    memory: float = 80 * GB
    """Bytes of memory per device (the default memory limit)."""
    name: str = "custom"

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        for key in ("intra_bandwidth", "inter_bandwidth", "memory"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("intra_latency", "inter_latency"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0 seconds, got {getattr(self, key)!r}")

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


# Named clusters: what the docs' scaling settings and the calibration use. Bandwidths are the
# vendors' per-direction figures derated to what NCCL typically reaches (stated in docs/scaling.md).
CLUSTERS: dict[str, Cluster] = {
    # DGX A100: NVSwitch 600 GB/s bidirectional per GPU -> 300 GB/s one way, ~70% reached;
    # one 100 Gb/s network port per node (12.5 GB/s), ~90% reached.
    "a100-100gbe": Cluster(8, 210 * GB, 5e-6, 11 * GB, 15e-6, 80 * GB, "a100-100gbe"),
    # DGX H100: NVLink 4 900 GB/s bidirectional -> 450 GB/s one way, ~70% reached; 8 x 400 Gb/s
    # InfiniBand per node (400 GB/s), ~80% reached.
    "h100-ib": Cluster(8, 315 * GB, 5e-6, 320 * GB, 10e-6, 80 * GB, "h100-ib"),
    # The same nodes with one 400 Gb/s port per node.
    "h100-400g": Cluster(8, 315 * GB, 5e-6, 40 * GB, 10e-6, 80 * GB, "h100-400g"),
    # H200 (HGX): NVLink as H100, 141 GB per device, 8 x 400 Gb/s.
    "h200-ib": Cluster(8, 315 * GB, 5e-6, 320 * GB, 10e-6, 141 * GB, "h200-ib"),
    # The FDG paper's kind of machine: GPUs on PCIe 3.0 x16 in one host (~10 GB/s reached).
    "pcie3": Cluster(8, 10 * GB, 10e-6, 1 * GB, 50e-6, 11 * GB, "pcie3"),
    # This repository's CI machine: ranks are CPU processes talking gloo over loopback; measured
    # ~110 us one way for small messages, ~0.45 ms at 1 MiB, ~1.2 ms at 4 MiB (about 3.5 GB/s).
    "cpu-gloo": Cluster(64, 3.5 * GB, 110e-6, 3.5 * GB, 110e-6, 24 * GB, "cpu-gloo"),
}

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_SIZE_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
               "TiB": 2**40}  # fmt: skip
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str, flag: str) -> float:
    """``"100Gb/s"`` (bits) or ``"25GB/s"`` (bytes) -> bytes per second; the error names ``flag``."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kKMGT]?)(b|bit|B)/s\s*", text)
    if not match:
        raise ValueError(f"{flag} {text!r} is not a bandwidth; write e.g. 100Gb/s (bits) or 25GB/s (bytes)")
    value = float(match.group(1)) * _PREFIX[match.group(2)]
    return value if match.group(3) == "B" else value / 8


def parse_size(text: str, flag: str) -> float:
    """``"80GB"`` / ``"80GiB"`` -> bytes; the error names ``flag``."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"{flag} {text!r} is not a size; write e.g. 80GB or 80GiB")
    return float(match.group(1)) * _SIZE_UNITS[match.group(2)]


def parse_time(text: str, flag: str) -> float:
    """``"5us"`` / ``"0.1ms"`` -> seconds; the error names ``flag``."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-zµ]*)\s*", text)
    if not match or match.group(2) not in _TIME_UNITS:
        raise ValueError(f"{flag} {text!r} is not a time; write e.g. 5us or 0.1ms")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which node holds each (stage, replica) of a ``stages`` x ``dp`` job on ``cluster``."""

    cluster: Cluster
    stages: int
    dp: int

    def rank(self, stage: int, replica: int = 0) -> int:
        return stage * self.dp + replica

    def node(self, stage: int, replica: int = 0) -> int:
        return self.cluster.node(self.rank(stage, replica))

    @property
    def nodes(self) -> int:
        return -(-self.stages * self.dp // self.cluster.gpus_per_node)

    def crosses_nodes(self, stage_a: int, stage_b: int) -> bool:
        """Whether replica 0 of ``stage_a`` and of ``stage_b`` sit on different nodes."""
        return self.node(stage_a) != self.node(stage_b)

    def senders_sharing_nic(self, stage: int) -> int:
        """Replicas of ``stage`` on replica 0's node: they send across nodes at the same moments."""
        home = self.node(stage)
        return sum(1 for d in range(self.dp) if self.node(stage, d) == home)

    def transfer_s(self, src_stage: int, dst_stage: int, nbytes: float) -> tuple[float, float, bool]:
        """``(occupancy, latency, inter_node)`` of one message from ``src_stage`` to ``dst_stage`` (replica 0).

        ``occupancy`` is how long it holds the sender's link (bytes / bandwidth share); it arrives
        ``latency`` after leaving it.
        """
        c = self.cluster
        if self.crosses_nodes(src_stage, dst_stage):
            return nbytes * self.senders_sharing_nic(src_stage) / c.inter_bandwidth, c.inter_latency, True
        return nbytes / c.intra_bandwidth, c.intra_latency, False

    def allreduce_s(self, stage: int, nbytes: float) -> float:
        """Seconds of the ring all-reduce of ``nbytes`` over ``stage``'s data-parallel group (0 if dp = 1)."""
        p = self.dp
        if p == 1 or nbytes == 0:
            return 0.0
        c = self.cluster
        nodes = {self.node(stage, d) for d in range(p)}
        volume = 2 * (p - 1) / p * nbytes
        if len(nodes) == 1:
            return volume / c.intra_bandwidth + 2 * (p - 1) * c.intra_latency
        # Rings of every stage on this node leave it at the same time and share its network.
        home = self.node(stage)
        rings = sum(
            1
            for s in range(self.stages)
            if any(self.node(s, d) == home for d in range(p)) and len({self.node(s, d) for d in range(p)}) > 1
        )
        bandwidth = min(c.intra_bandwidth, c.inter_bandwidth / max(1, rings))
        return volume / bandwidth + 2 * (p - 1) * c.inter_latency
