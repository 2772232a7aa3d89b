"""The device check's parts: FDG on a GPU against its references. ``scripts/gpu_check.sh`` runs each part in a
process of its own, bounded, and writes the report; run one by hand as

    PYTHONPATH=.:tests python3 scripts/gpu_check.py env|single|shared|nccl [--timeout-s N]

single  one rank, K = 1, on the GPU: the engine equals plain backprop (computed on the GPU); then steady-state
        ticks under torch.cuda.set_sync_debug_mode("error"), where any host synchronisation raises (Note [no
        host sync in a tick]).
shared  K = 2 and K = 3 with every rank on GPU 0 over gloo (the STAGED path: CUDA tensors through host memory,
        DeepSpeed's own sends too): the engine against fdg_reference on the GPU after every call; a dropout
        model recomputed against the same model stored (the accelerator RNG replayed); a checkpoint saved
        with micro-batches in flight, loaded by a new engine and trained on, against training straight on.
nccl    K = 2 over NCCL, one rank per GPU (the STREAM path), when two or more GPUs are visible: the same
        checks, and "ran, finite, no hang" (every rank returned within the deadline, every loss finite).

With ``DS_ACCELERATOR=cpu`` (``gpu_check.sh --dry-run``) the same parts run on the CPU (gloo, no sync-debug
mode), as tests/test_gpu_check.py runs them. ``--timeout-s``: the shell's timeout around the part, checked
against the part's launcher deadlines (Note [the device check's time bounds] in scripts/gpu_check_plan.py,
which holds them). Every part first points gloo and NCCL at the loopback when it is the only interface up.
A part prints what it checked and ends with one line ``RESULT {"ok": ..., "summary": ...}``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # killed by the shell's timeout regardless, even in an import: print where it was
    faulthandler.register(signal.SIGTERM, chain=True)

import gpu_check_plan as plan  # noqa: E402
import torch  # noqa: E402

TOL = 1e-5  # engine vs reference on the same device: the same kernels, in another order in places
SYNC_FREE_CALLS = 2  # steady-state calls run under the sync-debug mode


def case(stages: int, **kw: Any) -> dict[str, Any]:
    return {"stages": stages, "n": 24, "gas": 3, "calls": 3, "grad_shrink": 0.5, **kw}


def on_gpu() -> bool:
    return os.environ.get("DS_ACCELERATOR") == "cuda" and torch.cuda.is_available()


def build(spec: dict[str, Any], world: int) -> tuple[Any, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """An FDG engine of ``spec`` (tests/engine_workers.py's keys) on this rank's device, and its host-memory data
    (pinned on a GPU: the loader's copies are then asynchronous)."""
    import deepspeed
    import engine_workers
    import toy
    from deepspeed.pipe import PipelineModule

    import fdg_schedule  # noqa: F401  (deepspeed.initialize builds the FDG engine from the config)

    model = PipelineModule(layers=toy.layers(dropout=spec.get("dropout")), num_stages=spec["stages"],
                           loss_fn=toy.loss_fn, partition_method="uniform")  # fmt: skip
    config = engine_workers.ds_config(spec)
    config["checkpoint"] = {"tag_validation": "Ignore"}  # no all-reduce of the tag's hash
    engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=engine_workers.make_optimizer(spec),
                                      model_parameters=model.parameters())  # fmt: skip
    data = toy.micro_batches(spec["n"], 4 * (world // spec["stages"]))
    if on_gpu():
        data = [(x.pin_memory(), y.pin_memory()) for x, y in data]
    return engine, model, data


def reference_states(spec: dict[str, Any], parts: list[int], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every stage's weights after each call of ``spec``, by fdg_schedule.fdg_reference on ``device``."""
    import engine_workers
    import toy

    from fdg_schedule import FDGConfig, fdg_reference

    stages = [s.to(device) for s in toy.reference_stages(parts)]
    optimizers, _ = toy.reference_optimizers(stages, spec)
    gas, calls = spec["gas"], spec["calls"]
    states: list[dict[str, torch.Tensor]] = []

    def after_tick(tick: int) -> None:
        if tick % gas == gas - 1:
            state = {k: v for s in stages for k, v in s.state_dict().items()}
            states.append({k: v.detach().float().to("cpu", copy=True) for k, v in state.items()})  # a snapshot

    data = [(x.to(device), y.to(device)) for x, y in toy.micro_batches(spec["n"], 4)[: calls * gas]]
    config = FDGConfig(**{k: spec[k] for k in engine_workers.FDG_KEYS if k in spec})
    fdg_reference(stages, optimizers, data, toy.loss_fn, config, after_tick=after_tick,
                  clip_grad_norm=spec.get("clip", 0.0))  # fmt: skip
    return states


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in got)


def check(name: str, diff: float, tol: float = TOL, **extra: Any) -> dict[str, Any]:
    return {"name": name, "ok": math.isfinite(diff) and diff <= tol, "max_diff": diff, "tol": tol, **extra}


def train(spec: dict[str, Any], world: int) -> tuple[list[dict[str, torch.Tensor]], list[float], Any, Any]:
    """Train ``spec["calls"]`` calls: the stage's weights after each, the returned losses, the engine and model."""
    import engine_workers

    torch.manual_seed(1234)
    engine, model, data = build(spec, world)
    it = iter(data)
    states, losses = [], []
    for _ in range(spec["calls"]):
        losses.append(float(engine.train_batch(it)))
        states.append(engine_workers._state(model))
    return states, losses, engine, model


def against_reference(name: str, spec: dict[str, Any], world: int) -> dict[str, Any]:
    """The stage's weights after every call against the reference's; its losses and weights finite."""
    states, losses, engine, model = train(spec, world)
    want = reference_states(spec, list(model.parts), engine.device)
    diff = max(max_diff(got, ref) for got, ref in zip(states, want))
    weights = [t for state in states for t in state.values() if t.is_floating_point()]
    finite = math.isfinite(losses[-1]) and all(bool(torch.isfinite(t).all()) for t in weights)  # NaN: filling
    return check(name, diff, finite=finite)


def dropout_replayed(world: int, stages: int) -> dict[str, Any]:
    """Dropout on the stage, stashed weights: recomputing the activations (the accelerator RNG replayed, Note [the
    recomputed forward runs as the first did]) trains to the weights of storing them."""
    spec = case(stages, dropout=0.3, weights="stashed")
    stored, _, _, _ = train(spec, world)
    recomputed, _, _, _ = train({**spec, "activations": "recomputed"}, world)
    return check("dropout: recomputed = stored", max(max_diff(a, b) for a, b in zip(recomputed, stored)))


def resumed(world: int, stages: int, root: str) -> dict[str, Any]:
    """Saved after 2 calls with micro-batches in flight; a new engine loads it and trains 2 calls: the weights equal
    training straight on (Note [host tensors stay on the host] in fdg_schedule/checkpointing/checkpoint.py: the
    control word)."""
    import engine_workers

    spec = case(stages, weights="stashed", optimizer="adam")
    torch.manual_seed(1234)
    engine, model, data = build(spec, world)
    it = iter(data)
    for _ in range(2):
        engine.train_batch(it)
    engine.save_checkpoint(root)
    for _ in range(2):
        engine.train_batch(it)
    straight = engine_workers._state(model)
    torch.manual_seed(999)  # the resumed run must not depend on the process's own RNG
    engine, model, data = build(spec, world)
    engine.load_checkpoint(root)
    it = iter(data[engine.micro_batches_read :])
    for _ in range(2):
        engine.train_batch(it)
    diff = max_diff(engine_workers._state(model), straight)
    return check("checkpoint resumed = straight", diff, tol=0.0, in_flight=engine.in_flight())


def pipeline_rank(rank: int, world: int, stages: int, root: str, dropout: bool) -> dict[str, Any]:
    """One rank of the shared and nccl parts: its stage's checks, each a dict (see :func:`check`)."""
    checks = [
        against_reference("current/stored, SGD", case(stages), world),
        against_reference(
            "stashed/recomputed, Adam",
            case(stages, weights="stashed", activations="recomputed", optimizer="adam"),
            world,
        ),  # fmt: skip
    ]
    if dropout:
        checks.append(dropout_replayed(world, stages))
    checks.append(resumed(world, stages, os.path.join(root, f"k{stages}")))
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu() else "cpu"
    return {"rank": f"{rank} of K = {stages}", "device": device, "checks": checks}


def no_host_sync(engine: Any, it: Any) -> str | None:
    """Run steady-state calls with every tick under the sync-debug mode "error" (on the CPU, where there is no
    such mode, the same calls without it): None, or where a synchronisation happened."""
    run_ticks = engine._exec_schedule
    debug_mode = torch.cuda.set_sync_debug_mode if on_gpu() else lambda mode: None

    def checked(plan: Any) -> None:
        debug_mode("error")
        try:
            run_ticks(plan)
        finally:
            debug_mode(0)

    engine._exec_schedule = checked
    try:
        for _ in range(SYNC_FREE_CALLS):
            engine.train_batch(it)
    except RuntimeError:
        return "".join(traceback.format_exc().splitlines(keepends=True)[-14:])
    finally:
        del engine._exec_schedule
    return None


def single_rank(rank: int, world: int) -> dict[str, Any]:
    """K = 1 against plain backprop, then the sync-debug ticks (on a GPU)."""
    import engine_workers
    import toy

    spec = case(1, gas=4, calls=3, grad_shrink=0.3, weights="stashed")
    states, _, engine, _ = train(spec, world)
    device = engine.device
    plain = toy.Chain(toy.layers(spec=False), 0).to(device)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for x, y in toy.micro_batches(spec["n"], 4)[: spec["calls"] * spec["gas"]]:
        toy.loss_fn(plain(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = engine_workers._state(plain)
    checks = [check("K = 1 = plain backprop", max_diff(states[-1], want), tol=1e-6)]
    sync_cases = [("SGD, clipping", case(1, gas=4, calls=2, clip=1.0)),
                  ("Adam, accumulate 2", case(1, gas=4, calls=2, optimizer="adam", accumulate=2))]  # fmt: skip
    for name, sync_spec in sync_cases:
        torch.manual_seed(1234)
        engine, _, data = build({**sync_spec, "n": 4 * (sync_spec["calls"] + SYNC_FREE_CALLS)}, world)
        it = iter(data)
        for _ in range(sync_spec["calls"]):  # warm-up: allocator, kernels, the first tick's one-off work
            engine.train_batch(it)
        where = no_host_sync(engine, it)
        name = f"no host sync in a tick: {name}" + ("" if on_gpu() else " (dry run: no sync-debug mode on the CPU)")
        checks.append({"name": name, "ok": where is None, "sync": where})
    return {"rank": f"{rank} of K = 1", "device": str(device), "checks": checks}


# -- the parts ------------------------------------------------------------------------------------


def run_part(part: str) -> dict[str, Any]:
    from fdg_schedule.tools.launch import run

    gpus = torch.cuda.device_count() if on_gpu() else 0
    with tempfile.TemporaryDirectory() as tmp:
        if part == "single":
            os.environ["FDG_LAUNCH_BACKEND"] = "nccl" if gpus else "gloo"  # NCCL's one-rank stream path on a GPU
            ranks = run(single_rank, 1, deadline_s=plan.DEADLINES_S[part][0], workdir=tmp)
        elif part == "shared":
            os.environ.update(FDG_LAUNCH_BACKEND="gloo", FDG_LAUNCH_DEVICES="1")  # every rank on GPU 0
            ranks = [r for k, deadline_s in zip((2, 3), plan.DEADLINES_S[part], strict=True)
                     for r in run(pipeline_rank, k, k, tmp, k == 2, deadline_s=deadline_s, workdir=tmp)]  # fmt: skip
        elif part == "nccl":
            if gpus < 2:
                return {"ok": True, "skipped": True, "summary": f"skipped: {gpus} GPU(s) visible, NCCL needs 2"}
            os.environ.update(FDG_LAUNCH_BACKEND="nccl", FDG_LAUNCH_DEVICES=str(gpus))
            start = time.monotonic()
            ranks = run(pipeline_rank, 2, 2, tmp, False, deadline_s=plan.DEADLINES_S[part][0], workdir=tmp)
            ranks[0]["ran"] = f"ran, every rank returned in {time.monotonic() - start:.0f} s (no hang)"
        else:
            raise ValueError(f"unknown part {part!r}: single, shared or nccl")
    lines, ok = [], True
    for r in ranks:
        for c in r["checks"]:
            ok &= bool(c["ok"]) and c.get("finite", True) is not False
            numbers = "" if "max_diff" not in c else f"max |diff| {c['max_diff']:.3g} (tolerance {c['tol']:g})"
            more = {k: v for k, v in c.items() if k not in ("name", "ok", "max_diff", "tol")}
            lines.append(f"rank {r['rank']} ({r['device']}): {c['name']}: {'pass' if c['ok'] else 'FAIL'} "
                         f"{numbers} {json.dumps(more) if more else ''}".rstrip())  # fmt: skip
        if "ran" in r:
            lines.append(r["ran"])
    print("\n".join(lines))
    return {"ok": ok, "summary": f"{sum(len(r['checks']) for r in ranks)} checks on {len(ranks)} ranks"}


def environment(network: str) -> dict[str, Any]:
    import platform

    import deepspeed

    lines = [f"python {platform.python_version()}", f"torch {torch.__version__} (CUDA {torch.version.cuda})",
             f"deepspeed {deepspeed.__version__}"]  # fmt: skip
    if torch.cuda.is_available():
        driver = "unknown"
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = str(pynvml.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001 - the report says it could not read it
            pass
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines += [f"GPUs: {torch.cuda.device_count()} ({', '.join(names)}), driver {driver}",
                  f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"]  # fmt: skip
    else:
        lines.append("no GPU visible (dry run: CPU)")
    lines.append(network)
    print("\n".join(lines))
    return {"ok": True, "summary": "; ".join(lines)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description="one part of the device check")
    parser.add_argument("part", choices=list(plan.DEADLINES_S))
    parser.add_argument("--timeout-s", type=float, help="the shell's timeout around this part (default: the plan's)")
    parser.add_argument("--dry-run", action="store_true", help="ignored: gpu_check.sh --dry-run sets DS_ACCELERATOR")
    args = parser.parse_args(argv)
    part = args.part
    seen = plan.interfaces()
    chosen = plan.socket_env(seen, os.environ)
    os.environ.update(chosen)  # the ranks inherit it
    print(plan.bounds_line(part, args.timeout_s or plan.timeout_s(part)))
    try:
        problem = plan.nesting_problem(part, args.timeout_s) if args.timeout_s else None
        if problem:
            raise ValueError(problem)
        result = environment(plan.network_line(seen, chosen, os.environ)) if part == "env" else run_part(part)
    except Exception as err:  # noqa: BLE001 - the report shows every part, failed or not
        traceback.print_exc()
        result = {"ok": False, "summary": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    print("RESULT " + json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_check  # the ranks unpickle the workers by this name

    sys.exit(gpu_check.main(sys.argv[1:]))
