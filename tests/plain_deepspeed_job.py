"""A DeepSpeed pipeline training script as users write them: it never imports fdg_schedule.

    deepspeed --num_gpus 2 tests/plain_deepspeed_job.py --deepspeed_config ds_config.json --out DIR

Only the config can make it train FDG (tests/test_install.py). Each rank writes DIR/rank<r>.pt: the
class of the engine ``deepspeed.initialize`` built, whether it is a ``deepspeed.PipelineEngine``, the
losses ``train_batch`` returned, the stage's final weights and the modules the process loaded.
"""

import argparse
import os
import sys

import deepspeed
import torch
from deepspeed.pipe import PipelineModule


def layers() -> list[torch.nn.Module]:
    return [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)]


def micro_batches(micro: int):
    """The same endless stream of micro-batches on every rank (stage 0 reads inputs, the last stage labels)."""
    generator = torch.Generator().manual_seed(0)
    while True:
        x = torch.randn(micro, 8, generator=generator)
        yield x, (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4:].sum(dim=1) > 0).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = PipelineModule(
        layers=layers(), num_stages=args.stages, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform"
    )
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    data = micro_batches(engine.train_micro_batch_size_per_gpu())
    losses = [engine.train_batch(data).item() for _ in range(args.steps)]

    rank = torch.distributed.get_rank()
    torch.save(
        {
            "engine": f"{type(engine).__module__}.{type(engine).__qualname__}",
            "is_pipeline_engine": isinstance(engine, deepspeed.PipelineEngine),
            "losses": losses,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "modules": sorted(sys.modules),
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main()
