"""Recompute a block's activations in the backward pass (gradient checkpointing of one module, in place), and
optionally keep the inputs a checkpointed block saves for that recomputation in CPU memory.

Wrapping ``block.forward`` (not replacing the module) keeps parameter names, and so LoRA keys, unchanged.

A checkpointed block keeps only its inputs; over a model's blocks they add up (FLUX at 512x768 with 512 text tokens:
57 blocks x 12.6 MB = 0.67 GiB, at 1024x1024 1.1 GiB). :class:`InputOffloader` moves them to pinned CPU memory as
the forward saves them (on a side stream, overlapping the next blocks' compute) and copies each back when the
backward recomputes its block. It sits around ``torch.utils.checkpoint`` as a ``saved_tensors_hooks`` pair: the
checkpoint's own hooks take over inside the block, so only the inputs it saves for the recomputation pass through.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["InputOffloader", "checkpoint_function", "ensure_recomputed", "recomputed"]

#: Inputs smaller than this stay where they are (time embeddings, masks: not worth a copy).
MIN_OFFLOAD_BYTES = 1 << 20


class InputOffloader:
    """Saved-tensor hooks that keep checkpointed blocks' inputs in pinned CPU memory between forward and backward.

    Args:
        copy_devices: device types whose tensors are moved. ``cuda`` (ROCm too) in training; tests add ``cpu`` to
            exercise the same path with a plain copy. Tensors on the ``meta`` device (the memory planner) are not
            copied but counted, so that the planner's own hook does not count them as kept.
    """

    def __init__(self, copy_devices: tuple[str, ...] = ("cuda",), min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.copy_devices = copy_devices
        self.min_bytes = min_bytes
        self.moved_bytes = 0  # running total (the planner reads it after one forward)
        # What becomes of a tensor that stays, and of one on the meta device that would move: these hooks hide the
        # checkpoints' inputs from any outer saved-tensor hooks, so the planner, which counts with one, passes its own.
        self.keep: Callable[[torch.Tensor], torch.Tensor] = _unchanged
        self.count: Callable[[torch.Tensor], torch.Tensor] = _unchanged
        self._streams: dict[torch.device, Any] = {}
        self._packed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # moved, alive

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @contextlib.contextmanager
    def observed(
        self, keep: Callable[[torch.Tensor], torch.Tensor], count: Callable[[torch.Tensor], torch.Tensor]
    ) -> Iterator[None]:
        """Within the block, tensors that stay go through ``keep`` and meta tensors that would move through
        ``count`` (the memory planner's counting hooks)."""
        self.keep, self.count = keep, count
        try:
            yield
        finally:
            self.keep = self.count = _unchanged

    def pack(self, t: torch.Tensor) -> Any:
        size = t.numel() * t.element_size()
        if size < self.min_bytes or t.device.type not in (*self.copy_devices, "meta") or self._packed.get(id(t)) is t:
            # A tensor handed to several blocks (SDXL's text embeddings go to all 70 transformer blocks) is alive
            # elsewhere: moving it again frees nothing, and each copy would come back in the backward.
            return self.keep(t)
        self._packed[id(t)] = t
        self.moved_bytes += size
        if t.device.type == "meta":
            return self.count(t)
        if t.device.type != "cuda":
            return t.detach().clone()
        stream = self._stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        host = torch.empty_like(t, device="cpu", pin_memory=True)  # same strides: the recompute runs the same kernels
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        t.record_stream(stream)  # the allocator must not hand t's memory out before the copy has read it
        return host, done, t.device

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, done, device = packed
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


def checkpoint_function(offloader: InputOffloader | None = None) -> Any:
    """A ``gradient_checkpointing_func`` for diffusers' ``enable_gradient_checkpointing``: non-reentrant
    ``torch.utils.checkpoint``, its saved inputs through ``offloader`` when given.

    Keyword arguments are handed to the checkpoint as positional ones: it saves only those (and holds keyword
    tensors in a closure, out of the offloader's reach).
    """

    def run(module: Any, *args: Any, **kwargs: Any) -> Any:
        names = list(kwargs)

        def call(*inputs: Any) -> Any:
            split = len(inputs) - len(names)
            return module(*inputs[:split], **dict(zip(names, inputs[split:], strict=True)))

        with offloader.hooks() if offloader is not None else contextlib.nullcontext():
            return torch.utils.checkpoint.checkpoint(call, *args, *kwargs.values(), use_reentrant=False)

    return run


def ensure_recomputed(denoiser: nn.Module, *blocks: nn.Module) -> None:
    """Make ``blocks`` recompute their activations in the backward pass, unless the model's checkpointing already does
    (their inputs go through the model's :class:`InputOffloader`, if it has one). The model is asked once (diffusers'
    ``is_gradient_checkpointing`` walks all its modules)."""
    if getattr(denoiser, "is_gradient_checkpointing", False):
        return
    for block in blocks:
        if not getattr(block.forward, "recomputed", False):
            block.forward = recomputed(block.forward, getattr(denoiser, "_lora_input_offloader", None))  # type: ignore[method-assign]


def recomputed(forward: Any, offloader: InputOffloader | None = None) -> Any:
    """``forward`` under non-reentrant ``torch.utils.checkpoint`` when gradients are on (marked ``recomputed``)."""
    checkpoint = checkpoint_function(offloader)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, **kwargs)

    run.recomputed = True  # type: ignore[attr-defined]
    return run
