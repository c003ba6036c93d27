"""A fixed evaluation loss: the same images, timesteps and noise every time, so the curve is comparable.

The training loss of a diffusion model is very noisy (each step draws a new timestep and new noise), which makes it
a poor signal of progress. This callback evaluates the loss at (timestep, noise) pairs drawn from a generator seeded
the same way every time, before training, every N steps and at the end:

* ``eval/loss`` on the first few training images (``data.eval_samples``): is the LoRA learning?
* ``val/loss`` on the held-out images (``data.val_images`` / ``data.val_fraction``), when there are any: is it
  still generalising, or memorising the training set?

It draws from its own generator, never the global RNG, so observing a run does not change it.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lora.data.datamodule import LatentDataModule
from lightning_lora.model.assembly import uncompiled
from lightning_lora.module import lora_module

__all__ = ["FixedEvalLoss"]


class FixedEvalLoss(Callback):
    """Log ``eval/loss`` on fixed (image, timestep, noise) triples.

    Args:
        every_n_steps: evaluate every this many optimizer steps (0: only before and after training).
        seed: seed of the (timestep, noise) draws.
    """

    def __init__(self, every_n_steps: int = 0, seed: int = 1234) -> None:
        self.every_n_steps = every_n_steps
        self.seed = seed
        self.history: list[tuple[int, float]] = []
        self.val_history: list[tuple[int, float]] = []

    @torch.no_grad()
    def _mean_loss(self, trainer: Trainer, pl_module: LightningModule, loader: Any) -> float:
        module = lora_module(pl_module, "FixedEvalLoss")
        denoiser = module.denoiser
        assert denoiser is not None  # built in configure_model, before training starts
        generator = torch.Generator().manual_seed(self.seed)
        was_training = denoiser.training
        denoiser.eval()
        total, count = 0.0, 0
        try:
            with trainer.precision_plugin.forward_context(), uncompiled():  # no graphs of their own for a few batches
                for batch in loader:
                    batch = {k: v.to(pl_module.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                    losses = module.fixed_loss(batch, generator)
                    total += float(losses.sum())
                    count += losses.numel()
        finally:
            denoiser.train(was_training)
        return total / max(count, 1)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> float:
        """Log ``eval/loss`` (and ``val/loss`` when the data has held-out images); return ``eval/loss``."""
        datamodule = trainer.datamodule  # type: ignore[attr-defined]
        if not isinstance(datamodule, LatentDataModule):
            raise TypeError(f"FixedEvalLoss reads a LatentDataModule's fixed loaders, not {type(datamodule).__name__}")
        step = trainer.global_step
        value = self._mean_loss(trainer, pl_module, datamodule.eval_dataloader())
        self.history.append((step, value))
        metrics = {"eval/loss": value}
        val_loader = datamodule.val_dataloader_fixed()
        if val_loader is not None:
            metrics["val/loss"] = self._mean_loss(trainer, pl_module, val_loader)
            self.val_history.append((step, metrics["val/loss"]))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        return value

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.evaluate(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps > 0 and step % self.every_n_steps == 0 and self.history[-1][0] != step:
            self.evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.history or self.history[-1][0] != trainer.global_step:
            self.evaluate(trainer, pl_module)
        (s0, first), (s1, last) = self.history[0], self.history[-1]
        rank_zero_info(f"Fixed evaluation loss: {first:.4f} at step {s0} -> {last:.4f} at step {s1}")
        if self.val_history:
            (s0, first), (s1, last) = self.val_history[0], self.val_history[-1]
            rank_zero_info(f"Held-out validation loss: {first:.4f} at step {s0} -> {last:.4f} at step {s1}")
