"""FDG versus backprop: train one model with BP, 1F1B and FDG variants, same data, epochs and seeds; tabulate.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.convergence.convergence --epochs 3 --train-subset 2048

Every run is `recipes/train_resnet.py` under the deepspeed launcher, with a config derived from
ds_configs/resnet_{bp,1f1b,fdg_k2}.json (only the micro-batch size and the pipeline block change), so
the numbers are those of the real engines. A run needs one rank per stage; runs with more stages than
--max-ranks are listed as not run. With ``--backend reference`` every run is
`benchmarks/convergence/resnet_reference.py` instead: the same recipe with `fdg_reference` in one process (K
stages without K ranks; equal to the engine's run, docs/results/staleness/experiment-log.md), marked in the table.
Writes <out>.md (final test error, mean ± half-range over seeds), <out>.png (test error per epoch,
mean over seeds) and <out>.json (every epoch of every run, and every run an earlier call stored there).

Staleness corrections are variant options (docs/staleness.md), e.g.
``--variant fdg:4:1:stashed:warmup=2,delay_lr=1024,predict=0.9``,
``--variant fdg:4:1:stashed:momentum=1,peak_lr=0.1,split=0/2/4/7/12`` or ``--variant BP:warmup=2``.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "train_resnet.py"
REFERENCE = "benchmarks.convergence.resnet_reference"  # run as a module from ROOT
from fdg_schedule.tools import staleness_log  # noqa: E402
from fdg_schedule.tools.launch import free_port, remove_shared_memory  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default="resnet20")
parser.add_argument("--dataset", default="fashion-mnist")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--train-subset", type=int, default=2048)
parser.add_argument("--test-subset", type=int, default=1000)
parser.add_argument("--micro-batch", type=int, default=32, help="smaller than the paper's 128: more steps on CPU")
parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="FDG stage counts")
parser.add_argument("--betas", type=float, nargs="+", default=[1.0, 0.5, 0.2])
parser.add_argument("--weights", nargs="+", default=["current", "stashed"])
parser.add_argument("--max-ranks", type=int, default=2, help="runs needing more processes are skipped")
parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
parser.add_argument(
    "--backend",
    choices=["engine", "reference"],
    default="engine",
    help="engine: the recipe on DeepSpeed ranks; reference: fdg_reference in one process (any K)",
)
parser.add_argument("--jobs", type=int, default=1, help="runs at the same time (one process each)")
parser.add_argument(
    "--final-full-test",
    action="store_true",
    help="the final test error on the whole test set (the curve stays on --test-subset)",
)
parser.add_argument(
    "--staleness-every",
    type=int,
    default=None,
    help="pipeline.fdg.staleness_every of every FDG run (default: the config's, 100); the recipe and "
    "resnet_reference.py print each stage's median per epoch, kept in the JSON and tabled in the report",
)
parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "convergence" / "convergence"))
parser.add_argument("--fdg-only", action="store_true", help="skip the BP and 1F1B baselines (e.g. a K=3 add-on)")
parser.add_argument(
    "--reuse",
    action="store_true",
    help="keep the runs already in <out>.json made with the same settings; run only the missing (variant, seed) pairs",
)
parser.add_argument(
    "--report-only",
    action="store_true",
    help="with --reuse: run nothing, rewrite the table and picture from <out>.json (missing pairs are left out)",
)
parser.add_argument(
    "--variant",
    action="append",
    metavar="SPEC",
    help="run only these (repeatable): BP, 1F1B or fdg:K:beta:weights, e.g. fdg:2:0.2:current, each "
    "optionally followed by :warmup=EPOCHS,delay_lr=TICKS,predict=GAMMA,horizon=H,momentum=1,peak_lr=RHO,raise=C,"
    "split=SPLIT "
    "(BP takes warmup only; SPLIT: paper, parameters, uniform or boundaries 0/b1/.../L); "
    "replaces the grid of --stages x --weights x --betas",
)
args = parser.parse_args()
if args.backend == "reference" and args.max_ranks == 2:
    args.max_ranks = 10**6  # one process whatever K


# What each correction option means in a variant spec, and how its name reads in the table.
CORRECTIONS = {
    "warmup": "warm-up {} ep",
    "delay_lr": "delay_lr T={}",
    "predict": "predict γ={}",
    "horizon": "{} horizon",  # predict_horizon (with predict=GAMMA): own or first_stage
    "momentum": "delay_momentum",  # momentum=1
    "peak_lr": "peak lr {}",  # delay_momentum_peak_lr (with momentum=1)
    "raise": "momentum raise c={}",  # delay_momentum_raise (not with momentum=1)
    "split": "{} split",  # not a correction: the recipe's --partition (paper, parameters, uniform, b0/b1/.../bK)
}


def correction_name(options):
    return "".join(f", {CORRECTIONS[key].format(value)}" for key, value in options.items())


def fdg_variant(stages, beta, weights, options=None):
    """(name, stages, config changes, recipe arguments) of one FDG variant."""
    options = options or {}
    fdg = {"grad_shrink": beta, "weights": weights, "activations": "stored", "accumulate": 1}
    if "delay_lr" in options:
        fdg["delay_lr_ticks"] = int(options["delay_lr"])
    if "predict" in options:
        fdg["predict_decay"] = float(options["predict"])
    if "horizon" in options:
        fdg["predict_horizon"] = options["horizon"]
    if options.get("momentum") == "1":
        fdg["delay_momentum"] = True
    if "peak_lr" in options:
        fdg["delay_momentum_peak_lr"] = float(options["peak_lr"])
    if "raise" in options:
        fdg["delay_momentum_raise"] = float(options["raise"])
    name = f"FDG K={stages} β={beta:g} {weights}" + correction_name(options)
    return name, stages, {"pipeline": {"schedule": "fdg", "fdg": fdg}}, warmup_args(options)


def warmup_args(options):
    """The recipe arguments of a variant's options: the warm-up, and the split (--partition)."""
    extra = ["--warmup-epochs", str(int(options["warmup"]))] if "warmup" in options else []
    return extra + (["--partition", partition_arg(options["split"])] if "split" in options else [])


SPLITS = ("paper", "parameters", "uniform")


def partition_arg(split):
    """The recipe's --partition for a variant's ``split=``: a method, or boundaries ``0/2/4/7/12`` as
    ``parts:0,2,4,7,12`` (``:`` and ``,`` already separate a variant's fields and options)."""
    return split if split in SPLITS else "parts:" + split.replace("/", ",")


# (name, stages, config changes, recipe arguments) of the stock schedules
BASELINES: list[tuple[str, int, dict, list]] = [("BP", 1, {}, []), ("1F1B", 2, {}, [])]


def parse_options(spec, text):
    options = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in CORRECTIONS or not value:
            parser.error(
                f"--variant {spec!r}: unknown option {item!r}; "
                "options: warmup=N, delay_lr=T, predict=GAMMA, horizon=own|first_stage, momentum=1, peak_lr=RHO, "
                "raise=C, split=paper|parameters|uniform|0/b1/.../L"
            )
        options[key] = value
    horizon = options.get("horizon")
    if horizon is not None and (horizon not in ("own", "first_stage") or "predict" not in options):
        parser.error(f"--variant {spec!r}: horizon={horizon}: use own or first_stage, with predict=GAMMA")
    split = options.get("split")
    if split is not None and split not in SPLITS and not re.fullmatch(r"0(/\d+)+", split):
        parser.error(
            f"--variant {spec!r}: split={split}: use paper, parameters, uniform or the stage boundaries as "
            "0/b1/.../L (e.g. split=0/2/4/7/12, the recipe's measured 'balanced' split of ResNet-20 at K = 4)"
        )
    return options


def parse_variant(spec):
    head, _, rest = spec.partition(":") if spec.upper().startswith(("BP:", "1F1B:")) else (spec, "", "")
    for name, stages, changes, _ in BASELINES:
        if head.upper() == name:
            options = parse_options(spec, rest)
            if set(options) - {"warmup"}:
                parser.error(f"--variant {spec!r}: {name} takes only warmup=N")
            return name + correction_name(options), stages, changes, warmup_args(options)
    try:
        kind, stages, beta, weights, *more = spec.split(":")
        assert kind == "fdg" and weights in ("current", "stashed") and len(more) <= 1
    except (ValueError, AssertionError):
        parser.error(f"--variant {spec!r}: expected BP, 1F1B or fdg:K:beta:weights[:options] (weights current|stashed)")
    options = parse_options(spec, more[0] if more else "")
    return fdg_variant(int(stages), float(beta), weights, options)


def variants():
    """(name, stages, config changes, recipe arguments, --variant spec) of every run, BP and 1F1B first."""
    if args.variant:
        yield from ((*parse_variant(spec), spec) for spec in args.variant)
        return
    if not args.fdg_only:
        yield from ((*baseline, baseline[0]) for baseline in BASELINES)
    for stages in args.stages:
        for weights in args.weights:
            for beta in args.betas:
                yield (*fdg_variant(stages, beta, weights), f"fdg:{stages}:{beta:g}:{weights}")


class RunFailed(Exception):
    """A run that did not finish (e.g. it diverged); the message is the error that stopped it."""


def first_error(output, returncode):
    """The error line of the rank that failed first, not its neighbours' "gave up waiting" that follow."""
    lines = [
        re.sub(r"^\[rank\d+\]:\s*", "", line)
        for line in output.splitlines()
        if re.search(r"\w(Error|Exception): ", line)
    ]
    primary = [line for line in lines if "gave up waiting" not in line and "Connection closed" not in line]
    return (primary or lines or [f"exit code {returncode}"])[-1][:400]


def run(stages, changes, extra, seed, workdir):
    """One recipe run; returns its record (test error per epoch as fractions, samples/s, ...) or raises RunFailed."""
    config = json.loads((ROOT / "ds_configs" / "resnet_bp.json").read_text())
    config.update(changes, train_micro_batch_size_per_gpu=args.micro_batch)
    if "pipeline" in config:  # a paused experiment must not time out waiting for a neighbour
        config["pipeline"]["fdg"]["timeout"] = max(args.timeout, 60)
        if args.staleness_every is not None:
            config["pipeline"]["fdg"]["staleness_every"] = args.staleness_every
    path = workdir / f"config_{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config))
    common = [
        "--deepspeed_config", str(path), "--model", args.model, "--dataset", args.dataset,
        "--epochs", str(args.epochs), "--train-subset", str(args.train_subset),
        "--test-subset", str(args.test_subset), "--seed", str(seed), *extra,
    ]  # fmt: skip
    common += ["--final-full-test"] if args.final_full_test else []
    port = None  # the launcher's rendezvous port, whose shared-memory buffers are removed after the run
    if args.backend == "reference":
        command = [sys.executable, "-m", REFERENCE, "--stages", str(stages), *common]
    else:
        launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(stages)]
        port = free_port()
        command = [*launcher, "--master_port", str(port), str(RECIPE), *common]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    # The run stays in this process group, so pausing the group (SIGSTOP to a paused experiment) reaches
    # its ranks too; at the timeout the whole tree (launcher and ranks) is killed by hand.
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        output, _ = proc.communicate()
    if port is not None:
        remove_shared_memory(port)
    errors = [1 - float(acc) / 100 for acc in re.findall(r"^epoch \d+/\d+: .* test_acc ([\d.]+)%", output, re.M)]
    speed = re.search(r"^final: .* \| ([\d.]+) samples/s", output, re.M)
    full = re.search(r"^full test set: test_acc ([\d.]+)%", output, re.M)
    if proc.returncode != 0 or len(errors) != args.epochs or speed is None or (args.final_full_test and not full):
        tail = "\n".join(output.splitlines()[-15:])
        print(f"run failed (exit {proc.returncode}): {' '.join(command)}\n{tail}", flush=True)
        raise RunFailed(first_error(output, proc.returncode))
    record = {"test_error": errors, "samples_per_s": float(speed.group(1)), "backend": args.backend}
    if full:
        record["full_test_error"] = 1 - float(full.group(1)) / 100
    staleness = staleness_log.per_epoch(output)  # stage numbers as JSON keys (strings), as --reuse reads them
    if staleness:
        record["staleness"] = [{str(k): v for k, v in epoch.items()} if epoch else None for epoch in staleness]
    return record


def mean(xs):
    return sum(xs) / len(xs)


def half_range(xs):
    return (max(xs) - min(xs)) / 2


# What makes runs comparable, with the value files written before the key existed had.
SETTINGS = {
    "model": None, "dataset": None, "epochs": None, "train_subset": None, "test_subset": None,
    "micro_batch": None, "final_full_test": False,
}  # fmt: skip


def stored_results(path):
    """The results, wall time and commands of an earlier <out>.json with the same settings (--reuse)."""
    if not (args.reuse and path.exists()):
        return [], 0.0, []
    stored = json.loads(path.read_text())
    differ = [key for key, default in SETTINGS.items() if stored["args"].get(key, default) != getattr(args, key)]
    if differ:
        raise SystemExit(f"--reuse: {path} was made with other {', '.join(differ)}; drop --reuse or change --out")
    return stored["results"], stored["wall_s"], stored.get("commands", [])


out = Path(args.out)
out.parent.mkdir(parents=True, exist_ok=True)
if args.report_only and not args.reuse:
    parser.error("--report-only needs --reuse (it reads the runs of <out>.json)")
planned = list(variants())  # a bad --variant fails here, before any run
# Every stored variant stays in the file and the table, also those this call does not plan.
results, wall_before, commands = stored_results(out.with_suffix(".json"))
commands = [*commands, "python -m benchmarks.convergence.convergence " + " ".join(sys.argv[1:])]
start = time.time()
lock = threading.Lock()  # runs finish in any order with --jobs > 1; one writer at a time


def save_json():
    wall = wall_before + time.time() - start
    record = {"args": vars(args), "wall_s": wall, "commands": commands, "results": results}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    return wall


def killed(run):
    """A run that a signal stopped (the OOM killer, a timeout): not a result of the method."""
    return bool(re.fullmatch(r"exit code -\d+", run.get("failed", "")))


def final_error(run):
    """The final test error of a finished run: on the whole test set when it was measured there."""
    return run.get("full_test_error", run["test_error"][-1])


jobs = []  # (result entry, name, stages, config changes, recipe arguments, seed), in the planned order
by_name = {result["name"]: result for result in results}
for name, stages, changes, extra, spec in planned:
    if name not in by_name:
        by_name[name] = {"name": name, "stages": stages, "runs": []}
        results.append(by_name[name])
    entry = by_name[name]
    entry["spec"] = spec  # what --variant reruns it
    if not args.report_only:  # a run killed from outside (e.g. out of memory) is no result: run it again
        entry["runs"] = [r for r in entry["runs"] if not killed(r)]
    entry.pop("skipped", None)
    if stages > args.max_ranks:
        if not entry["runs"]:
            entry["skipped"] = f"needs {stages} ranks"
        print(f"{name}: not run (needs {stages} ranks, --max-ranks {args.max_ranks})", flush=True)
        continue
    for seed in args.seeds:
        if any(r["seed"] == seed for r in entry["runs"]):
            print(f"{name} seed {seed}: kept from the earlier run", flush=True)
        elif args.report_only:
            print(f"{name} seed {seed}: not in {out.with_suffix('.json')}, left out", flush=True)
        else:
            jobs.append((entry, name, stages, changes, extra, seed))


def execute(job, workdir):
    entry, name, stages, changes, extra, seed = job
    run_start = time.time()
    try:
        record = {"seed": seed, **run(stages, changes, extra, seed, workdir)}
        outcome = f"test error {final_error(record):.2%}"
    except RunFailed as err:  # a result too: the table says which runs failed and why
        record = {"seed": seed, "failed": str(err)}
        outcome = f"FAILED: {err}"
    with lock:
        entry["runs"] = sorted([*entry["runs"], record], key=lambda r: r["seed"])
        save_json()  # a later failure keeps the runs made so far (rerun with --reuse)
        print(f"{name} seed {seed}: {outcome} ({time.time() - run_start:.0f} s)", flush=True)


with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
    list(pool.map(lambda job: execute(job, Path(tmp)), jobs))
wall = save_json()
command = commands[-1]
reference_rows = any(r.get("backend") == "reference" for res in results for r in res["runs"])
three_quarters = max(1, round(0.75 * args.epochs))  # how flat the end of the curve is
lines = [
    "# FDG versus backprop: convergence",
    "",
    f"{args.model} on {args.dataset}: {args.train_subset} training images and {args.test_subset} test images "
    f"(a random subset fixed by the seed), {args.epochs} epochs, micro-batch {args.micro_batch} (one optimizer step "
    f"per micro-batch for every method), SGD lr 0.1 momentum 0.9 weight decay 5e-4, lr / 10 at the paper's "
    f"epoch fractions. Seeds {args.seeds}; a seed gives every method the same subsets, initial weights and "
    "data order. Test error after the last epoch, mean ± half the range over seeds; Δ BP is the difference "
    "from BP's run with the same seed (paired: the seed's share of the error cancels), mean ± half-range."
    + (
        f" The final test error is measured on the whole test set; the curve and the 'at epoch' column on the "
        f"{args.test_subset}-image subset."
        if args.final_full_test
        else ""
    ),
    "",
    f"Command: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 {command}` — wall time {wall / 60:.1f} min on 2 shared CPU cores.",
    "",
    f"| method | stages | final test error | spread | Δ BP (paired) | at epoch {three_quarters} | samples/s |",
    "| --- | --- | --- | --- | --- | --- | --- |",
]


def finished(runs):
    return [r for r in runs if "failed" not in r]


bp_final = {r["seed"]: final_error(r) for res in results if res["name"] == "BP" for r in finished(res["runs"])}


def paired_delta(runs):
    deltas = [final_error(r) - bp_final[r["seed"]] for r in finished(runs) if r["seed"] in bp_final]
    if not deltas:
        return "n/a"
    return f"{mean(deltas):+.2%} ± {half_range(deltas):.2%}"


failures = []
for result in results:
    on_reference = any(r.get("backend") == "reference" for r in result["runs"])
    stages_cell = f"{result['stages']}†" if on_reference else result["stages"]
    ok = finished(result["runs"])
    failed_runs = [r for r in result["runs"] if "failed" in r]
    failed = [r["seed"] for r in failed_runs]
    failures += [f"- {result['name']}, seed {r['seed']}: `{r['failed']}`" for r in failed_runs]
    if not ok:
        cell = f"failed (seeds {failed}; below)" if failed else f"not run ({result.get('skipped', 'no runs yet')})"
        lines.append(f"| {result['name']} | {stages_cell} | {cell} | | | | |")
        continue
    finals = [final_error(r) for r in ok]
    seeds = [r["seed"] for r in ok]
    label = result["name"] if seeds == args.seeds else f"{result['name']} (seeds {seeds})"
    label += f" (failed: seeds {failed})" if failed else ""
    earlier = mean([r["test_error"][three_quarters - 1] for r in ok])
    spread = half_range(finals)
    speed = mean([r["samples_per_s"] for r in ok])
    lines.append(
        f"| {label} | {stages_cell} | {mean(finals):.2%} | ± {spread:.2%} | "
        f"{paired_delta(result['runs'])} | {earlier:.2%} | {speed:.0f} |"
    )


def staleness_table(results):
    """Rows of the runs that measured staleness: per stage, the median over seeds and epochs of each
    epoch's median, in three windows of the run (its first eighth, to half, the second half)."""
    measured = [(res, [r["staleness"] for r in finished(res["runs"]) if r.get("staleness")]) for res in results]
    measured = [(res, runs) for res, runs in measured if runs]
    if not measured:
        return []
    eighth, half = max(1, args.epochs // 8), max(2, args.epochs // 2)
    windows = [(0, eighth), (eighth, half), (half, args.epochs)]
    names = [f"epochs {a + 1}–{b}" for a, b in windows]
    rows = [
        "",
        "Staleness per stage, ‖w_fwd − w_bwd‖ / ‖w_bwd‖ (`pipeline.fdg.staleness_every`, docs/staleness.md): "
        "the median over the run's seeds and the epochs of each window of every epoch's median.",
        "",
        "| method | stage | " + " | ".join(names) + " |",
        "| --- | --- |" + " --- |" * len(windows),
    ]
    for res, runs in measured:
        stages = sorted({stage for run in runs for epoch in run if epoch for stage in epoch}, key=int)
        for i, stage in enumerate(stages):
            cells = []
            for a, b in windows:
                epochs = [run[e] for run in runs for e in range(a, min(b, len(run)))]
                values = [epoch[stage] for epoch in epochs if epoch and stage in epoch]
                cells.append(f"{statistics.median(values):.2e}" if values else "")
            rows.append(f"| {res['name'] if i == 0 else ''} | {stage} | " + " | ".join(cells) + " |")
    return rows


ANALYSIS = "<!-- analysis: written by hand, kept when the table is regenerated -->"
md = out.with_suffix(".md")
kept = md.read_text().partition(ANALYSIS)[1:] if md.exists() else ("", "")
if reference_rows:
    lines += [
        "",
        "† run with `fdg_reference` in one process (`--backend reference`, "
        "benchmarks/convergence/resnet_reference.py).",
    ]
if failures:
    lines += ["", "Runs that did not finish (the error that stopped them):", "", *failures]
lines += staleness_table(results)
lines += ["", f"![test error per epoch]({out.with_suffix('.png').name})", ""]
md.write_text("\n".join(lines) + "\n" + "".join(kept))

import matplotlib  # noqa: E402  (only needed for the picture)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Left: the whole run; right: the second half (after the first LR decay), where the plateau is read.
fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 5))
for result in results:
    curves = [r["test_error"] for r in finished(result["runs"])]
    if curves:
        epochs_axis = list(range(1, len(curves[0]) + 1))
        errors = [100 * mean(col) for col in zip(*curves, strict=True)]
        style = "-" if result["name"] in ("BP", "1F1B") else "--"
        ax.plot(epochs_axis, errors, style, marker="o", label=result["name"])
        half = len(errors) // 2
        zoom.plot(epochs_axis[half:], errors[half:], style, marker="o", label=result["name"])
for axis in (ax, zoom):
    axis.set_xlabel("epoch")
    axis.grid(alpha=0.3)
ax.set_ylabel("test error (%), mean over seeds")
ax.set_title(f"{args.model} on {args.dataset} ({args.train_subset} train images)")
zoom.set_title("second half of the run")
zoom.legend(fontsize=7)
fig.tight_layout()
fig.savefig(out.with_suffix(".png"), dpi=120)
print(f"wrote {out.with_suffix('.md')}, {out.with_suffix('.png')}, {out.with_suffix('.json')} ({wall / 60:.1f} min)")
