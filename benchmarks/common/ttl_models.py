"""The time-to-loss test's two models, defined once: the runner trains them, the throughput benchmark times them.

``benchmarks/convergence/time_to_loss.py`` (issue 63, part 4) trains them; ``bench_models``' ``ttl_lm`` and
``ttl_resnet`` are these models, so the K = 2 throughput ratio times the very models the curves come from.
docs/results/time-to-loss-preregistration.md's task table fixes them, and its queue runs a frozen copy of the
runner (commit ``51720f3``, where these values sat in the runner itself): nothing here may change
(``tests/test_time_to_loss.py`` compares them with the table's literal values).

    lm       LLaMA-style (HF ``LlamaConfig``: RMSNorm, SwiGLU, rotary), 8 decoder layers of width 128,
             intermediate 344, 4 heads, 2 KV heads, untied, vocabulary 4,096: 10 pipeline layers;
             micro-batches of 8 blocks of 128 tokens
    resnet   CIFAR ResNet-20 from the zoo (``cifar_resnet_layers(20, 10, 1)``: 10 classes, 1 input channel),
             12 pipeline layers; micro-batches of 32 MNIST images (28x28)

The builders draw the initial weights from torch's global generator: the caller seeds it.
"""

from __future__ import annotations

from typing import Any

LLAMA = {
    "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 344,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 4096,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "rms_norm_eps": 1e-6,
}  # fmt: skip
LM_MICRO, LM_BLOCK = 8, 128  # blocks per micro-batch, tokens per block
RESNET_DEPTH, RESNET_CLASSES, RESNET_CHANNELS = 20, 10, 1  # MNIST: 10 digits, grey
RESNET_MICRO, RESNET_IMAGE = 32, 28  # images per micro-batch, their side in pixels


def lm_layers() -> list[Any]:
    """The LM's pipeline layers (embedding, the 8 decoder blocks, the head), built."""
    from transformers import LlamaConfig

    from fdg_schedule.zoo import hf_lm

    return list(hf_lm.pipeline_layers(hf_lm.build_model(LlamaConfig(**LLAMA))))


def resnet_layers() -> list[Any]:
    """The ResNet's pipeline layers, as the zoo gives them (``LayerSpec``s and modules)."""
    from fdg_schedule.zoo import resnet

    return list(resnet.cifar_resnet_layers(RESNET_DEPTH, RESNET_CLASSES, RESNET_CHANNELS))
