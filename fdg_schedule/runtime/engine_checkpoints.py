"""The checkpoint half of the FDG engine: DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` plus FDG's state.

:class:`FDGCheckpoints` is the base of :class:`~fdg_schedule.runtime.engine.FDGPipelineEngine`; the file
layout and its checks are :mod:`fdg_schedule.checkpointing.checkpoint`, what a stage carries between ticks is
:meth:`fdg_schedule.runtime.stage_state.StageState.capture`, the tied copies' optimizer state Note [tied
optimizer state in checkpoints] in :mod:`fdg_schedule.exchange.tied`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import logger

from fdg_schedule.base import optim
from fdg_schedule.base.config import FDGConfig, FDGConfigError
from fdg_schedule.base.guards import NonFiniteWatch
from fdg_schedule.checkpointing import checkpoint
from fdg_schedule.corrections import auto_corrections
from fdg_schedule.corrections.delayed import DelayedBackward, Held
from fdg_schedule.exchange.tied import TiedSync
from fdg_schedule.runtime.stage_state import StageState


class FDGCheckpoints(PipelineEngine):
    """Saving and loading an FDG stage: DeepSpeed's files plus this rank's in-flight state."""

    fdg_config: FDGConfig
    fdg_state: StageState
    _tied: TiedSync
    _tie_keys: list[str]  # every rank's cross-stage tie keys, also where it holds no copy
    _delayed: DelayedBackward
    _watch: NonFiniteWatch

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        drain: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint`` plus this rank's in-flight FDG state (see
        :mod:`fdg_schedule.checkpointing.checkpoint`).

        Every rank must call it at the same tick (between ``train_batch()`` calls). ``drain=True``
        first finishes every in-flight backward pass: a checkpoint any schedule can continue from.
        """
        if drain:
            self.drain()
        if self._tied.in_flat_file and self.fdg_state.in_flight():  # Note [tied copies in flat optimizer files]
            logger.warning(
                f"{self._where()}: saved undrained with layers tied across stages under a flat (bf16/ZeRO-1) "
                "optimizer, whose file holds one step count per param group; the owner stages have taken different "
                "numbers of steps, so a 1F1B job loading this checkpoint would step the tied copies with different "
                "step counts (Adam's bias correction) and they would drift apart. An FDG job resumes it exactly; "
                "to switch to 1F1B, save with save_checkpoint(..., drain=True)"
            )
        if self._tied and self.fp16_enabled() and not self._tied.in_flat_file:  # Note [tied layers under fp16]
            logger.warning(
                f"{self._where()}: fp16 with layers tied across stages: DeepSpeed's fp16 optimizer file holds the "
                "stage's own parameters, not the tied copies (FDG's file holds their fp32 masters and state), so a "
                "1F1B job can load this checkpoint's weights but not its optimizer state "
                "(load_checkpoint(..., load_optimizer_states=False)); an FDG job resumes it exactly"
            )
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        path = checkpoint.state_path(save_dir, tag, self.stage_id, self.grid.data_parallel_id)
        self._exchange.complete()  # Note [no wait between calls]: the last call's receives have arrived by now
        captured = self.fdg_state.capture()
        captured["corrections_auto"] = auto_corrections.recorded(self.fdg_config)  # Note [the auto rule]
        if self.fdg_config.accumulate > 1:  # Note [a partial accumulation in a checkpoint]
            captured["accumulated"] = optim.capture_accumulated(self.optimizer, self._delayed.params)
        checkpoint.save(path, self._identity(), captured)
        frozen = exclude_frozen_parameters
        # Note [tied optimizer state in checkpoints]; Note [the scale in DeepSpeed's files] (fp16)
        with self._tied.in_stage_optimizer(), self.fdg_state.scaling.deepspeed_view():
            saved = super().save_checkpoint(save_dir, tag, client_state or {}, False, exclude_frozen_parameters=frozen)
        if save_latest:  # only once every rank has written every file
            checkpoint.publish(save_dir, tag, self.global_rank)
        return saved

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, Any]:
        """DeepSpeed's ``load_checkpoint``, then the in-flight FDG state of this rank.

        The in-flight micro-batches are rebuilt exactly when the checkpoint was saved by an FDG job
        with the same stages, data parallelism and modes; otherwise they are dropped with a log line
        saying how many. A checkpoint of another number of stages loads its weights (re-partitioned
        by layer) when optimizer and scheduler state are not requested.
        """
        self._exchange.complete()  # Note [no wait between calls]: nothing posted may outlive the state replaced
        resolved = checkpoint.resolve_tag(load_dir, tag)
        if resolved is not None and not load_module_only:  # before DeepSpeed's load: "auto" must choose alike
            self._check_auto_choice(load_dir, resolved)
        # Note [tied optimizer state in checkpoints]; Note [tied copies in flat optimizer files]
        wrapped = self.optimizer is not self.basic_optimizer and not self._tied.in_flat_file
        if self._tie_keys and wrapped and load_optimizer_states and not load_module_only and resolved is not None:
            self._check_tied_optimizer_state(load_dir, resolved)
        per_stage = not load_module_only and (load_optimizer_states or load_lr_scheduler_states)
        other_stages = checkpoint.other_stages(load_dir, resolved, self.num_stages, per_stage_state=per_stage)
        bf16_from_zero_files = load_optimizer_states and self._bf16_without_zero()
        with self._tied.in_stage_optimizer():  # Note [tied optimizer state in checkpoints]
            load_path, client_state = super().load_checkpoint(
                load_dir, tag=resolved, load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states and not bf16_from_zero_files,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                custom_load_fn=custom_load_fn,
            )  # fmt: skip
            if bf16_from_zero_files and load_path is not None and resolved is not None and not load_module_only:
                self._load_zero_checkpoint(load_dir, resolved, load_optimizer_states=True)
        if load_path is None or resolved is None:
            return load_path, client_state
        if load_module_only:  # weights only: no in-flight work, RNG state or data position
            return load_path, client_state
        self.fdg_state.scaling.after_deepspeed_load(load_optimizer_states)  # fp16: FDG steers the scale again
        if other_stages:
            logger.warning(f"stage {self.stage_id}: client_state dropped: it belongs to another pipeline layout")
            client_state = {}
        self._restore_in_flight(load_dir, resolved)
        return load_path, client_state

    def _check_tied_optimizer_state(self, load_dir: str, tag: str) -> None:
        """A checkpoint without FDG state (1F1B's) keeps the tied copies in the stage optimizer: under a wrapper
        whose flat file FDG does not translate (a param group of only tied copies, ``round_robin_gradients``),
        refuse its state.

        Note [tied optimizer state in checkpoints]: an unwrapped stage optimizer loads it exactly, and Note
        [tied copies in flat optimizer files] a bf16 / ZeRO-1 one.
        """
        saved_dir = os.path.join(load_dir, tag)
        if not os.path.isdir(saved_dir) or any(n.startswith("fdg_stage") for n in os.listdir(saved_dir)):
            return
        keys = self._tie_keys
        raise FDGConfigError(
            f"checkpoint {saved_dir} has no FDG state (a 1F1B checkpoint?) and this model ties {keys} across "
            f"stages: 1F1B's optimizer state holds the tied parameters of {keys} in the buffers of the stage's "
            "fp16/bf16/ZeRO optimizer in a layout FDG does not translate (DeepSpeed's fp16 optimizers without ZeRO, "
            "a param group of only tied parameters, or zero_optimization.round_robin_gradients), so it cannot be "
            "loaded exactly; call load_checkpoint(..., "
            "load_optimizer_states=False) to load the weights and LR scheduler (optimizer state starts fresh)"
        )

    def _check_auto_choice(self, load_dir: str, tag: str) -> None:
        """Note [the auto rule]: a checkpoint saved under ``corrections: "auto"`` resumes only where "auto" chooses
        the same keys (this rank's stage file; another layout's has none to compare)."""
        path = checkpoint.state_path(load_dir, tag, self.stage_id, self.grid.data_parallel_id)
        if os.path.exists(path):
            saved = torch.load(path, weights_only=False, mmap=True, map_location="cpu").get("corrections_auto")
            auto_corrections.check_resume(saved, self.fdg_config, self._where())

    def _bf16_without_zero(self) -> bool:
        """Note [bf16 optimizer state]: DeepSpeed 0.19.8 saves the state of its bf16 wrapper without ZeRO
        in the ZeRO optimizer files (``bf16_zero_pp_rank_*``), one per data-parallel rank, but loads it from
        the model-states file, where the wrapper cannot read it (``KeyError: 0``, also under 1F1B). FDG
        loads it from the ZeRO files, as DeepSpeed does under ZeRO."""
        return isinstance(self.optimizer, BF16_Optimizer) and not self.zero_optimization()

    def _identity(self) -> dict[str, Any]:
        return checkpoint.identity(self.num_stages, self.dp_world_size, self.fdg_config)

    def _restore_in_flight(self, load_dir: str, tag: str) -> None:
        """This rank's in-flight state from the checkpoint, or an empty pipeline when it cannot continue."""
        dp_id, log = self.grid.data_parallel_id, self.global_rank == 0
        saved = checkpoint.load(load_dir, tag, self.stage_id, dp_id, self._identity(), log=log, device=self.device)
        self.fdg_state.reset()
        self._watch.clear()
        if saved is None:  # Note [what a layout change keeps] in fdg_schedule.checkpointing.checkpoint
            self.fdg_state.scaling.restore(None)  # fp16: the scale DeepSpeed's file holds (a 1F1B checkpoint)
            tick, delta = checkpoint.carried(load_dir, tag, self.stage_id, self.num_stages)
            self.fdg_state.tick = tick
            if not self.fdg_state.corrections.restore(delta, strict=False):
                logger.warning(f"{self._where()}: the checkpoint's prediction delta does not fit; it starts at 0")
            return
        if self.training_data is not None and (self.is_first_stage() or self.is_last_stage()):
            # The engine's own loader: continue after the micro-batches read before the save.
            self._build_data_iter(self.training_data)
            for _ in range(saved["micro_batches_read"]):
                self._next_batch()
        if saved.get("accumulated") is not None:  # after DeepSpeed loaded the optimizer
            optim.restore_accumulated(self.optimizer, self._delayed.params, saved["accumulated"], self.device)
        needs_grad = not self.is_first_stage() or self._reentrant_activation_checkpointing()
        self.fdg_state.restore(saved, self._rebuilt, needs_grad, self.device)

    def _rebuilt(self, held: Held, inputs: Any) -> Any:
        """A stored forward's outputs, its graph rebuilt into ``held`` (Note [rebuilding a stored graph]); None when
        the stage recomputes (Note [one direction] in fdg_schedule.corrections.delayed)."""
        outputs = None
        with self._delayed.rebuilding(held) as rerun:
            if rerun:
                outputs = self._stage_forward(inputs)
        return outputs
