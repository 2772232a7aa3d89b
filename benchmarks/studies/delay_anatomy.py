"""Where FDG's loss under AdamW comes from: its delays one at a time, on the GPT-2 of
docs/results/convergence/lm_convergence.md.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.studies.delay_anatomy --stages 4 --modes sync,fdg,own,cross,consistent

A lock-step simulator, not FDG: in step s every stage takes a gradient of micro-batch s and steps its
own AdamW (stage-local clipping, as the engine). Stage k's gradient is taken on the network whose
stage j holds the weights it had ``lag(k, j)`` steps earlier, and it is applied to stage k's live
weights. FDG without corrections runs micro-batch m's forward on stage j in tick m + j and applies
stage k's gradient in tick m + 2(K-1) - k, so its lags are, to within a step, 2(K-1) - k - j:

    mode        lag(k, j)                       what it isolates
    sync        0                               backprop over K stage optimizers
    fdg         2(K-1) - k - j                  all of FDG's delays
    own         d_k = 2(K-1-k) if j = k, else 0 only a stage's own weights are old
    cross       0 if j = k, else 2(K-1) - k - j only the other stages' weights are old
    consistent  d_k for every j                 the whole network is old, but of one step

Same model, data order, AdamW settings and token budget as benchmarks/convergence/lm_convergence.py; writes
<out>/<mode>_k<K>_s<seed>.json (validation loss every --eval_every steps) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAGS: dict[str, Callable[[int, int, int], int]] = {
    "sync": lambda K, k, j: 0,
    "fdg": lambda K, k, j: 2 * (K - 1) - k - j,
    "own": lambda K, k, j: 2 * (K - 1 - k) if j == k else 0,
    "cross": lambda K, k, j: 0 if j == k else 2 * (K - 1) - k - j,
    "consistent": lambda K, k, j: 2 * (K - 1 - k),
}


def simulate(mode: str, stages: int, seed: int, micro_batches: int, eval_every: int) -> list[tuple[int, float]]:
    """Validation loss every ``eval_every`` steps of ``mode``'s lock-step training."""
    import torch
    from torch.func import functional_call

    from benchmarks.common.lm_runs import gpt2_setup, gpt2_val_loss
    from fdg_schedule.zoo import hf_lm

    lag = LAGS[mode]
    modules, optimizers, batches, val = gpt2_setup(seed, stages, micro_batches)
    history = [deque([_snapshot(m)], maxlen=2 * stages) for m in modules]  # history[j][-1]: stage j now

    def weights(j: int, steps_ago: int) -> dict[str, torch.Tensor]:
        return history[j][-1 - min(steps_ago, len(history[j]) - 1)]  # before step 0: the initial weights

    curve = []
    for s, (block, target) in enumerate(batches):
        grads: dict[tuple[int, ...], list[dict[str, torch.Tensor]]] = {}  # one backward per distinct lag row
        for k, module in enumerate(modules):
            row = tuple(lag(stages, k, j) for j in range(stages))
            if row not in grads:
                leaves = [
                    {n: t.clone().requires_grad_(True) for n, t in weights(j, a).items()} for j, a in enumerate(row)
                ]
                x = block
                for m, params in zip(modules, leaves, strict=True):
                    x = functional_call(m, params, (x,))
                loss = hf_lm.lm_loss(x, target)
                flat = [t for params in leaves for t in params.values()]
                values = iter(torch.autograd.grad(loss, flat, allow_unused=True))
                grads[row] = [{n: next(values) for n in params} for params in leaves]
            for n, p in module.named_parameters():
                g = grads[row][k][n]
                p.grad = None if g is None else g.detach()
        for module, optimizer, past in zip(modules, optimizers, history, strict=True):
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            past.append(_snapshot(module))
        if (s + 1) % eval_every == 0 or s + 1 == len(batches):
            curve.append(((s + 1) * 1024, gpt2_val_loss(modules, val)))
    return curve


def _snapshot(module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--modes", default="sync,fdg,own,cross,consistent", help=f"comma-separated, of {sorted(LAGS)}")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--micro_batches", type=int, default=800)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "delay_anatomy")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(LAGS))
    if unknown:
        raise SystemExit(f"delay_anatomy.py: error: --modes {','.join(unknown)}: not one of {sorted(LAGS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    finals = {}
    for mode in modes:
        path = args.out / f"{mode}_k{args.stages}_s{args.seed}.json"
        if not path.exists():  # a stopped queue resumes where it stopped
            start = time.time()
            curve = simulate(mode, args.stages, args.seed, args.micro_batches, args.eval_every)
            path.write_text(json.dumps({"mode": mode, "val": curve, "wall_s": round(time.time() - start)}))
        finals[mode] = json.loads(path.read_text())["val"][-1][1]
    sync = finals.get("sync")
    print("| mode | final val loss | vs sync |\n|---|---:|---:|")
    for mode, final in finals.items():
        print(f"| {mode} | {final:.3f} | {'n/a' if sync is None else f'{(final - sync) / sync:+.1%}'} |")


if __name__ == "__main__":
    main()
