"""FDG versus backprop: train one model with BP, 1F1B and FDG variants, same data, epochs and seeds; tabulate.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/convergence.py --epochs 3 --train-subset 2048

Every run is `recipes/train_resnet.py` under the deepspeed launcher, with a config derived from
ds_configs/resnet_{bp,1f1b,fdg_k2}.json (only the micro-batch size and the pipeline block change), so
the numbers are those of the real engines. A run needs one rank per stage; runs with more stages than
--max-ranks are listed as not run. Writes <out>.md (final test error, mean ± half-range over seeds),
<out>.png (test error per epoch, mean over seeds) and <out>.json (every epoch of every run).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_resnet.py"
sys.path.insert(0, str(ROOT))  # run as a script: the package is in the repository root
from fdg_schedule.launch import free_port  # noqa: E402

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
parser.add_argument("--out", default=str(ROOT / "docs" / "convergence"))
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
    help="run only these (repeatable): BP, 1F1B or fdg:K:beta:weights, e.g. fdg:2:0.2:current; "
    "replaces the grid of --stages x --weights x --betas",
)
args = parser.parse_args()


def fdg_variant(stages, beta, weights):
    fdg = {"grad_shrink": beta, "weights": weights, "activations": "stored", "accumulate": 1}
    return f"FDG K={stages} β={beta:g} {weights}", stages, {"pipeline": {"schedule": "fdg", "fdg": fdg}}


# (name, stages, config changes) of the stock schedules
BASELINES: list[tuple[str, int, dict]] = [("BP", 1, {}), ("1F1B", 2, {})]


def parse_variant(spec):
    for baseline in BASELINES:
        if spec.upper() == baseline[0]:
            return baseline
    try:
        kind, stages, beta, weights = spec.split(":")
        assert kind == "fdg" and weights in ("current", "stashed")
        return fdg_variant(int(stages), float(beta), weights)
    except (ValueError, AssertionError):
        parser.error(f"--variant {spec!r}: expected BP, 1F1B or fdg:K:beta:weights (weights current|stashed)")


def variants():
    """(name, stages, config changes) of every run, BP and 1F1B first."""
    if args.variant:
        yield from (parse_variant(spec) for spec in args.variant)
        return
    if not args.fdg_only:
        yield from BASELINES
    for stages in args.stages:
        for weights in args.weights:
            for beta in args.betas:
                yield fdg_variant(stages, beta, weights)


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


def run(stages, changes, seed, workdir):
    """One recipe run; returns test error per epoch (fractions) and samples/s, or raises RunFailed."""
    config = json.loads((ROOT / "ds_configs" / "resnet_bp.json").read_text())
    config.update(changes, train_micro_batch_size_per_gpu=args.micro_batch)
    path = workdir / f"config_{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config))
    command = [
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(stages), "--master_port", str(free_port()),
        str(RECIPE), "--deepspeed_config", str(path), "--model", args.model, "--dataset", args.dataset,
        "--epochs", str(args.epochs), "--train-subset", str(args.train_subset),
        "--test-subset", str(args.test_subset), "--seed", str(seed),
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    errors = [1 - float(acc) / 100 for acc in re.findall(r"^epoch \d+/\d+: .* test_acc ([\d.]+)%", output, re.M)]
    speed = re.search(r"^final: .* \| ([\d.]+) samples/s", output, re.M)
    if proc.returncode != 0 or len(errors) != args.epochs or speed is None:
        tail = "\n".join(output.splitlines()[-15:])
        print(f"run failed (exit {proc.returncode}): {' '.join(command)}\n{tail}", flush=True)
        raise RunFailed(first_error(output, proc.returncode))
    return errors, float(speed.group(1))


def mean(xs):
    return sum(xs) / len(xs)


def half_range(xs):
    return (max(xs) - min(xs)) / 2


SETTINGS = ("model", "dataset", "epochs", "train_subset", "test_subset", "micro_batch")  # what makes runs comparable


def stored_runs(path):
    """{(variant, seed): run} from an earlier <out>.json with the same settings, and its wall time."""
    if not (args.reuse and path.exists()):
        return {}, 0.0
    stored = json.loads(path.read_text())
    differ = [key for key in SETTINGS if stored["args"].get(key) != getattr(args, key)]
    if differ:
        raise SystemExit(f"--reuse: {path} was made with other {', '.join(differ)}; drop --reuse or change --out")
    runs = {(result["name"], run["seed"]): run for result in stored["results"] for run in result["runs"]}
    return runs, stored["wall_s"]


out = Path(args.out)
out.parent.mkdir(parents=True, exist_ok=True)
if args.report_only and not args.reuse:
    parser.error("--report-only needs --reuse (it reads the runs of <out>.json)")
planned = list(variants())  # a bad --variant fails here, before any run
done, wall_before = stored_runs(out.with_suffix(".json"))
start = time.time()
results = []


def save_json():
    wall = wall_before + time.time() - start
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "wall_s": wall, "results": results}, indent=1))
    return wall


with tempfile.TemporaryDirectory() as tmp:
    for name, stages, changes in planned:
        if stages > args.max_ranks:
            results.append({"name": name, "stages": stages, "runs": [], "skipped": f"needs {stages} ranks"})
            print(f"{name}: not run (needs {stages} ranks, --max-ranks {args.max_ranks})", flush=True)
            continue
        runs: list[dict] = []
        results.append({"name": name, "stages": stages, "runs": runs})
        for seed in args.seeds:
            if (name, seed) in done:
                runs.append(done[name, seed])
                print(f"{name} seed {seed}: kept from the earlier run", flush=True)
                continue
            if args.report_only:
                print(f"{name} seed {seed}: not in {out.with_suffix('.json')}, left out", flush=True)
                continue
            run_start = time.time()
            try:
                errors, speed = run(stages, changes, seed, Path(tmp))
            except RunFailed as err:  # a result too: the table says which runs failed and why
                runs.append({"seed": seed, "failed": str(err)})
                print(f"{name} seed {seed}: FAILED ({time.time() - run_start:.0f} s): {err}", flush=True)
                save_json()
                continue
            runs.append({"seed": seed, "test_error": errors, "samples_per_s": speed})
            print(f"{name} seed {seed}: test error {errors[-1]:.2%} ({time.time() - run_start:.0f} s)", flush=True)
            save_json()  # a later failure keeps the runs made so far (rerun with --reuse)
wall = save_json()
command = "python benchmarks/convergence.py " + " ".join(sys.argv[1:])

three_quarters = max(1, round(0.75 * args.epochs))  # how flat the end of the curve is
lines = [
    "# FDG versus backprop: convergence",
    "",
    f"{args.model} on {args.dataset}: {args.train_subset} training images and {args.test_subset} test images "
    f"(a random subset fixed by the seed), {args.epochs} epochs, micro-batch {args.micro_batch} (one optimizer step "
    f"per micro-batch for every method), SGD lr 0.1 momentum 0.9 weight decay 5e-4, lr / 10 at the paper's "
    f"epoch fractions. Seeds {args.seeds}; a seed gives every method the same subsets, initial weights and "
    "data order. Test error after the last epoch, mean ± half the range over seeds; Δ BP is the difference "
    "from BP's run with the same seed (paired: the seed's share of the error cancels), mean ± half-range.",
    "",
    f"Command: `DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 {command}` — wall time {wall / 60:.1f} min on 2 shared CPU cores.",
    "",
    f"| method | stages | final test error | spread | Δ BP (paired) | at epoch {three_quarters} | samples/s |",
    "| --- | --- | --- | --- | --- | --- | --- |",
]


def finished(runs):
    return [r for r in runs if "failed" not in r]


bp_final = {r["seed"]: r["test_error"][-1] for res in results if res["name"] == "BP" for r in finished(res["runs"])}


def paired_delta(runs):
    deltas = [r["test_error"][-1] - bp_final[r["seed"]] for r in finished(runs) if r["seed"] in bp_final]
    if not deltas:
        return "n/a"
    return f"{mean(deltas):+.2%} ± {half_range(deltas):.2%}"


failures = []
for result in results:
    ok = finished(result["runs"])
    failed_runs = [r for r in result["runs"] if "failed" in r]
    failed = [r["seed"] for r in failed_runs]
    failures += [f"- {result['name']}, seed {r['seed']}: `{r['failed']}`" for r in failed_runs]
    if not ok:
        cell = f"failed (seeds {failed}; below)" if failed else f"not run ({result.get('skipped', 'no runs yet')})"
        lines.append(f"| {result['name']} | {result['stages']} | {cell} | | | | |")
        continue
    finals = [r["test_error"][-1] for r in ok]
    seeds = [r["seed"] for r in ok]
    label = result["name"] if seeds == args.seeds else f"{result['name']} (seeds {seeds})"
    label += f" (failed: seeds {failed})" if failed else ""
    earlier = mean([r["test_error"][three_quarters - 1] for r in ok])
    spread = half_range(finals)
    speed = mean([r["samples_per_s"] for r in ok])
    lines.append(
        f"| {label} | {result['stages']} | {mean(finals):.2%} | ± {spread:.2%} | "
        f"{paired_delta(result['runs'])} | {earlier:.2%} | {speed:.0f} |"
    )
ANALYSIS = "<!-- analysis: written by hand, kept when the table is regenerated -->"
md = out.with_suffix(".md")
kept = md.read_text().partition(ANALYSIS)[1:] if md.exists() else ("", "")
if failures:
    lines += ["", "Runs that did not finish (the error that stopped them):", "", *failures]
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
