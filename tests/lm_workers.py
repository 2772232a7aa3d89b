"""Rank-side code of the tied-model tests: a zoo LM with a tied embedding as a real DeepSpeed pipeline.

One script for every schedule: the DeepSpeed config's ``pipeline.schedule`` ("1f1b" or "fdg") is
the only switch, as a user's job would flip it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

VOCAB, SEQ, MICRO, GAS = 97, 16, 4, 4


def ds_config(schedule: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "pipeline": {"stages": 2, "schedule": schedule},
    }
    if schedule == "fdg":
        cfg["pipeline"]["fdg"] = {"grad_shrink": 0.5}
    return cfg


def build(model: str, seed: int, untie: bool = False) -> tuple[list[Any], PipelineModule, Any]:
    """The layer list, the 2-stage ``PipelineModule`` and the HF config (None for "megatron") of a zoo model."""
    from fdg_schedule.zoo import hf_lm, megatron_gpt

    torch.manual_seed(seed)
    if model == "megatron":
        config = megatron_gpt.GPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=SEQ,
            untie_embeddings_and_output_weights=untie,
        )  # fmt: skip
        return megatron_gpt.gpt_specs(config), megatron_gpt.GPTModelPipe(config, num_stages=2), None
    hf = hf_lm.build_model(hf_lm.build_config(model, "tiny", VOCAB, SEQ))
    layers = hf_lm.pipeline_layers(hf, untie=untie)
    pipe = PipelineModule(layers=layers, loss_fn=hf_lm.lm_loss, num_stages=2, partition_method=hf_lm.PARTITION_METHOD)
    return layers, pipe, hf.config


def micro_batches(model: str, count: int, seed: int) -> list[Any]:
    """``count`` fixed micro-batches in the model's data format (cycled through: the loss must fall)."""
    from fdg_schedule.zoo import megatron_gpt

    g = torch.Generator().manual_seed(seed)
    if model == "megatron":
        return [
            megatron_gpt.get_batch_pipe(torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)) for _ in range(count)
        ]
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        out.append((ids, ids))
    return out


def one_process_loss(model: str, layers: list[Any], states: list[dict[str, torch.Tensor]], batches: list[Any]) -> float:
    """The mean loss of ``batches`` on the whole model in one process, with the stages' weights."""
    from fdg_schedule.zoo import hf_lm, megatron_gpt, tied_layers

    built = tied_layers.build_local(layers)
    tied_modules: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        if tied_layers.is_tied_spec(layer):
            tied_modules.setdefault(layer.key, built[i])  # the module itself, not the head's partial
    for stage, state in enumerate(states):
        for name, tensor in state.items():
            owner, rest = name.split(".", 1)
            if owner == "tied_modules":
                key, rest = rest.split(".", 1)
                if stage == 0:  # the first stage's copy: every part of it is used there
                    tied_modules[key].load_state_dict({rest: tensor}, strict=False)
            else:
                built[int(owner)].load_state_dict({rest: tensor}, strict=False)
    loss_fn = megatron_gpt.cross_entropy if model == "megatron" else hf_lm.lm_loss
    losses = []
    with torch.no_grad():
        for layer in built:
            if isinstance(layer, torch.nn.Module):
                layer.eval()
        for inputs, labels in batches:
            x = inputs
            for layer in built:
                x = layer(x)
            losses.append(float(loss_fn(x, labels)))
    return sum(losses) / len(losses)


def train_tied(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``case["steps"]`` ``train_batch`` calls: the tied weights after each, the losses, a checkpoint round trip.

    case: model, schedule ("1f1b" | "fdg"), steps, untie, workdir; HF models also export and reload.
    """
    import fdg_schedule  # noqa: F401  (the config's pipeline.schedule picks the engine)
    from fdg_schedule.zoo import hf_lm, tied_layers

    model, schedule = case["model"], case["schedule"]
    layers, pipe, hf_config = build(model, seed=0, untie=case.get("untie", False))
    config = ds_config(schedule)
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=config)
    train = micro_batches(model, 4, seed=1)
    held_out = micro_batches(model, GAS, seed=2)
    out: dict[str, Any] = {"stage": engine.stage_id, "tied": [], "losses": []}

    def snapshot() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in tied_layers.tied_weights(engine.module).items()}

    def local_state() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    out["tied"].append(snapshot())  # after the start-up broadcast
    engine.set_dataiterator(itertools.cycle(train))
    for _ in range(case["steps"]):
        out["losses"].append(float(engine.train_batch()))
        out["tied"].append(snapshot())
    if hasattr(engine, "drain"):
        engine.drain()
        out["tied"].append(snapshot())
    out["eval"] = float(engine.eval_batch(iter(held_out)))
    states: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(local_state(), states, dst=0)
    if rank == 0:
        assert states is not None
        out["one_process_eval"] = one_process_loss(model, layers, states, held_out)

    if model != "megatron":  # export the whole model to HF and reload it
        state = hf_lm.gather_hf_state_dict(engine.module)
        if rank == 0:
            from transformers import AutoModelForCausalLM

            assert state is not None
            exported = hf_lm.export_hf(state, hf_config, Path(case["workdir"]) / "hf")
            reloaded = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
            out["hf_tied"] = hf_lm.is_tied(reloaded)
            with torch.no_grad():
                losses = [float(hf_lm.lm_loss(reloaded(ids).logits, labels)) for ids, labels in held_out]
            out["hf_eval"] = sum(losses) / len(losses)

    # DeepSpeed's checkpoint of the tied pipeline, loaded into a fresh engine (other initial weights)
    save_dir = str(Path(case["workdir"]) / "ckpt")
    engine.save_checkpoint(save_dir)
    trained = local_state()
    _, pipe2, _ = build(model, seed=7, untie=case.get("untie", False))
    engine2, *_ = deepspeed.initialize(model=pipe2, model_parameters=pipe2.parameters(), config=config)
    engine2.load_checkpoint(save_dir)
    loaded = {k: v.detach() for k, v in engine2.module.state_dict().items()}
    # A tied module is saved from the stage holding its first spec; the others get its tied weights
    # (DeepSpeed's broadcast) and keep their own values of what they never use (Megatron's positions).
    untied_keys = [k for k in trained if not k.startswith("tied_modules.")]
    loaded_tied = tied_layers.tied_weights(engine2.module)
    trained_tied = out["tied"][-1]
    out["checkpoint_equal"] = (
        sorted(loaded) == sorted(trained)
        and all(torch.equal(loaded[k], trained[k]) for k in untied_keys)
        and sorted(loaded_tied) == sorted(trained_tied)
        and all(torch.equal(loaded_tied[k], trained_tied[k]) for k in trained_tied)
    )
    out["checkpoint_eval"] = float(engine2.eval_batch(iter(held_out)))
    dist.barrier()
    return out
