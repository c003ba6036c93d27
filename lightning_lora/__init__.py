"""lightning-lora: a Lightning trainer for LoRA adapters on diffusion models (FLUX.1, FLUX.2, SDXL, SD1.5, Z-Image,
Qwen-Image).

The public surface is small: the LightningModule, the DataModule, the model families, the callbacks, the export
and planning functions. Everything is wired together by the ``lightning-lora`` command (``lightning_lora.cli``).
Names are imported lazily, so ``import lightning_lora`` stays cheap (torch, diffusers and Lightning load on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "LoraModule": "lightning_lora.module",
    "LoraOptions": "lightning_lora.lora",
    "BF16": "lightning_lora.precision",
    "FP8": "lightning_lora.precision",
    "FP8Compute": "lightning_lora.precision",
    "NF4": "lightning_lora.precision",
    "LatentDataModule": "lightning_lora.data.datamodule",
    "Flux": "lightning_lora.families",
    "SDXL": "lightning_lora.families",
    "SD15": "lightning_lora.families",
    "SampleImages": "lightning_lora.callbacks",
    "FixedEvalLoss": "lightning_lora.callbacks",
    "LoraExport": "lightning_lora.callbacks",
    "VRAMMonitor": "lightning_lora.callbacks",
    "export_lora": "lightning_lora.export",
    "checkpoint_lora": "lightning_lora.export",
    "plan_training": "lightning_lora.plan",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'lightning_lora' has no attribute {name!r}")
