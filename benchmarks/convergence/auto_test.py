"""The pre-registered test of ``corrections: "auto"``: three held-out tasks, BP against FDG "auto" and "none".

    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD
    python -m benchmarks.convergence.auto_test run --workers 2  # the queue; the same command continues a stopped one
    python -m benchmarks.convergence.auto_test report           # docs/results/auto/report.{md,json} from the run files

docs/results/auto-preregistration.md fixes everything here in advance: the tasks, seeds, budgets, the BP
warm-up selection, the analysis and the pass criterion. Every arm of every task runs on
``fdg_reference`` in one process (K = 1 is plain backprop), so BP and FDG share one code path.

- resnet32: CIFAR ResNet-32 on Fashion-MNIST, 12,000 training images (``subset(seed)``), 16 epochs of
  micro-batch 32, SGD lr 0.1 momentum 0.9 weight decay 5e-4, step decay /10 at epochs 8, 12, 15;
  K = 4 split 0,4,7,11,18 (the library's balanced split, measured once); metric: the error on the full
  10,000-image test set (points); selection: the error on 10,000 held-out training images.
- llama: a LLaMA-style LM (RMSNorm, SwiGLU, rotary; 6 layers, width 128, 4 heads, 2 KV heads, untied)
  on the King James Bible (Debian ``bible-kjv``), BPE 4,096 trained on the training text; blocks of 128
  tokens, 80 / 10 / 10 % train / validation / test; 2 epochs of micro-batch 8; AdamW lr 1e-3 betas
  (0.9, 0.95) eps 1e-8 weight decay 0.1, clipping 1.0, DeepSpeed's WarmupCosineLR to 0.1x; K = 4 with
  the decoder blocks spread evenly (``type:BlockPipe``); metric: test loss, relative to BP (%).
- gpt2: the benchmark's GPT-2 (docs/results/convergence/lm_convergence_model.json) on Shakespeare, the same
  protocol for 3 epochs.

Arms: ``bp`` (K = 1), ``auto`` and ``none`` (K = 4, ``weights: "stashed"``, ``grad_shrink`` 1). Each
task's warm-up (ResNet: 2 epochs at 0.1 x lr; LM: 10 % of the steps) is BP's choice on seed 99
(``bp_warmup`` against ``bp_nowarmup`` on the validation metric), then frozen for all arms.

A unit is one seed of one task, its arms run one after another on one core; each run writes
``<out>/<task>/<arm>_s<seed>.json`` when it ends. A unit counts when all its arms ran on one machine
(the same processor and software: ``machine()``); on restart, a unit begun on another machine is moved
to ``<out>/<task>/discarded/`` and run again whole.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import curve_runs
from benchmarks.common.dev_corpora import kjv_texts, shakespeare_texts
from benchmarks.common.provenance import commit, machine
from benchmarks.common.stats import t_quantile

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results" / "auto" / "runs"
REPORT = ROOT / "docs" / "results" / "auto" / "report"
SELECTION_SEED = 99
ARMS = ("bp", "auto", "none")
SELECTION_ARMS = ("bp_warmup", "bp_nowarmup")


@dataclass(frozen=True)
class Task:
    name: str
    seeds: tuple[int, ...]
    margin: float  # the pass criterion: the one-sided 95 % upper bound of the mean paired difference below it
    unit: str  # of the paired difference: "points" (test error) or "%" (relative test loss)


TASKS = {
    "resnet32": Task("resnet32", tuple(range(100, 124)), 0.5, "points"),
    "llama": Task("llama", tuple(range(100, 108)), 2.0, "%"),
    "gpt2": Task("gpt2", tuple(range(100, 108)), 2.0, "%"),
}
RESNET_SPLIT = "parts:0,4,7,11,18"
LM = {  # per LM task: model, corpus, epochs
    "llama": {"epochs": 2, "corpus": "kjv"},
    "gpt2": {"epochs": 3, "corpus": "shakespeare"},
}
LLAMA = {
    "model_type": "llama", "num_hidden_layers": 6, "hidden_size": 128, "intermediate_size": 344,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 4096,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6,
}  # fmt: skip
GPT2_MODEL = ROOT / "docs" / "results" / "convergence" / "lm_convergence_model.json"


# -- one run ------------------------------------------------------------------------------------------------


def fdg_block(arm: str) -> dict[str, Any] | None:
    """The job's pipeline.fdg block for an arm (None: BP, one stage)."""
    if arm in ("bp", *SELECTION_ARMS):
        return None
    return {"grad_shrink": 1.0, "weights": "stashed", "activations": "stored", "accumulate": 1, "corrections": arm}


def run_resnet(arm: str, seed: int, warmup: bool, smoke: bool) -> dict[str, Any]:
    """A ResNet-32 run through benchmarks/convergence/resnet_reference.py (the recipe's run on fdg_reference)."""
    fdg = fdg_block(arm)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}},
        "gradient_clipping": 0,
    }
    if fdg is not None:
        config["pipeline"] = {"schedule": "fdg", "fdg": fdg}
    stages = 1 if fdg is None else 4
    epochs, train, validation = (1, 256, 256) if smoke else (16, 12000, 10000)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    command = [
        sys.executable, "-m", "benchmarks.convergence.resnet_reference", "--deepspeed_config", f.name,
        "--stages", str(stages), "--model", "resnet32", "--epochs", str(epochs), "--train-subset", str(train),
        "--test-subset", "256" if smoke else "1000", "--seed", str(seed), "--final-full-test",
        "--validation", str(validation), "--warmup-epochs", "2" if warmup else "0",
        *(["--partition", RESNET_SPLIT] if stages == 4 else []),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    os.unlink(f.name)
    if done.returncode != 0:
        return {"failed": (done.stdout + done.stderr)[-2000:], "command": " ".join(command)}
    test = re.search(r"full test set: test_acc ([\d.]+)%", done.stdout)
    val = re.search(r"validation: test_acc ([\d.]+)%", done.stdout)
    choice = re.search(r'corrections "auto" \(rule \w+\) chose .*', done.stdout)
    assert test is not None and val is not None, done.stdout[-2000:]
    return {
        "test": 100 - float(test.group(1)),  # error, points
        "validation": 100 - float(val.group(1)),
        "auto_choice": choice.group(0) if choice else None,
        "command": " ".join(command),
        "log": done.stdout[-4000:],
    }


def lm_data(task: str, smoke: bool) -> tuple[Any, Any, Any]:
    """Train, validation and test blocks of 128 tokens (80 / 10 / 10 % of the token stream, in order); the
    tokenizer (BPE 4,096) is trained on the first 80 % of the text only."""
    from fdg_schedule.zoo import text_data

    cache = ROOT / "runs" / "auto_corpora"
    texts = kjv_texts(cache) if LM[task]["corpus"] == "kjv" else shakespeare_texts()
    whole = "\n".join(texts)
    if smoke:
        whole = whole[:200_000]
    tokenizer = text_data.train_tokenizer([whole[: int(0.8 * len(whole))]], 4096, cache=cache)
    stream = text_data.encode([whole], tokenizer, cache=cache)
    a, b = int(0.8 * len(stream)), int(0.9 * len(stream))
    blocks = [text_data.TokenBlocks(part, 128) for part in (stream[:a], stream[a:b], stream[b:])]
    return blocks[0], blocks[1], blocks[2]


def run_lm(task: str, arm: str, seed: int, warmup: bool, smoke: bool) -> dict[str, Any]:
    """An LM run on fdg_reference: K = 1 (BP) or 4 stages, the task's protocol."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR
    from transformers import LlamaConfig

    from fdg_schedule import FDGConfig, fdg_reference
    from fdg_schedule.zoo import hf_lm

    torch.set_num_threads(1)
    train, val, test = lm_data(task, smoke)
    torch.manual_seed(seed)  # the initial weights
    config = LlamaConfig(**LLAMA) if task == "llama" else hf_lm.load_config(GPT2_MODEL)
    layers = hf_lm.pipeline_layers(hf_lm.build_model(config))
    fdg = fdg_block(arm)
    stages = 1 if fdg is None else 4
    bounds = hf_lm.stage_bounds(layers, stages)
    modules = [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(stages)]
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) for m in modules
    ]
    epochs = 1 if smoke else int(LM[task]["epochs"])
    per_epoch = len(train) // 8
    steps = epochs * per_epoch
    schedule = {"total_num_steps": steps, "warmup_num_steps": steps // 10 if warmup else 1, "warmup_min_ratio": 0.0,
                "cos_min_ratio": 0.1, "warmup_type": "linear"}  # fmt: skip
    schedulers = [WarmupCosineLR(o, **schedule) for o in optimizers]
    batches = []
    for epoch in range(epochs):  # a new shuffle each epoch, drawn from the seed
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        for i in range(per_epoch):
            block = torch.stack([train[j][0] for j in order[i * 8 : i * 8 + 8]])
            batches.append((block, block))
    config_fdg = FDGConfig(**fdg) if fdg is not None else FDGConfig()
    choice = None
    if fdg is not None and fdg["corrections"] == "auto":  # decided as at initialize, logged as the engine does
        from fdg_schedule.corrections import auto_corrections

        config_fdg, made = auto_corrections.resolve(config_fdg, optimizers[0], schedulers[0], stages)
        choice = made.line() if made is not None else None
    start = time.time()
    losses = fdg_reference(modules, optimizers, batches, hf_lm.lm_loss, config_fdg, drain=True,
                           schedulers=schedulers, clip_grad_norm=1.0)  # fmt: skip
    if not all(math.isfinite(v) for v in losses):
        return {"failed": "non-finite training loss", "train_s": time.time() - start}
    return {
        "test": lm_loss_on(modules, test),
        "validation": lm_loss_on(modules, val),
        "train_loss_last_100": sum(losses[-100:]) / len(losses[-100:]),
        "auto_choice": choice,
        "bounds": bounds,
        "train_ticks": len(batches),
        "tokens": len(batches) * 8 * 128,
    }


def lm_loss_on(modules: Sequence[Any], blocks: Any) -> float:
    """Mean next-token cross-entropy over all ``blocks`` (every token counted once), in chunks of 32."""
    import torch

    from fdg_schedule.zoo import hf_lm

    total, count = 0.0, 0
    with torch.no_grad():
        for m in modules:
            m.eval()
        for start in range(0, len(blocks), 32):
            chunk = torch.stack([blocks[j][0] for j in range(start, min(start + 32, len(blocks)))])
            x = chunk
            for m in modules:
                x = m(x)
            total += float(hf_lm.lm_loss(x, chunk)) * chunk.shape[0]
            count += chunk.shape[0]
    return total / count


def one_run(task: str, arm: str, seed: int, warmup: bool, smoke: bool) -> dict[str, Any]:
    start = time.time()
    result = run_resnet(arm, seed, warmup, smoke) if task == "resnet32" else run_lm(task, arm, seed, warmup, smoke)
    return {"task": task, "arm": arm, "seed": seed, "warmup": warmup, "wall_s": time.time() - start,
            "machine": machine(), "commit": commit(), "smoke": smoke, **result}  # fmt: skip


# -- the queue ----------------------------------------------------------------------------------------------


def run_path(out: Path, task: str, arm: str, seed: int) -> Path:
    return out / task / f"{arm}_s{seed}.json"


def read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def selection(out: Path, task: str) -> bool | None:
    """BP's warm-up choice for ``task`` (True: with), once both selection runs are in; None before."""
    runs = [read(run_path(out, task, arm, SELECTION_SEED)) for arm in SELECTION_ARMS]
    if any(r is None for r in runs):
        return None
    with_w, without = runs
    assert with_w is not None and without is not None
    score = lambda r: math.inf if "failed" in r else r["validation"]  # noqa: E731
    return score(with_w) < score(without)


def units(out: Path) -> list[tuple[str, int, tuple[str, ...]]]:
    """The queue's units in order: the selections, then the tasks' seeds interleaved."""
    order: list[tuple[str, int, tuple[str, ...]]] = [(t, SELECTION_SEED, SELECTION_ARMS) for t in TASKS]
    longest = max(len(t.seeds) for t in TASKS.values())
    for i in range(longest):
        order += [(name, task.seeds[i], ARMS) for name, task in TASKS.items() if i < len(task.seeds)]
    return order


def unit_state(out: Path, task: str, seed: int, arms: Sequence[str], here: dict[str, str]) -> str:
    """ "done", "todo" or "partial elsewhere" (some arms ran on another machine)."""
    runs = [read(run_path(out, task, arm, seed)) for arm in arms]
    found = [r for r in runs if r is not None]
    if any(r["machine"] != here for r in found) and len(found) < len(arms):
        return "partial elsewhere"
    return "done" if len(found) == len(arms) else "todo"


def discard(out: Path, task: str, seed: int, arms: Sequence[str]) -> None:
    """Move a unit begun on another machine aside (kept for the record), so that it runs again whole."""
    target = out / task / "discarded"
    target.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        path = run_path(out, task, arm, seed)
        if path.exists():
            path.rename(target / f"{path.stem}.{int(time.time())}.json")


def run_unit(out: Path, task: str, seed: int, smoke: bool) -> None:
    """Every arm of one seed, one after another (in this process's children), each written when it ends."""
    arms = SELECTION_ARMS if seed == SELECTION_SEED else ARMS
    warmup = selection(out, task) if seed != SELECTION_SEED else None
    for arm in arms:
        path = run_path(out, task, arm, seed)
        if path.exists():
            continue
        with_warmup = arm == "bp_warmup" if seed == SELECTION_SEED else bool(warmup)
        result = one_run(task, arm, seed, with_warmup, smoke)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.rename(path)
        print(f"{time.strftime('%F %T')} {task} {arm} s{seed}: test {result.get('test')} "
              f"({result['wall_s']:.0f} s){' FAILED' if 'failed' in result else ''}", flush=True)  # fmt: skip


def queue(out: Path, workers: int, smoke: bool, only: Sequence[str]) -> None:
    """Run every unit not done yet, ``workers`` at a time, each in its own process; stops when all are done."""
    lock = curve_runs.lock_queue(out, "auto_test.py")  # noqa: F841 - held until the process ends
    here = machine()
    running: dict[tuple[str, int], subprocess.Popen] = {}
    while True:
        for key, proc in list(running.items()):
            if proc.poll() is not None:
                del running[key]
        pending = []
        for task, seed, arms in units(out):
            if only and task not in only:
                continue
            state = unit_state(out, task, seed, arms, here)
            if state == "partial elsewhere" and (task, seed) not in running:
                discard(out, task, seed, arms)
                state = "todo"
            if state == "todo" and (task, seed) not in running:
                ready = seed == SELECTION_SEED or selection(out, task) is not None
                pending.append((task, seed, ready))
        if not pending and not running:
            print(f"{time.strftime('%F %T')} every unit is done", flush=True)
            return
        for task, seed, ready in pending:
            if len(running) >= workers:
                break
            if ready:
                command = [
                    sys.executable,
                    "-m",
                    "benchmarks.convergence.auto_test",
                    "unit",
                    "--task",
                    task,
                    "--seed",
                    str(seed),
                    "--out",
                    str(out),
                ]
                running[task, seed] = subprocess.Popen(command + (["--smoke"] if smoke else []), cwd=ROOT)
        time.sleep(5 if smoke else 30)


# -- the analysis -------------------------------------------------------------------------------------------


def paired(out: Path, task: Task, arm: str, against: str = "bp") -> dict[str, Any]:
    """The paired differences ``arm`` - ``against`` over the task's complete units, and their statistics."""
    pairs = []
    for seed in task.seeds:
        runs = {a: read(run_path(out, task.name, a, seed)) for a in ARMS}
        if any(r is None for r in runs.values()) or len({json.dumps(r["machine"]) for r in runs.values()}) > 1:
            continue  # incomplete, or split across machines: not a pair (Note in the module docstring)
        a, b = runs[arm], runs[against]
        assert a is not None and b is not None
        if "failed" in a or "failed" in b:
            pairs.append({"seed": seed, "failed": a.get("failed") or b.get("failed")})
            continue
        diff = a["test"] - b["test"] if task.unit == "points" else (a["test"] - b["test"]) / b["test"] * 100
        pairs.append({"seed": seed, arm: a["test"], against: b["test"], "difference": diff})
    diffs = [p["difference"] for p in pairs if "difference" in p]
    n = len(diffs)
    stats: dict[str, Any] = {"n": n, "pairs": pairs, "failed": sum("failed" in p for p in pairs)}
    if n >= 2:
        mean = sum(diffs) / n
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        bound = mean + t_quantile(0.95, n - 1) * sd / math.sqrt(n)
        stats.update(mean=mean, sd=sd, upper_95=bound)
    return stats


def report(out: Path) -> dict[str, Any]:
    """Per task: the selection, auto - BP and none - BP (pass: complete, no failure, bound < margin), auto - none."""
    result: dict[str, Any] = {"commit": commit(), "tasks": {}}
    lines = ["| task | margin | arm | n of planned | mean | sd | one-sided 95 % upper bound | passes |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for task in TASKS.values():
        chosen = selection(out, task.name)
        entry: dict[str, Any] = {"warmup": chosen, "margin": task.margin, "unit": task.unit}
        for arm in ("auto", "none"):
            stats = paired(out, task, arm)
            complete = stats["n"] + stats["failed"] == len(task.seeds)
            stats["passes"] = bool(
                complete and not stats["failed"] and stats.get("upper_95", math.inf) < task.margin
            )  # fmt: skip
            entry[arm] = stats
            shown = lambda key, stats=stats: f"{stats[key]:+.2f}" if key in stats else "–"  # noqa: E731
            verdict = ("yes" if stats["passes"] else "no") if complete else "not yet"
            lines.append(f"| {task.name} | +{task.margin} {task.unit} | {arm} | {stats['n']} of {len(task.seeds)} | "
                         f"{shown('mean')} | {shown('sd')} | {shown('upper_95')} | {verdict} |")  # fmt: skip
        entry["auto_minus_none"] = paired(out, task, "auto", against="none")
        result["tasks"][task.name] = entry
    result["table"] = "\n".join(lines)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["run", "unit", "one", "report"])
    parser.add_argument("--out", type=Path, default=OUT, help="the run files (docs/results/auto/runs)")
    parser.add_argument("--workers", type=int, default=2, help="units at a time (one core each)")
    parser.add_argument("--task", choices=list(TASKS), action="append", default=[], help="run only these tasks")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--arm", default=None, help="one: the arm (bp, auto, none, bp_warmup, bp_nowarmup)")
    parser.add_argument("--warmup", action="store_true", help="one: with the task's warm-up")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets: checks the code path, measures nothing")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.what == "run":
        queue(args.out, args.workers, args.smoke, args.task)
    elif args.what == "unit":
        run_unit(args.out, args.task[0], args.seed, args.smoke)
    elif args.what == "one":
        print(json.dumps(one_run(args.task[0], args.arm, args.seed, args.warmup, args.smoke), indent=1))
    else:
        result = report(args.out)
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.with_suffix(".json").write_text(json.dumps(result, indent=1))
        REPORT.with_suffix(".md").write_text(f"Report at {result['commit']} (benchmarks/convergence/auto_test.py "
                                             "report)\n\n" + result["table"] + "\n")  # fmt: skip
        print(result["table"])


if __name__ == "__main__":
    main()
