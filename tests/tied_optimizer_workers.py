"""Rank-side code of the tied-copies-per-optimizer tests: a Megatron-style job (an embedding tied to the head)
under every optimizer DeepSpeed builds from its config, and client optimizers (tests/test_tied_optimizers.py).

Kept free of ``fdg_schedule`` imports at module level, as tests/engine_workers.py is.
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import Tensor, nn

VOCAB, HIDDEN, MICRO, CALLS = 16, 8, 4, 3


class Embedding(nn.Embedding):
    """The job's embedding: an ``nn.Embedding`` subclass, as Megatron's is."""


def head(module: nn.Module, x: Tensor) -> Tensor:
    """Megatron's output head: the hidden state times the tied embedding's weight."""
    return x @ module.weight.t()


def layers(key: str) -> list[Any]:
    """12 layers: the embedding, five Linear(8, 8) + Tanh pairs, and the head tied to the embedding."""
    body = [spec for _ in range(5) for spec in (LayerSpec(nn.Linear, HIDDEN, HIDDEN), LayerSpec(nn.Tanh))]
    return [
        TiedLayerSpec(key, Embedding, VOCAB, HIDDEN, tied_weight_attr="weight"),
        *body,
        TiedLayerSpec(key, Embedding, VOCAB, HIDDEN, forward_fn=head, tied_weight_attr="weight"),
    ]


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.float(), labels)


def optimizer_block(case: dict[str, Any]) -> dict[str, Any] | None:
    """The config's ``optimizer`` block (None: a client optimizer)."""
    name = case["optimizer"]
    if name.startswith("client"):
        return None
    params: dict[str, Any] = {"lr": 0.01, **case.get("params", {})}
    if name == "SGD":
        params.setdefault("momentum", 0.9)
    return {"type": name, "params": params}


class Rigid(torch.optim.SGD):
    """An optimizer whose constructor needs an argument its ``defaults`` do not hold: FDG cannot build a tied
    optimizer from it."""

    def __init__(self, params: Any, scale: float) -> None:
        super().__init__(params, lr=0.01 * scale)


def client_optimizer(case: dict[str, Any]) -> Any:
    if case["optimizer"] == "client_rigid":
        return lambda params: Rigid(params, 2.0)
    kind = {"client_adam": torch.optim.Adam, "client_adamw": torch.optim.AdamW, "client_sgd": torch.optim.SGD}
    extra = {"momentum": 0.9, "nesterov": True} if case["optimizer"] == "client_sgd" else {"weight_decay": 0.1}
    return lambda params: kind[case["optimizer"]](params, lr=0.01, **extra)


def train(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: this rank's stage, the optimizer classes, and its tied copies after every call and the drain."""
    import fdg_schedule  # noqa: F401  (selects the engine from the config)

    return [_train_one(case, world) for case in cases]


def refused(rank: int, world: int, case: dict[str, Any]) -> str:
    """The error ``deepspeed.initialize`` raises on this rank for ``case`` ("" if none)."""
    from fdg_schedule import FDGConfigError

    try:
        _train_one(case, world)
    except FDGConfigError as err:
        return str(err)
    return ""


def _train_one(case: dict[str, Any], world: int) -> dict[str, Any]:
    torch.manual_seed(0)  # the copies start equal: DeepSpeed broadcasts them when it builds the module
    model = PipelineModule(
        layers=layers(case.get("key", "emb")), num_stages=case["stages"], loss_fn=loss_fn, partition_method="uniform"
    )
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 4,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "pipeline": {"schedule": "fdg", "fdg": {"grad_shrink": 0.5, "accumulate": case.get("accumulate", 1)}},
    }
    block = optimizer_block(case)
    if block is not None:
        config["optimizer"] = block
    if case.get("bf16"):
        config["bf16"] = {"enabled": True}
    if case.get("zero"):
        config["zero_optimization"] = {"stage": 1}
        if case.get("offload"):
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    client = None if block is not None else client_optimizer(case)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(), optimizer=client)
    dp = world // case["stages"]
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, VOCAB, (MICRO * dp,), generator=g), torch.randint(0, VOCAB, (MICRO * dp,), generator=g))
        for _ in range(4 * CALLS)
    ]
    replica = engine.grid.data_parallel_id
    data = iter([(x[replica * MICRO : (replica + 1) * MICRO], y[replica * MICRO : (replica + 1) * MICRO])
                 for x, y in batches])  # fmt: skip
    copies = []
    for _ in range(CALLS):
        engine.train_batch(data)
        copies.append(_tied_copies(engine))
    engine.drain()
    copies.append(_tied_copies(engine))
    return {
        "stage_id": engine.stage_id,
        "optimizer": type(engine.basic_optimizer).__name__,
        "tied_optimizers": [type(c.optimizer).__name__ for c in engine._tied.copies],
        "copies": copies,
    }


def _tied_copies(engine: Any) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in engine.module.named_parameters() if name.startswith("tied_modules")}
