"""How well can a stage forecast its own weights h steps ahead? The error that weight prediction leaves.

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.studies.forecast_error --run ref_k4_b1.0_stashed_dlr1600_p0.0_first --out <file>.json

Trains one of benchmarks/convergence/lm_convergence.py's ``ref_`` runs (the same GPT-2, data, AdamW and FDG
config, on ``fdg_reference``) and, along its real trajectory, asks of every delayed stage k how well
the directions a prediction could use foresee the stage's own displacement over the next h optimizer
steps, D_h(t) = W_k(t + h) − W_k(t) (W_k(t): the live weights at the end of tick t, after the stage's
step of that tick). The candidates are u_γ(t), the average of the stage's steps with decay γ
(``predict_decay``'s δ: u_0 is the last step, W_k(t) − W_k(t − 1)). For each window of ticks the
script sums ⟨D, u⟩, ‖u‖² and ‖D‖² over the ticks and reports

- ``error_at_h``: ‖D − h·u‖ / ‖D‖, the relative error of the prediction as defined
  (ŵ = w + h·δ), 1.0 being no better than no prediction (ŵ = w);
- ``best_scale``: c* / h with c* = Σ⟨D, u⟩ / Σ‖u‖², the scale of u that forecasts best;
- ``error_at_best``: ‖D − c*·u‖ / ‖D‖, the least error any multiple of u leaves, so sqrt(1 − cos²)
  of the window's aggregate angle between D and u;
- ``rms_displacement`` and ``rms_direction``: the root mean square of ‖D_h‖ and of ‖u‖ over the window.
  With γ = 0, rms_displacement / (h · rms_direction) is how far h steps go against h steps in one
  direction: 1 when consecutive steps agree, 1/sqrt(h) when they are independent.

Steps taken with delay_lr's factor are the stage's real steps, so the factor is part of D and u alike.
"""

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common.lm_runs import gpt2_setup, gpt2_val_loss, parse_run, train_reference

GAMMAS = (0.0, 0.5, 0.8, 0.9, 0.95)
WINDOWS = ((0, 100), (100, 400), (400, 10**9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a ref_ run name of benchmarks/convergence/lm_convergence.py")
    parser.add_argument("--micro_batches", type=int, default=800)
    parser.add_argument("--horizons", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run = parse_run(args.run)
    if not run.name.startswith("ref_") or run.cosine:
        raise SystemExit(f"forecast_error.py: error: --run {args.run!r}: a ref_ run without _cos")
    stage_modules, optimizers, batches, val = gpt2_setup(run.seed, run.stages, args.micro_batches, run.lr, run.parts)
    delayed = range(run.stages - 1)
    params = [[p for p in stage_modules[k].parameters() if p.requires_grad] for k in delayed]

    def flat(k: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params[k]])

    past = {k: [flat(k)] for k in delayed}  # W_k at the end of the last max(h) + 1 ticks, newest last
    u = {k: {g: torch.zeros_like(past[k][0]) for g in GAMMAS} for k in delayed}
    kept = {k: [{g: v.clone() for g, v in u[k].items()}] for k in delayed}  # u at those ticks
    sums: dict = {}  # (k, h, gamma, window) -> [<D,u>, |u|^2, |D|^2, ticks]
    depth = max(args.horizons) + 1

    def after_tick(tick: int) -> None:
        for k in delayed:
            w = flat(k)
            step = w - past[k][-1]
            moved = bool(step.any())  # the stage stepped in this tick (not in the fill)
            for g in GAMMAS:
                if moved:
                    u[k][g].mul_(g).add_(step, alpha=1 - g)
            past[k].append(w)
            kept[k].append({g: v.clone() for g, v in u[k].items()})
            del past[k][:-depth], kept[k][:-depth]
            for h in args.horizons:
                if len(past[k]) <= h:
                    continue
                start = tick - h  # the tick whose forecast ends now
                d = w - past[k][-1 - h]
                if not d.any() or not kept[k][-1 - h][0.0].any():
                    continue  # a forecast from the fill, or over ticks without a step
                window = next(i for i, (a, b) in enumerate(WINDOWS) if a <= start < b)
                for g in GAMMAS:
                    v = kept[k][-1 - h][g]
                    row = sums.setdefault((k, h, g, window), [0.0, 0.0, 0.0, 0])
                    row[0] += float(d @ v)
                    row[1] += float(v @ v)
                    row[2] += float(d @ d)
                    row[3] += 1

    losses = train_reference(run, stage_modules, optimizers, batches, after_tick, schedulers=[])

    rows = []
    for (k, h, g, window), (du, uu, dd, n) in sorted(sums.items()):
        c = du / uu if uu else 0.0
        rows.append(
            {
                "stage": k,
                "h": h,
                "gamma": g,
                "ticks": list(WINDOWS[window]),
                "n": n,
                "error_at_h": ((dd - 2 * h * du + h * h * uu) / dd) ** 0.5,
                "best_scale": c / h,
                "error_at_best": (max(0.0, dd - du * du / uu) / dd) ** 0.5 if uu else 1.0,
                "rms_displacement": (dd / n) ** 0.5,  # sqrt of the mean |D_h|^2
                "rms_direction": (uu / n) ** 0.5,  # sqrt of the mean |u|^2 (with gamma 0: the step)
            }
        )
    result = {
        "run": run.name,
        "micro_batches": args.micro_batches,
        "val_loss": gpt2_val_loss(stage_modules, val),
        "final_train_loss": losses[-1],
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1))
    for r in rows:
        if r["gamma"] in (0.0, 0.9) and r["h"] in (2, 6):
            print(r)


if __name__ == "__main__":
    main()
