"""Tests for fdg_schedule.zoo.megatron_gpt: the Megatron-DeepSpeed-style GPT, alone and as a real 2-stage pipeline."""

from __future__ import annotations

import math
from typing import Any

import lm_workers
import pytest
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.utils import partition_balanced
from dist_harness import run_ranks_each
from test_zoo_lm import NEEDS_FDG_TIES, check_tied_run, fdg_refuses_ties

from fdg_schedule.zoo import megatron_gpt, tied_layers

CONFIG = megatron_gpt.GPTConfig(
    vocab_size=97, hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=16
)


def test_specs_are_megatron_deepspeeds_layout() -> None:
    """Tied EmbeddingPipe first and last (the head with forward_fn), transformer layers, a final norm."""
    specs = megatron_gpt.gpt_specs(CONFIG)
    first, last = specs[0], specs[-1]
    assert isinstance(first, TiedLayerSpec) and isinstance(last, TiedLayerSpec)
    assert first.key == last.key == "embed" and first.typename is last.typename is megatron_gpt.EmbeddingPipe
    assert first.forward_fn is None and last.forward_fn is megatron_gpt.logits_helper
    assert first.tied_weight_attr == last.tied_weight_attr == ["word_embeddings_weight"]
    middle = specs[1:-1]
    assert [s.typename.__name__ for s in middle] == ["ParallelTransformerLayerPipe"] * 4 + ["LayerNorm"]
    # partition_method "type:transformer": the embedding goes with the first layers, the head with the last
    weights = [int("transformer" in s.typename.__name__.lower()) for s in specs]
    bounds = [int(b) for b in partition_balanced(weights=weights, num_parts=2)]
    assert bounds == [0, 3, len(specs)]
    untied = megatron_gpt.gpt_specs(megatron_gpt.GPTConfig(vocab_size=97, untie_embeddings_and_output_weights=True))
    assert not any(isinstance(s, TiedLayerSpec) for s in untied) and isinstance(untied[-1], LayerSpec)
    assert untied[-1].typename is megatron_gpt.LMHeadPipe


def test_batch_format_and_loss() -> None:
    text = torch.randint(0, 97, (3, 17))
    (tokens, position_ids, mask), (labels, loss_mask) = megatron_gpt.get_batch_pipe(text)
    assert torch.equal(tokens, text[:, :-1]) and torch.equal(labels, text[:, 1:])
    assert torch.equal(position_ids[1], torch.arange(16)) and mask.shape == (1, 1, 16, 16) and mask.dtype == torch.bool
    assert bool(mask[0, 0, 0, 1]) and not bool(mask[0, 0, 1, 0])  # True: may not attend (a later position)
    logits = torch.randn(16, 3, 97)  # [s, b, v]
    loss_mask[0, :8] = 0
    expected = F.cross_entropy(logits.transpose(0, 1)[loss_mask.bool()], labels[loss_mask.bool()])
    torch.testing.assert_close(megatron_gpt.cross_entropy(logits, (labels, loss_mask)), expected)


def test_transformer_layer_equals_a_plain_batch_first_computation() -> None:
    """[s, b, h] in and out; causal attention as the data's attention_mask says; pre-norm residuals."""
    torch.manual_seed(0)
    layer = megatron_gpt.ParallelTransformerLayerPipe(CONFIG, layer_number=0).eval()
    b, s, h, heads = 2, 16, CONFIG.hidden_size, CONFIG.num_attention_heads
    hidden = torch.randn(b, s, h)
    out = layer(hidden.transpose(0, 1)).transpose(0, 1)

    (_, _, mask), _ = megatron_gpt.get_batch_pipe(torch.zeros(b, s + 1, dtype=torch.long))
    attn = layer.self_attention
    qkv = attn.query_key_value(layer.input_layernorm(hidden)).view(b, s, heads, -1)
    q, k, v = (t.transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # [b, heads, s, head_dim]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(h // heads)).masked_fill(mask, float("-inf"))
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    x = hidden + attn.dense(context)
    expected = x + layer.mlp.dense_4h_to_h(F.gelu(layer.mlp.dense_h_to_4h(layer.post_attention_layernorm(x))))
    torch.testing.assert_close(out, expected)


def test_tied_head_uses_the_word_embeddings_and_sums_both_gradients() -> None:
    torch.manual_seed(0)
    built: Any = tied_layers.build_local(megatron_gpt.gpt_specs(CONFIG))
    embedding = built[0]
    assert built[-1].args[0] is embedding
    inputs, labels = megatron_gpt.get_batch_pipe(torch.randint(0, 97, (3, 17)))
    x = inputs
    for layer in built:
        x = layer(x)
    assert x.shape == (16, 3, 97)
    megatron_gpt.cross_entropy(x, labels).backward()
    tied_grad = embedding.word_embeddings.weight.grad.clone()

    # the same model with the head's weight a separate leaf: the tied gradient is the sum of the two
    head_weight = embedding.word_embeddings.weight.detach().clone().requires_grad_(True)
    for p in (p for layer in built if isinstance(layer, torch.nn.Module) for p in layer.parameters()):
        p.grad = None
    x = inputs
    for layer in built[:-1]:
        x = layer(x)
    megatron_gpt.cross_entropy(F.linear(x, head_weight), labels).backward()
    torch.testing.assert_close(tied_grad, embedding.word_embeddings.weight.grad + head_weight.grad)


def test_bad_config_names_the_values() -> None:
    with pytest.raises(ValueError, match="hidden_size 30 is not a multiple of num_attention_heads 4"):
        megatron_gpt.GPTConfig(vocab_size=97, hidden_size=30, num_attention_heads=4)


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """lm_workers.train_tied of GPTModelPipe under 1F1B and (where it trains ties) FDG, in one launch (Note [one
    launch, several calls] in dist_harness.py); schedule -> the results in rank order."""
    tmp = tmp_path_factory.mktemp("megatron")
    schedules = ["1f1b"] + ([] if fdg_refuses_ties() else ["fdg"])
    calls = [({"model": "megatron", "schedule": s, "steps": 4, "workdir": str(tmp / s)},) for s in schedules]
    return dict(zip(schedules, run_ranks_each(lm_workers.train_tied, 2, tmp, calls, deadline_s=400)))


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_megatron_gpt_trains_under_1f1b_with_equal_copies(megatron_runs) -> None:
    """GPTModelPipe at 2 stages under DeepSpeed's 1F1B: word embeddings equal on both stages after every
    train_batch, the loss falls, eval equals the one-process model, a DeepSpeed checkpoint loads back."""
    results = megatron_runs["1f1b"]
    check_tied_run(results, steps=4, hf=False)
    assert sorted(results[0]["tied"][0]) == ["embed.word_embeddings_weight"]


@pytest.mark.distributed
@pytest.mark.timeout(450)
@NEEDS_FDG_TIES
def test_megatron_gpt_trains_under_fdg_k2_unmodified(megatron_runs) -> None:
    """The same script with pipeline.schedule "fdg" (K = 2): copies torch.equal after every train_batch."""
    check_tied_run(megatron_runs["fdg"], steps=4, hf=False)
