"""The layer profiler: what it measures, that it leaves the model and RNG alone, and its file format."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import toy
from torch import nn

from fdg_schedule.partitioning import profile as profiling
from fdg_schedule.partitioning.profile import (
    LayerCost,
    ModelProfile,
    layer_name,
    optimizer_from_ds_config,
    profile_layers,
)


@pytest.fixture(scope="module")
def measured() -> ModelProfile:
    torch.set_num_threads(1)
    x, y = toy.micro_batches(1, 4)[0]
    return profile_layers(toy.layers(), x, y, toy.loss_fn, repeats=3, warmup=1)


def test_every_layer_is_measured(measured: ModelProfile) -> None:
    layers = toy.layers()
    assert measured.names == [layer_name(layer) for layer in layers]
    assert measured.micro_batch == 4 and measured.dtype == "float32" and measured.device == "cpu"
    assert measured.input_bytes == 4 * toy.IN * 4
    for index, cost in enumerate(measured.layers):
        assert cost.forward_s > 0 and cost.recompute_s > 0
        has_params = index in (0, 2, 4, 6, 8)  # the linear layers (specs and one built module)
        assert (cost.params > 0) == has_params, cost
        assert (cost.step_s > 0) == has_params and (cost.optimizer_state_bytes > 0) == has_params, cost
    linear = measured.layers[0]  # SeededLinear(6, 8): 56 parameters, output 4 x 8 floats, saves its input
    assert (linear.params, linear.param_bytes, linear.activation_bytes) == (56, 224, 4 * 8 * 4)
    assert linear.saved_bytes == 4 * toy.IN * 4  # the (cloned) input; the weight is not counted
    pair = measured.layers[3]  # h -> (h, h * h): two outputs; h * h saves h twice (counted per save, as the engine)
    assert pair.activation_bytes == 2 * 4 * 8 * 4 and pair.saved_bytes == 2 * 4 * 8 * 4
    assert measured.layers[-1].backward_s > 0  # from the loss


def test_rounds_interleave_the_layers_unless_told_not_to() -> None:
    # Plain functions run as they are (no copy), so they can log which layer ran a forward with autograd.
    ran: list[int] = []

    def logging_layer(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def layer(x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                ran.append(i)
            return torch.tanh(x)

        return layer

    layers = [logging_layer(i) for i in range(3)]
    x = torch.randn(4, 5)
    interleaved = profile_layers(layers, x, repeats=2, warmup=1)
    # set-up (one forward per layer), 3 rounds each rotated by one, the saved-bytes count per layer
    assert ran == [0, 1, 2] + [0, 1, 2, 1, 2, 0, 2, 0, 1] + [0, 1, 2]
    ran.clear()
    one_by_one = profile_layers(layers, x, repeats=2, warmup=1, interleave=False)
    assert ran == [i for i in range(3) for _ in range(5)]  # set-up, 3 rounds, saved bytes; then the next layer
    assert interleaved.meta["interleaved"] and not one_by_one.meta["interleaved"]


def test_no_copy_of_the_input_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [the input is copied before the clock starts]: between a clock read and the layer's forward
    # (with or without autograd) no tensor is copied. Fails if the copy moves back into the timed window.
    events: list[str] = []

    class Copies(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.clone, torch.clone, torch.Tensor.copy_):
                events.append("copy")
            return func(*args, **(kwargs or {}))

    def clock(device: torch.device) -> float:
        events.append("clock")
        return float(len(events))

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            events.append("forward")
            return self.linear(x).relu_()

    monkeypatch.setattr(profiling, "_now", clock)
    with Copies():
        profile_layers([Probe(), Probe()], torch.randn(4, 5), repeats=2, warmup=1)
    # two layers, three rounds, a forward with and one without autograd: each starts right at a clock
    # read, and its copy of the input was made just before that read
    timed = [events[j - 1 : j + 2] for j in range(1, len(events) - 1) if events[j : j + 2] == ["clock", "forward"]]
    assert timed == [["copy", "clock", "forward"]] * (2 * 3 * 2), events


def test_sizes_do_not_depend_on_interleaving(measured: ModelProfile) -> None:
    x, y = toy.micro_batches(1, 4)[0]
    one_by_one = profile_layers(toy.layers(), x, y, toy.loss_fn, repeats=1, warmup=0, interleave=False)
    sizes = ("name", "param_bytes", "activation_bytes", "saved_bytes", "params", "optimizer_state_bytes")
    for a, b in zip(measured.layers, one_by_one.layers):
        assert [getattr(a, k) for k in sizes] == [getattr(b, k) for k in sizes]


def test_the_model_and_the_random_stream_are_untouched() -> None:
    layers = toy.layers()
    raw = layers[6]  # a built module: profiled on a copy
    before = {k: v.clone() for k, v in raw.state_dict().items()}
    torch.manual_seed(3)
    state = torch.get_rng_state()
    x, y = toy.micro_batches(1, 4)[0]
    profile_layers(layers, x, y, toy.loss_fn, repeats=1, warmup=0)
    assert torch.equal(torch.get_rng_state(), state)
    for key, value in raw.state_dict().items():
        assert torch.equal(value, before[key])
    assert raw.weight.grad is None


def test_file_round_trip_and_errors(measured: ModelProfile, tmp_path: Path) -> None:
    path = measured.save(tmp_path / "p.json")
    assert ModelProfile.load(path) == measured
    data = json.loads(path.read_text())
    # What the planner reads: per layer eight fields, per model micro_batch, device, dtype.
    planner_fields = {"name", "forward_s", "backward_s", "recompute_s", "step_s", "param_bytes"}
    planner_fields |= {"activation_bytes", "saved_bytes"}
    assert planner_fields <= set(data["layers"][0]) and {"micro_batch", "device", "dtype"} <= set(data)
    # A profile with only those fields (e.g. estimated elsewhere) loads; params default to 0.
    minimal = {"micro_batch": 4, "device": "cpu", "dtype": "float32"}
    minimal["layers"] = [{k: v for k, v in layer.items() if k in planner_fields} for layer in data["layers"]]
    assert ModelProfile.from_dict(minimal).layers[0].params == 0
    with pytest.raises(ValueError, match="forward_s must be a finite number >= 0, got -1"):
        LayerCost("x", -1, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"p.json: missing key\(s\) \['micro_batch'\]"):
        ModelProfile.from_dict({"layers": [], "device": "cpu", "dtype": "float32"}, source="p.json")
    with pytest.raises(ValueError, match="format 'other/2' is not 'fdg_schedule.profile/1'"):
        ModelProfile.from_dict({**data, "format": "other/2"})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a JSON layer profile"):
        ModelProfile.load(tmp_path / "bad.json")


def test_cache_measures_once_per_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = toy.micro_batches(1, 4)[0]
    first, path = profiling.cached_profile(
        toy.layers(), x, tmp_path, y, toy.loss_fn, repeats=1, warmup=0, interleave=False
    )
    assert path.exists() and path.name == f"profile-{first.key}.json"
    assert first.meta["interleaved"] is False  # passed through to profile_layers

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again although the profile is cached")

    monkeypatch.setattr(profiling, "profile_layers", refuse)
    again, same = profiling.cached_profile(toy.layers(), x, tmp_path, y, toy.loss_fn, repeats=1, warmup=0)
    assert same == path and again == first
    # Another micro-batch size or optimizer is another profile.
    assert profiling.profile_key(toy.layers(), x[:2]) != first.key
    adam = optimizer_from_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert profiling.profile_key(toy.layers(), x, optimizer=adam) != first.key


def test_optimizer_from_ds_config() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    sgd = optimizer_from_ds_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    adamw = optimizer_from_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}})
    assert isinstance(adamw(params), torch.optim.AdamW)
    assert isinstance(optimizer_from_ds_config({})(params), torch.optim.SGD)  # a client optimizer: SGD stands in


# Files both former writers produced before there was one format module: the profiler's (integer bytes,
# params, optimizer state, a cache key) and the planner's --save-profile (eight layer fields, fractional
# sizes, no key). Both load with the profiler's and with the planner's reader, to the same profile.
PROFILER_FILE = {
    "format": "fdg_schedule.profile/1", "micro_batch": 4, "device": "cpu", "dtype": "float32",
    "input_bytes": 128, "key": "0123456789abcdef", "meta": {"repeats": 3},
    "layers": [{"name": "Linear", "forward_s": 1e-4, "backward_s": 2e-4, "recompute_s": 1e-4, "step_s": 1e-5,
                "params": 72, "param_bytes": 288, "activation_bytes": 256, "saved_bytes": 128,
                "optimizer_state_bytes": 288}],
}  # fmt: skip
PLANNER_FILE = {
    "format": "fdg_schedule.profile/1", "micro_batch": 4, "device": "H100", "dtype": "bfloat16",
    "input_bytes": 64.0, "meta": {"source": "flops"},
    "layers": [{"name": "l0", "forward_s": 1.0, "backward_s": 2.0, "recompute_s": 1.0, "step_s": 0.0,
                "param_bytes": 40.5, "activation_bytes": 10.0, "saved_bytes": 100.0}],
}  # fmt: skip


@pytest.mark.parametrize("data", [PROFILER_FILE, PLANNER_FILE], ids=["profiler", "planner"])
def test_one_format_reads_both_former_writers_files(data: dict, tmp_path: Path) -> None:
    from fdg_schedule.partitioning import profile_format
    from fdg_schedule.plan import costs

    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    profile = ModelProfile.load(path)
    assert profile is not None and costs.ModelProfile is ModelProfile is profile_format.ModelProfile
    planner = costs.load_profile(path)
    assert planner.layers == profile.layers and planner.input_bytes == profile.input_bytes == data["input_bytes"]
    assert planner.meta == {**profile.meta, "source": str(path)}
    layer = data["layers"][0]
    assert profile.layers[0].params == layer.get("params", 0)
    assert profile.layers[0].optimizer_state_bytes == layer.get("optimizer_state_bytes", 0)
    assert profile.key == data.get("key", "")
    # Written back, both forms load to the same profile.
    assert ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    assert costs.profile_to_dict(profile) == profile.to_dict()


def test_the_format_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, importlib.util, types\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "spec = importlib.util.spec_from_file_location(\n"
        "    'profile_format', 'fdg_schedule/partitioning/profile_format.py')\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['profile_format'] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(module.ModelProfile.__name__)\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ModelProfile", result.stderr
