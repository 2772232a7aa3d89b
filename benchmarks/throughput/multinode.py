"""FDG on two "nodes" over this machine's loopback, under DeepSpeed's own launcher: same weights as on one node.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.throughput.multinode                   # every case below, ~1-2 min on two idle cores
    python -m benchmarks.throughput.multinode --cases k4 --keep out/multinode

Each case trains the same FDG job (a seeded 8-layer MLP, SGD with momentum, 3 ``train_batch()`` calls
of 4 ticks, then ``drain()``) twice:

    # one node
    deepspeed --num_gpus W --master_addr 127.0.0.1 --master_port P multinode.py --worker ...
    # two nodes: one launcher per node, started together (--launcher torchrun: torchrun --nnodes 2 --node_rank i)
    deepspeed --hostfile hosts --no_ssh --node_rank 0 --master_addr 127.0.0.1 --master_port P multinode.py --worker ...
    deepspeed --hostfile hosts --no_ssh --node_rank 1 --master_addr 127.0.0.1 --master_port P multinode.py --worker ...

with ``hosts`` listing ``node0 slots=W/2`` and ``node1 slots=W/2``: each launcher starts its node's
ranks (global ranks node_rank * W/2 + local rank), and they meet at the rendezvous on 127.0.0.1:P.
Every rank saves its stage's final weights; the two runs must agree bit for bit (``torch.equal``),
and both must equal :func:`fdg_schedule.fdg_reference` run in this process (``assert_close``).

    case      K   DP  ranks/node  what crosses the "network" (between node 0 and node 1)
    k2        2   1   1           stage 0 <-> stage 1: every activation and gradient
    k4        4   1   2           stage 1 <-> stage 2; stages 0-1 and 2-3 talk inside their node
    k2dp2     2   2   2           stage 0 dp r <-> stage 1 dp r; each stage's gradient all-reduce stays inside its node

DeepSpeed orders ranks pipe-major (``rank = stage * DP + dp_id``), so with DP > 1 a stage's
data-parallel group sits on consecutive ranks, i.e. on one node when DP divides the ranks per node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, before torch is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common.launchers import run_launchers  # noqa: E402
from fdg_schedule.tools.launch import free_port, remove_shared_memory  # noqa: E402

IN, HIDDEN, CLASSES, BLOCKS = 16, 32, 4, 7  # the MLP: 7 (linear, tanh) blocks and a linear head: 8 layers
MICRO, GAS, CALLS = 4, 4, 3  # per data-parallel rank; 12 micro-batches, then a drain
LR, MOMENTUM, GRAD_SHRINK = 0.05, 0.9, 0.5
CASES: dict[str, dict[str, int]] = {
    "k2": {"stages": 2, "dp": 1, "per_node": 1},
    "k4": {"stages": 4, "dp": 1, "per_node": 2},
    "k2dp2": {"stages": 2, "dp": 2, "per_node": 2},
}


# ---------------------------------------------------------------------------------------------------
# The job (rank side and reference side build the same seeded layers)


class Block(nn.Module):
    """A linear layer (then tanh) whose weights come from its own seed."""

    def __init__(self, n_in: int, n_out: int, seed: int, activation: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.activation = activation
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
            self.linear.bias.copy_(torch.randn(n_out, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return torch.tanh(y) if self.activation else y


class Chain(nn.Module):
    """Layers in sequence, registered under their global index as in a PipelineModule ("3.linear.weight")."""

    def __init__(self, layers: list[nn.Module], start: int) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(start + i), layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


def build_layers() -> list[nn.Module]:
    """The MLP as 8 layers; each draws its weights from its own seed, so every stage starts equal."""
    sizes = [IN] + [HIDDEN] * BLOCKS
    blocks: list[Any] = [Block(a, b, seed) for seed, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
    return [*blocks, Block(HIDDEN, CLASSES, BLOCKS, activation=False)]


def micro_batches(count: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole job's micro-batches (``size`` = micro-batch per rank x DP), one seed for all runs."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(size, IN, generator=g), torch.randint(0, CLASSES, (size,), generator=g)) for _ in range(count)]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def fdg_block(weights: str, activations: str) -> dict[str, Any]:
    return {"grad_shrink": GRAD_SHRINK, "weights": weights, "activations": activations, "timeout": 120}


def worker(args: argparse.Namespace) -> None:
    """One rank under the launcher: train, drain, save this stage's weights to ``<out>/rank<r>.pt``."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import fdg_schedule  # noqa: F401  ("schedule": "fdg" builds the FDG engine)

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    module = PipelineModule(layers=build_layers(), num_stages=args.stages, loss_fn=loss_fn, partition_method="uniform")
    dp = world // args.stages
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "pipeline": {"schedule": "fdg", "fdg": fdg_block(args.weights, args.activations)},
    }
    engine, *_ = deepspeed.initialize(
        model=module,
        config=config,
        optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
        model_parameters=module.parameters(),
    )
    dp_id = module._grid.data_parallel_id
    # Each data-parallel rank reads its slice of the job's micro-batches (the reference reads them whole).
    data = [(x[dp_id * MICRO : (dp_id + 1) * MICRO], y[dp_id * MICRO : (dp_id + 1) * MICRO])
            for x, y in micro_batches(GAS * CALLS, MICRO * dp)]  # fmt: skip
    it = iter(data)
    losses = [engine.train_batch(it).item() for _ in range(CALLS)]
    losses.append(engine.drain().item())
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    record = {
        "rank": rank,
        # this node's --node_rank: CROSS_RANK from deepspeed.launcher.launch, GROUP_RANK from torchrun
        "node": int(os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", 0))),
        "stage_id": engine.stage_id,
        "dp_id": dp_id,
        "parts": list(module.parts),
        "losses": losses,
        "state": state,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"rank{rank}.pt")


# ---------------------------------------------------------------------------------------------------
# The driver: launch, compare


def launch_commands(launcher: str, nodes: int, per_node: int, port: int, hostfile: Path | None) -> list[list[str]]:
    """One command prefix per node: DeepSpeed's launcher (``--no_ssh``, one invocation per node) or torchrun."""
    bin_dir = Path(sys.executable).parent
    rendezvous = ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    if launcher == "torchrun":
        return [[str(bin_dir / "torchrun"), "--nnodes", str(nodes), "--node_rank", str(node), "--nproc_per_node",
                 str(per_node), *rendezvous] for node in range(nodes)]  # fmt: skip
    if nodes == 1:
        return [[str(bin_dir / "deepspeed"), "--num_gpus", str(per_node), *rendezvous]]
    return [[str(bin_dir / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), *rendezvous]
            for node in range(nodes)]  # fmt: skip


def run_case(
    name: str,
    workdir: Path,
    weights: str = "current",
    activations: str = "stored",
    launcher: str = "deepspeed",
    deadline_s: float = 300,
) -> dict[str, Any]:
    """Run case ``name`` on one node and on two; returns both runs' per-rank records and the commands."""
    case = CASES[name]
    world = case["stages"] * case["dp"]
    hostfile = workdir / f"{name}-hostfile"
    hostfile.write_text(f"node0 slots={case['per_node']}\nnode1 slots={case['per_node']}\n")
    commands, records, ports = {}, {}, {}
    for label, nodes in (("one_node", 1), ("two_nodes", 2)):
        out = workdir / f"{name}-{label}"
        module = ["-m" if launcher == "torchrun" else "--module", "benchmarks.throughput.multinode"]  # from ROOT
        script = [*module, "--worker", "--stages", str(case["stages"]), "--weights", weights,
                  "--activations", activations, "--out", str(out)]  # fmt: skip
        port = ports[label] = free_port()
        prefixes = launch_commands(launcher, nodes, world // nodes, port, hostfile)
        commands[label] = [prefix + script for prefix in prefixes]
        try:
            run_launchers(commands[label], deadline_s, workdir / f"{name}-{label}")
        finally:
            remove_shared_memory(port)
        records[label] = load_records(out, world)
    return {**records, "commands": commands, "ports": ports, "hostfile": hostfile.read_text()}


def load_records(directory: Path, world: int) -> list[dict[str, Any]]:
    missing = [r for r in range(world) if not (directory / f"rank{r}.pt").exists()]
    if missing:
        raise RuntimeError(f"ranks {missing} wrote no weights into {directory}")
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(world)]


def reference_states(name: str, weights: str, activations: str) -> list[dict[str, Any]]:
    """Each stage's weights after the same job in one process, by :func:`fdg_schedule.fdg_reference`."""
    from deepspeed.runtime import utils as ds_utils

    from fdg_schedule import FDGConfig, fdg_reference

    case = CASES[name]
    layers = build_layers()
    parts = ds_utils.partition_uniform(len(layers), case["stages"])  # what partition_method="uniform" does
    stages = [Chain(layers[a:b], a) for a, b in zip(parts[:-1], parts[1:])]
    optimizers = [torch.optim.SGD(s.parameters(), lr=LR, momentum=MOMENTUM) for s in stages]
    config = FDGConfig(grad_shrink=GRAD_SHRINK, weights=weights, activations=activations)
    data = micro_batches(GAS * CALLS, MICRO * case["dp"])
    fdg_reference(stages, optimizers, data, loss_fn, config, drain=True)
    return [s.state_dict() for s in stages]


def compare(name: str, runs: dict[str, Any], weights: str, activations: str) -> dict[str, Any]:
    """Bit-for-bit equality between the two runs, closeness to the reference; raises on a mismatch."""
    reference = reference_states(name, weights, activations)
    rows = []
    for one, two in zip(runs["one_node"], runs["two_nodes"]):
        if (one["stage_id"], one["dp_id"]) != (two["stage_id"], two["dp_id"]):
            raise AssertionError(f"rank {one['rank']} holds another stage on one node than on two: {one} vs {two}")
        if one["state"].keys() != two["state"].keys():
            raise AssertionError(f"rank {one['rank']}: parameter names differ")
        unequal = [k for k in one["state"] if not torch.equal(one["state"][k], two["state"][k])]
        if unequal:
            raise AssertionError(f"{name}: rank {one['rank']} (stage {one['stage_id']}) differs between one node and "
                                 f"two nodes in {unequal}")  # fmt: skip
        torch.testing.assert_close(two["state"], reference[two["stage_id"]], msg=lambda m: f"{name}: {m}")
        rows.append({"rank": two["rank"], "node": two["node"], "stage_id": two["stage_id"], "dp_id": two["dp_id"],
                     "tensors": len(two["state"]), "losses": two["losses"]})  # fmt: skip
    return {"case": name, **CASES[name], "weights": weights, "activations": activations, "ranks": rows,
            "equal_bitwise": True, "close_to_reference": True}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from " + ", ".join(CASES))
    parser.add_argument("--weights", default="current", choices=["current", "stashed"])
    parser.add_argument("--activations", default="stored", choices=["stored", "recomputed"])
    parser.add_argument("--launcher", default="deepspeed", choices=["deepspeed", "torchrun"])
    parser.add_argument("--keep", default=None, help="keep the logs and weights in this folder")
    parser.add_argument("--deadline", type=float, default=300, help="seconds per launch")
    # rank side (under the launcher)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return []
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown} in --cases; known: {sorted(CASES)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            started = time.monotonic()
            runs = run_case(name, workdir, args.weights, args.activations, args.launcher, args.deadline)
            result = compare(name, runs, args.weights, args.activations)
            result["seconds"] = round(time.monotonic() - started, 1)
            result["commands"] = {k: [" ".join(c) for c in v] for k, v in runs["commands"].items()}
            results.append(result)
            nodes = sorted({(r["node"], r["stage_id"]) for r in result["ranks"]})
            print(f"{name}: K={result['stages']} DP={result['dp']}, (node, stage) {nodes}: weights equal bit for bit "
                  f"on one node and two, and equal fdg_reference ({result['seconds']} s)", flush=True)  # fmt: skip
        if args.keep:
            (workdir / "multinode.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
