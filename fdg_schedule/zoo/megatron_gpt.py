"""A small GPT built the way Megatron-DeepSpeed's ``GPTModelPipe`` is: the stand-in for Megatron-DeepSpeed jobs.

The pipeline jobs people run on DeepSpeed (Megatron-DeepSpeed's GPT and BLOOM, GPT-NeoX) describe
the model as a ``PipelineModule`` subclass over layer specs, and tie the input embedding to the
output head with two ``TiedLayerSpec``s, one copy on the first stage and one on the last
(Megatron-DeepSpeed ``megatron/model/gpt_model.py``, ``GPTModelPipe``). This module is written the
same way, without tensor parallelism, fused kernels or Megatron's global ``args``, so that such a
job can be trained here unmodified under 1F1B or FDG::

    specs = [TiedLayerSpec("embed", EmbeddingPipe, ..., tied_weight_attr="word_embeddings_weight"),
             LayerSpec(ParallelTransformerLayerPipe, ...) × num_layers,
             LayerSpec(LayerNorm, hidden_size),                            # the final norm
             TiedLayerSpec("embed", EmbeddingPipe, ..., forward_fn=logits_helper,
                           tied_weight_attr="word_embeddings_weight")]
    GPTModelPipe(config, num_stages=2)   # PipelineModule(specs, loss_fn=cross_entropy,
                                         #                partition_method="type:transformer")

What matches Megatron-DeepSpeed: the layer list and its class names (DeepSpeed's ``PipelineModule``
recognises ``GPTModelPipe`` / ``ParallelTransformerLayerPipe`` for activation checkpointing), the
tie (the whole ``EmbeddingPipe``, positions included, is built on both stages; only
``word_embeddings_weight`` is tied, the last stage's position embedding is never used), the
sequence-first activations ``[s, b, h]`` between layers and logits ``[s, b, v]``, the data
``((tokens, position_ids, attention_mask), (labels, loss_mask))`` of ``get_batch_pipe`` and the
loss averaged over ``loss_mask``, the normal initialisation with std ``init_method_std`` (output
projections scaled by ``1/sqrt(2 num_layers)``). The attention mask is causal and built in each
layer (Megatron-DeepSpeed's ``--attn_mask`` path: the mask in the data is not sent between stages).
``untie_embeddings_and_output_weights`` gives the untied variant (an ``LMHeadPipe``), as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

TIE_KEY = "embed"


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape, named as Megatron's arguments are."""

    vocab_size: int
    """Megatron's padded_vocab_size."""
    hidden_size: int = 64
    num_layers: int = 4
    num_attention_heads: int = 4
    max_position_embeddings: int = 64
    ffn_hidden_size: int | None = None
    """Default 4 × hidden_size."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    """True: the head is its own ``LMHeadPipe`` (Megatron's flag of the same name)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads} (GPTConfig); pick sizes that divide"
            )

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


def _init_linear(linear: nn.Linear, std: float) -> nn.Linear:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    return linear


class EmbeddingPipe(nn.Module):
    """(tokens, position_ids, attention_mask) → hidden states [s, b, h]: word + position embeddings, dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        nn.init.normal_(self.word_embeddings.weight, mean=0.0, std=config.init_method_std)
        nn.init.normal_(self.position_embeddings.weight, mean=0.0, std=config.init_method_std)

    @property
    def word_embeddings_weight(self) -> torch.Tensor:
        """The tied weight (``tied_weight_attr``): what DeepSpeed broadcasts and keeps equal across stages."""
        return self.word_embeddings.weight

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tokens, position_ids = inputs[0], inputs[1]  # inputs[2], the attention mask: causal, rebuilt per layer
        hidden = self.word_embeddings(tokens) + self.position_embeddings(position_ids)
        return self.embedding_dropout(hidden.transpose(0, 1).contiguous())  # [b, s, h] → [s, b, h]


class SelfAttention(nn.Module):
    """Causal multi-head self-attention on [s, b, h] with one fused query-key-value projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.dropout = config.attention_dropout
        std = config.init_method_std
        self.query_key_value = _init_linear(nn.Linear(config.hidden_size, 3 * config.hidden_size), std)
        self.dense = _init_linear(
            nn.Linear(config.hidden_size, config.hidden_size), std / math.sqrt(2 * config.num_layers)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden.shape
        q, k, v = self.query_key_value(hidden).view(s, b, self.heads, 3 * h // self.heads).chunk(3, dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, head_dim]
        dropout = self.dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.dense(context.permute(2, 0, 1, 3).reshape(s, b, h))


class MLP(nn.Module):
    """h → ffn → h with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        std = config.init_method_std
        self.dense_h_to_4h = _init_linear(nn.Linear(config.hidden_size, config.ffn_size), std)
        self.dense_4h_to_h = _init_linear(
            nn.Linear(config.ffn_size, config.hidden_size), std / math.sqrt(2 * config.num_layers)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden)))


class ParallelTransformerLayerPipe(nn.Module):
    """One pre-norm transformer layer on [s, b, h] (Megatron's name; no tensor parallelism here)."""

    def __init__(self, config: GPTConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.hidden_dropout(self.self_attention(self.input_layernorm(hidden)))
        return hidden + self.hidden_dropout(self.mlp(self.post_attention_layernorm(hidden)))


class LMHeadPipe(nn.Module):
    """The untied output layer: hidden states [s, b, h] → logits [s, b, v]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.lm_head = _init_linear(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False), config.init_method_std
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def logits_helper(embedding: EmbeddingPipe, lm_output: torch.Tensor) -> torch.Tensor:
    """The tied head (its spec's ``forward_fn``): [s, b, h] → logits [s, b, v] with the word embeddings."""
    return F.linear(lm_output, embedding.word_embeddings_weight)


def cross_entropy(output: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Megatron's ``CrossEntropy``: token losses (fp32) averaged over ``loss_mask``; output [s, b, v], labels [b, s]."""
    targets, loss_mask = labels
    losses = F.cross_entropy(output.float().permute(1, 2, 0), targets, reduction="none")  # [b, s]
    loss_mask = loss_mask.float()
    return (losses * loss_mask).sum() / loss_mask.sum()


def gpt_specs(config: GPTConfig) -> list[LayerSpec]:
    """The layer specs of ``GPTModelPipe``, in Megatron-DeepSpeed's order."""
    tied = dict(tied_weight_attr="word_embeddings_weight")
    if config.untie_embeddings_and_output_weights:
        embedding: LayerSpec = LayerSpec(EmbeddingPipe, config)
        head: LayerSpec = LayerSpec(LMHeadPipe, config)
    else:
        embedding = TiedLayerSpec(TIE_KEY, EmbeddingPipe, config, **tied)
        head = TiedLayerSpec(TIE_KEY, EmbeddingPipe, config, forward_fn=logits_helper, **tied)
    layers = [LayerSpec(ParallelTransformerLayerPipe, config, layer_number=i) for i in range(config.num_layers)]
    final_norm = LayerSpec(nn.LayerNorm, config.hidden_size, eps=config.layernorm_epsilon)
    return [embedding, *layers, final_norm, head]


class GPTModelPipe(PipelineModule):
    """GPT as a DeepSpeed pipeline, split by transformer layers; the input embedding tied to the head.

    ``kwargs`` go to ``PipelineModule`` (``num_stages`` or ``topology``, ``seed_layers``,
    ``activation_checkpoint_interval``, ...).
    """

    def __init__(self, config: GPTConfig, **kwargs: Any) -> None:
        kwargs.setdefault("partition_method", "type:transformer")
        super().__init__(layers=gpt_specs(config), loss_fn=cross_entropy, **kwargs)
        self.config = config


def get_batch_pipe(text: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """One micro-batch as Megatron's ``get_batch_pipe`` makes it from ``text`` [b, s + 1] token ids.

    ``((tokens, position_ids, attention_mask), (labels, loss_mask))``: labels are the next tokens,
    ``attention_mask`` is True where a position may not attend ([1, 1, s, s], causal).
    """
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    s = tokens.shape[1]
    position_ids = torch.arange(s).unsqueeze(0).expand_as(tokens)
    attention_mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    loss_mask = torch.ones(labels.shape, dtype=torch.float32)
    return (tokens, position_ids, attention_mask), (labels, loss_mask)
