"""Write the LoRA file (diffusers format, safetensors) at the end of training and, optionally, every N steps.

Files go to ``<run folder>/lora/``: ``<name>.safetensors`` at the end, ``<name>-step000500.safetensors`` for the
intermediate ones. Only global rank 0 writes; writes are atomic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lora.export import save_lora
from lightning_lora.module import DTYPES

__all__ = ["LoraExport"]


class LoraExport(Callback):
    """Export the trained LoRA.

    Args:
        name: file name stem.
        every_n_steps: also export every this many optimizer steps (0: only at the end).
        dtype: tensor dtype in the file (``fp32`` keeps full precision; ``bf16`` halves the size).
        dirname: folder under the run folder.
    """

    def __init__(
        self,
        name: str = "lora",
        every_n_steps: int = 0,
        dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        dirname: str = "lora",
    ) -> None:
        self.name = name
        self.every_n_steps = every_n_steps
        self.dtype = dtype
        self.dirname = dirname
        self.last_path: Path | None = None

    def export(self, trainer: Trainer, pl_module: LightningModule, path: Path) -> None:
        module: Any = pl_module
        if trainer.is_global_zero:
            info = {
                "family": module.family.name,
                "base_model": module.source.pretrained,
                "denoiser_file": Path(module.source.denoiser_file).name if module.source.denoiser_file else "",
                "steps": trainer.global_step,
                "resolution": getattr(trainer.datamodule, "resolution", 0),  # type: ignore[attr-defined]
            }
            save_lora(
                module.denoiser,
                path,
                prefix=module.family.denoiser_subfolder,
                info=info,
                dtype=DTYPES[self.dtype],
            )
            self.last_path = path
        trainer.strategy.barrier("LoraExport")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0:
            folder = Path(trainer.default_root_dir) / self.dirname
            path = folder / f"{self.name}-step{step:06d}.safetensors"
            if path != self.last_path:
                self.export(trainer, pl_module, path)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        path = Path(trainer.default_root_dir) / self.dirname / f"{self.name}.safetensors"
        self.export(trainer, pl_module, path)
        rank_zero_info(f"LoRA written to {path} (step {trainer.global_step})")
