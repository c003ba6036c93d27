"""Recompute a block's activations in the backward pass (gradient checkpointing of one module, in place).

Wrapping ``block.forward`` (not replacing the module) keeps parameter names, and so LoRA keys, unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["ensure_recomputed", "recomputed"]


def ensure_recomputed(denoiser: nn.Module, block: nn.Module) -> None:
    """Make ``block`` recompute its activations in the backward pass, unless the model's checkpointing already does."""
    if getattr(denoiser, "is_gradient_checkpointing", False) or getattr(block.forward, "recomputed", False):
        return
    block.forward = recomputed(block.forward)  # type: ignore[method-assign]


def recomputed(forward: Any) -> Any:
    """``forward`` under non-reentrant ``torch.utils.checkpoint`` when gradients are on (marked ``recomputed``)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.recomputed = True  # type: ignore[attr-defined]
    return run
