"""Adafactor stepped many tensors at a time: the same update as transformers' Adafactor in a few hundred kernels.

transformers' ``Adafactor`` (the optimizer of the public SDXL LoRA benchmarks) updates one tensor at a time with
~25 small kernels each: a rank-32 attention LoRA on the SDXL UNet has 1,120 tensors, so ~29,000 kernel launches
per step, more than the UNet's forward and backward together, and the step is bound by launching them. LoRA
tensors come in a handful of shapes, so this subclass stacks the tensors of one shape (and step count) and updates
them together: the same arithmetic, the same state entries (checkpoints load in either class), a few dozen
kernels per shape.

The grouped path covers the fixed-learning-rate settings (``relative_step=False, scale_parameter=False``, the kohya
ones), with or without ``beta1`` and weight decay, on float32 parameters; any other setting steps through
transformers' own code unchanged.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.optimization import Adafactor as _HFAdafactor

__all__ = ["Adafactor"]

#: At most this many elements are stacked at once: 16 MiB per stacked float32 tensor, so the step's transient memory
#: stays under ~100 MiB (with checkpointing, a LoRA step's peak can be in the optimizer step) for a few more launches.
MAX_STACKED_ELEMENTS = 1 << 22


class Adafactor(_HFAdafactor):
    """transformers' ``Adafactor`` with a multi-tensor step for fixed learning rates.

    Takes transformers' arguments (e.g. ``lr=1e-4, scale_parameter=False, relative_step=False,
    warmup_init=False``); see ``transformers.optimization.Adafactor``.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:  # first: under Lightning the closure computes the gradients looked at below
            with torch.enable_grad():
                loss = closure()
        if not all(self._groupable(group) for group in self.param_groups):
            hf_step = _HFAdafactor.step  # torch wraps it with the optimizer hooks once an instance exists: ours ran
            step: Any = hf_step
            (step.__wrapped__ if getattr(step, "hooked", False) else step)(self)
            return loss
        for group in self.param_groups:
            for params in self._buckets(group):
                self._step_bucket(group, params)
        return loss

    def _groupable(self, group: dict[str, Any]) -> bool:
        if group["relative_step"] or group["scale_parameter"]:
            return False
        return all(p.dtype == torch.float32 and not p.grad.is_sparse for p in group["params"] if p.grad is not None)

    def _buckets(self, group: dict[str, Any]) -> Iterator[list[torch.Tensor]]:
        """The parameters with gradients, by (shape, step count), in chunks of at most ``MAX_STACKED_ELEMENTS``."""
        by_key: dict[tuple[Any, ...], list[torch.Tensor]] = defaultdict(list)
        for p in group["params"]:
            if p.grad is not None:  # a scalar alone: a stack of scalars would share one update RMS
                by_key[(p.shape, p.device, self.state[p].get("step", 0), id(p) if p.dim() == 0 else 0)].append(p)
        for params in by_key.values():
            per_chunk = max(1, MAX_STACKED_ELEMENTS // max(1, params[0].numel()))
            for start in range(0, len(params), per_chunk):
                yield params[start : start + per_chunk]

    def _state(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, created the way transformers creates it."""
        state = self.state[p]
        if not state:
            factored, first_moment = self._get_options(group, p.shape)
            state["step"] = 0
            if first_moment:
                state["exp_avg"] = torch.zeros_like(p)
            if factored:
                state["exp_avg_sq_row"] = p.new_zeros(p.shape[:-1])
                state["exp_avg_sq_col"] = p.new_zeros(p.shape[:-2] + p.shape[-1:])
            else:
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["RMS"] = 0  # only read with scale_parameter, which steps through transformers' code
        return state

    def _step_bucket(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self._state(group, p) for p in params]
        factored, first_moment = self._get_options(group, params[0].shape)
        step = states[0]["step"] + 1
        for state in states:
            state["step"] = step
        lr = group["lr"]
        beta2t = 1.0 - math.pow(step, group["decay_rate"])
        grads = torch.stack([p.grad for p in params if p.grad is not None]).float()  # _groupable: every p has one
        update = grads.square().add_(group["eps"][0])
        if factored:
            rows = [s["exp_avg_sq_row"] for s in states]
            cols = [s["exp_avg_sq_col"] for s in states]
            row = torch.stack(rows).mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
            col = torch.stack(cols).mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
            torch._foreach_copy_(rows, list(row.unbind(0)))
            torch._foreach_copy_(cols, list(col.unbind(0)))
            update = self._approx_sq_grad(row, col).mul_(grads)
        else:
            squares = [s["exp_avg_sq"] for s in states]
            square = torch.stack(squares).mul_(beta2t).add_(update, alpha=1.0 - beta2t)
            torch._foreach_copy_(squares, list(square.unbind(0)))
            update = square.rsqrt().mul_(grads)
        per_tensor = (-1,) + (1,) * (update.dim() - 1)
        rms = torch.linalg.vector_norm(update, dim=tuple(range(1, update.dim()))) / math.sqrt(params[0].numel())
        update.div_((rms / group["clip_threshold"]).clamp_(min=1.0).view(per_tensor))
        update.mul_(lr)
        if first_moment:
            moments = [s["exp_avg"] for s in states]
            moment = torch.stack(moments).mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
            torch._foreach_copy_(moments, list(moment.unbind(0)))
            update = moment
        if group["weight_decay"] != 0:
            torch._foreach_add_(params, params, alpha=-group["weight_decay"] * lr)
        torch._foreach_sub_(params, list(update.unbind(0)))
