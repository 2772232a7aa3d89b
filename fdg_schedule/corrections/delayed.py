"""What a stage keeps between a micro-batch's forward and its delayed backward, in each FDG mode.

    weights \\ activations   "stored"                          "recomputed"
    "current"               graph; saved weights read live    input + RNG; forward rerun, live weights
    "stashed"               graph + weight snapshot           input + RNG + weight snapshot

Note [saved weights read live]: torch 2.x records a version counter with every tensor autograd
saves, and an optimizer step between forward and backward bumps the weights' counters (later
forwards bump batch-norm running statistics'), so the delayed backward would raise "modified by an
inplace operation" (for torch optimizers; DeepSpeed's wrappers write through ``.data`` and would
silently mix versions). The forward therefore runs under saved-tensor hooks: a saved tensor that
lives in a parameter's or buffer's storage is handed back as the same tensor, so the backward
reads it as it is at backward time -- the current weights, whatever optimizer wrote them. Every
other saved tensor (the activations) keeps its version check.

Note [rebuilding a stored graph]: autograd graphs cannot be saved. A checkpoint keeps, for each
micro-batch in flight, its stage input, the RNG state its forward started from, the tensors autograd
saved (in the order it saved them) and, under "stashed", the weight snapshot. On load the forward
runs again under the same hooks, which hand autograd the checkpointed tensors instead of the ones
it computes: the rebuilt graph has the original structure and the original saved values, so the
delayed backward is bit for bit the one the uninterrupted run computes, in every mode.

Note [stashed weights]: ``weights="stashed"`` copies the stage's trainable weights at forward
time and, for the backward, copies them into the parameters' own storage and back afterwards.
Autograd, activation checkpointing and the recomputed forward then all see the forward's weights
through the same storage, for every optimizer and precision wrapper.

Note [the recomputed forward runs as the first did]: under ``activations="recomputed"`` the first
forward must draw the random numbers the recompute will draw again from the same RNG state, so both
run the same kernels. Kernel choice can depend on whether gradients are recorded: PyTorch picks the
scaled-dot-product-attention backend (flash, memory-efficient, cuDNN, math) partly from whether
its inputs require gradients, and the backends draw different dropout masks. So the first forward
runs with gradients enabled, as the recompute does, and its graph is dropped at once (its outputs
are detached): it lives for that forward only, as one micro-batch's graph lives in the recompute.

Note [saved activations freed during the backward]: ``Held.saved`` lists every tensor autograd saved
in a stored forward, for checkpoints (Note [rebuilding a stored graph]). The backward lets the list
go before it runs, so each activation is freed as soon as autograd has used it, as in a plain
backward; kept to the end, every activation of the micro-batch would live through the whole backward.

Note [one direction]: the engine (and the torch.distributed.pipelining schedule) calls into
``corrections/``; nothing here calls back. What has to happen around a stage's forward, its delayed
backward, a checkpoint's rebuild and an optimizer step is a context the caller enters and runs its own
code inside (:meth:`DelayedBackward.forwarding`, :meth:`~DelayedBackward.backward`,
:meth:`~DelayedBackward.rebuilding`, :meth:`fdg_schedule.corrections.staleness.Corrections.stepping`);
the caller reports back through what the context yields (``Forward.outputs``, ``Step.taken``) or
learns from it whether to run the forward again (the yielded bool). No callable of the engine is handed
down, so the correction and the engine code it wraps read top to bottom in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fdg_schedule.base import rng
from fdg_schedule.base.config import FDGConfig
from fdg_schedule.base.errors import FDGRuntimeError
from fdg_schedule.base.tensors import detached


@dataclasses.dataclass
class Held:
    """What is kept for one micro-batch in flight on one stage (the stage's state owns it between ticks)."""

    weights: list[Tensor] | None = None  # weights="stashed": the forward's weights
    rng_state: tuple[Tensor, Tensor | None] | None = None  # host and accelerator RNG state the forward started from
    saved: list[Tensor] | None = None  # activations="stored": what autograd saved, in order

    def nbytes(self) -> int:
        """Bytes of saved activations and weight snapshots."""
        return sum(t.numel() * t.element_size() for t in (*(self.saved or ()), *(self.weights or ())))


@dataclasses.dataclass
class Forward:
    """One forward inside :meth:`DelayedBackward.forwarding`: the caller sets ``outputs``."""

    held: Held | None  # what the backward needs; None on the last stage (no delay)
    outputs: Any = None


class DelayedBackward:
    """Runs a stage's forwards so their backward can run ``delay`` ticks and optimizer steps later.

    It keeps nothing itself: :meth:`forwarding` hands out the :class:`Held` record of a micro-batch,
    which :class:`~fdg_schedule.runtime.stage_state.StageState` keeps until :meth:`backward` consumes it.
    Its methods are contexts the caller runs the stage forward and backward inside (Note [one direction]).

    Args:
        module: the stage (its trainable parameters are the ones stashed or read live).
        config: the FDG modes.
        delayed: False on the last stage (delay 0): forward and backward run back to back.
    """

    def __init__(self, module: nn.Module, config: FDGConfig, delayed: bool) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.state_storages = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        self.delayed = delayed
        self.stash = delayed and config.weights == "stashed"
        self.recompute = delayed and config.activations == "recomputed"

    @contextlib.contextmanager
    def forwarding(self) -> Iterator[Forward]:
        """Context for a stage forward that the caller runs inside, setting ``forward.outputs``.

        On leaving, ``forward.outputs`` is what the stage keeps of the outputs (detached under recomputed
        activations) and ``forward.held`` what the backward needs (None: no delay). Note [one direction].
        """
        if not self.delayed:  # the backward follows at once: plain autograd
            yield Forward(None)
            return
        forward = Forward(Held(rng_state=rng.capture()))
        assert forward.held is not None
        if self.stash:
            forward.held.weights = [p.detach().clone() for p in self.params]
        if self.recompute:  # Note [the recomputed forward runs as the first did]
            with torch.enable_grad():
                yield forward
                forward.outputs = detached(forward.outputs)
        else:
            forward.held.saved = []
            with _saved_tensors_read_live(forward.held, self.state_storages):
                yield forward

    @contextlib.contextmanager
    def rebuilding(self, held: Held) -> Iterator[bool]:
        """Context for rebuilding a stored forward's graph from a checkpoint (Note [rebuilding a stored graph]):
        yields whether the caller runs the stage forward inside (False under recomputed activations, which keep
        no graph); updates ``held``. Note [one direction]."""
        if self.recompute:
            yield False
            return
        assert held.saved is not None and held.rng_state is not None
        saved, held.saved = held.saved, []
        replaced = _saved_tensors_read_live(held, self.state_storages, replace=iter(saved))
        with rng.replayed(held.rng_state), _buffers_kept(self.module), replaced:
            yield True
        if len(held.saved) != len(saved):
            raise FDGRuntimeError(
                f"cannot rebuild a stored forward: the checkpoint holds {len(saved)} saved tensors, the forward "
                f"now saves {len(held.saved)}; the stage's code changed since the save"
            )

    @contextlib.contextmanager
    def backward(self, held: Held) -> Iterator[bool]:
        """Context for the delayed backward of ``held``: yields whether the caller reruns the stage forward inside
        (recomputed activations) before back-propagating; else it back-propagates through the stored outputs.

        With stashed weights the forward's weights sit in the parameters for the whole context;
        with recomputed activations the context replays the forward's RNG state and leaves buffers
        (batch-norm running statistics) as the first forward left them. Note [one direction].
        """
        with self._weights_of(held):
            if not self.recompute:
                held.saved = None  # Note [saved activations freed during the backward]: the graph holds them
                yield False
                return
            assert held.rng_state is not None
            with rng.replayed(held.rng_state), _buffers_kept(self.module):
                yield True  # the forward and the backward run in here, before the buffers are put back

    @contextlib.contextmanager
    def _weights_of(self, held: Held) -> Iterator[None]:
        if held.weights is None:
            yield
            return
        # Note [stashed weights]
        with torch.no_grad():
            current = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(_data(self.params), held.weights)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(_data(self.params), current)


def _data(params: Sequence[Tensor]) -> list[Tensor]:
    # ``.data`` has its own version counter: restoring weights is not an autograd-visible write.
    return [p.data for p in params]


@contextlib.contextmanager
def _saved_tensors_read_live(
    held: Held, state_storages: set[int], replace: Iterator[Tensor] | None = None
) -> Iterator[None]:
    """Note [saved weights read live]; ``replace`` substitutes the saved activations, in order."""

    def pack(t: Tensor) -> tuple[Tensor, int | None]:
        if t.untyped_storage().data_ptr() in state_storages:
            return t, None
        if replace is not None:
            original = next(replace, None)
            if original is None or original.shape != t.shape or original.dtype != t.dtype:
                raise FDGRuntimeError(
                    f"cannot rebuild a stored forward from the checkpoint: saved tensor {len(held.saved or [])} is "
                    f"{None if original is None else (tuple(original.shape), original.dtype)}, the forward now saves "
                    f"{(tuple(t.shape), t.dtype)}; the stage's code changed since the save"
                )
            t = original
        # Note [no reference cycle]: a tensor autograd saves may be the output of the very node that saves
        # it (sigmoid, tanh, exp); kept with its grad_fn it would form a cycle node -> packed -> tensor ->
        # node, which only the cycle collector frees (off under DeepSpeed's "disable_python_gc"). A
        # detached alias shares the storage and the version counter, and holds no graph.
        t = t.detach()
        assert held.saved is not None
        held.saved.append(t)
        return t, t._version

    def unpack(packed: tuple[Tensor, int | None]) -> Tensor:
        t, version = packed
        if version is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: saved at version {version}, now at version {t._version}; "
                "a layer of this stage writes in place into a tensor autograd saved"
            )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    saved = [b.detach().clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(module.buffers(), saved):
                b.data.copy_(s)  # not a write autograd sees: batch norm saved these for its backward
