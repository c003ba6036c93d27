"""Write the LoRA file(s) at the end of training and, optionally, every N steps.

Files go to ``<run folder>/lora/``: ``<name>.safetensors`` at the end, ``<name>-step000500.safetensors`` for the
intermediate ones, in each of the chosen formats (``diffusers``: loads with diffusers' ``load_lora_weights``;
``kohya``: ``<name>.kohya.safetensors``, loads in ComfyUI, Forge and kohya's scripts). Only global rank 0 writes;
writes are atomic.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lora.errors import ConfigError
from lightning_lora.export import save_lora
from lightning_lora.formats import LoraFormat
from lightning_lora.module import DTYPES

__all__ = ["LoraExport"]

_SUFFIX = {"diffusers": ".safetensors", "kohya": ".kohya.safetensors"}


class LoraExport(Callback):
    """Export the trained LoRA.

    Args:
        name: file name stem.
        every_n_steps: also export every this many optimizer steps (0: only at the end).
        formats: ``diffusers`` and/or ``kohya`` (ComfyUI / Forge / sd-scripts key layout); each must be one the
            model's family writes (checked at setup, before training).
        dtype: tensor dtype in the file (``fp32`` keeps full precision; ``bf16`` halves the size).
        trigger: the trigger word, recorded in the file's metadata.
        dirname: folder under the run folder.
    """

    def __init__(
        self,
        name: str = "lora",
        every_n_steps: int = 0,
        formats: list[LoraFormat] | None = None,
        dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        trigger: str | None = None,
        dirname: str = "lora",
    ) -> None:
        self.name = name
        self.every_n_steps = every_n_steps
        self.formats = list(formats or ["diffusers"])
        self.dtype = dtype
        self.trigger = trigger
        self.dirname = dirname
        self.last_path: Path | None = None
        self.written: list[Path] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse a format the model's family does not write now, not after training."""
        family = getattr(pl_module, "family", None)
        missing = [f for f in self.formats if family is not None and f not in family.lora_formats]
        if family is not None and missing:
            raise ConfigError(
                f"LoraExport.formats: there is no {missing[0]} layout for the {family.name!r} family yet; choose from "
                f"{', '.join(family.lora_formats)}."
            )

    def paths(self, trainer: Trainer, stem: str) -> dict[str, Path]:
        folder = Path(trainer.default_root_dir) / self.dirname
        return {fmt: folder / f"{stem}{_SUFFIX[fmt]}" for fmt in self.formats}

    def export(self, trainer: Trainer, pl_module: LightningModule, stem: str) -> None:
        module: Any = pl_module
        if trainer.is_global_zero:
            info = {
                "family": module.family.name,
                "base_model": module.source.pretrained,
                "denoiser_file": Path(module.source.denoiser_file).name if module.source.denoiser_file else "",
                "steps": trainer.global_step,
                "resolution": getattr(trainer.datamodule, "resolution", 0),  # type: ignore[attr-defined]
                "trigger": self.trigger or "",
                "config_sha256": _config_hash(
                    Path(trainer.default_root_dir) / "config.yaml"
                ),  # no log_dir: it broadcasts
            }
            for fmt, path in self.paths(trainer, stem).items():
                save_lora(
                    module.denoiser,
                    path,
                    family=module.family,
                    lora=module.lora,
                    info=info,
                    format=fmt,  # type: ignore[arg-type]
                    dtype=DTYPES[self.dtype],
                )
                self.written.append(path)
                if fmt == self.formats[0]:
                    self.last_path = path
        trainer.strategy.barrier("LoraExport")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0:
            stem = f"{self.name}-step{step:06d}"
            if not self.written or self.written[-1].name != next(iter(self.paths(trainer, stem).values())).name:
                self.export(trainer, pl_module, stem)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.export(trainer, pl_module, self.name)
        rank_zero_info(f"LoRA written to {self.last_path} (step {trainer.global_step})")


def _config_hash(config: Path) -> str:
    """A short hash of the run's resolved config.yaml: which settings produced this file."""
    return hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else ""
