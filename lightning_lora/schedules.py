"""Learning-rate schedules sized in optimizer steps.

Lightning's default interval for a scheduler is an *epoch*; LoRA runs are measured in steps, so the module always
steps these per optimizer step. Their length comes from the config (``total_steps``, normally ``trainer.max_steps``)
rather than from ``trainer.estimated_stepping_batches``: reading that inside ``configure_optimizers`` triggers a
Lightning bug (LT#20550) that skips restoring the dataloader's position on resume.

Each is a ``LambdaLR`` whose factor is a pure function of the step and of the settings it keeps as attributes
(``total_steps``, ``warmup_steps``, ``min_factor``). A resumed run with the same settings continues the curve exactly; a
resume that changes a setting (most often a longer ``trainer.max_steps``) continues at the same step on the new curve
(:func:`lightning_lora.checkpoint.reconcile_training_state`). :meth:`describe` says in one line what the schedule does.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["ConstantWithWarmup", "CosineWithWarmup", "warmup_cosine_factor"]


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int | None, min_factor: float = 0.0) -> float:
    """Linear warm-up from ~0 to 1 over ``warmup_steps``, then cosine decay to ``min_factor`` at ``total_steps``.

    With ``total_steps`` None the factor stays 1 after warm-up (a constant schedule).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps is None:
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


class ConstantWithWarmup(LambdaLR):
    """Constant learning rate after a linear warm-up.

    Args:
        optimizer: injected by the module.
        warmup_steps: optimizer steps of linear warm-up.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0) -> None:
        _check(warmup_steps=warmup_steps)
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, lambda step: warmup_cosine_factor(step, self.warmup_steps, None))

    def describe(self) -> str:
        warmup = f"linear warm-up over {self.warmup_steps} steps, then " if self.warmup_steps else ""
        return f"{warmup}constant"


class CosineWithWarmup(LambdaLR):
    """Linear warm-up, then cosine decay to ``min_factor`` times the base learning rate.

    Args:
        optimizer: injected by the module.
        total_steps: the length of the schedule in optimizer steps; null means ``trainer.max_steps``.
        warmup_steps: optimizer steps of linear warm-up.
        min_factor: the final learning rate as a fraction of the base.
    """

    def __init__(
        self, optimizer: Optimizer, total_steps: int | None = None, warmup_steps: int = 0, min_factor: float = 0.0
    ) -> None:
        _check(total_steps=total_steps, warmup_steps=warmup_steps)
        if not 0.0 <= min_factor <= 1.0:
            raise ValueError(f"min_factor {min_factor} must be between 0 and 1")
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.min_factor = min_factor
        # Read the attributes at each step: the module fills total_steps in from trainer.max_steps when it is None.
        super().__init__(
            optimizer,
            lambda step: warmup_cosine_factor(step, self.warmup_steps, self.total_steps, self.min_factor),
        )

    def describe(self) -> str:
        warmup = f"linear warm-up over {self.warmup_steps} steps, then " if self.warmup_steps else ""
        end = f"{self.min_factor:g} x the base rate" if self.min_factor else "0"
        return f"{warmup}cosine decay to {end} at step {self.total_steps}"


def _check(**steps: int | None) -> None:
    for name, value in steps.items():
        if value is not None and value < 0:
            raise ValueError(f"{name} {value} must be 0 or more")
