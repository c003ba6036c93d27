"""lightning-lora: a Lightning trainer for LoRA adapters on diffusion models (FLUX.1, FLUX.2, SDXL, SD1.5, Z-Image,
Qwen-Image, Krea 2, Chroma).

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
    "Preservation": "lightning_lora.objectives",
    "BF16": "lightning_lora.precision",
    "FP8": "lightning_lora.precision",
    "FP8Compute": "lightning_lora.precision",
    "NF4": "lightning_lora.precision",
    "LatentDataModule": "lightning_lora.data.datamodule",
    "SampleImages": "lightning_lora.callbacks",
    "FixedEvalLoss": "lightning_lora.callbacks",
    "LoraExport": "lightning_lora.callbacks",
    "LoraEMA": "lightning_lora.callbacks",
    "VRAMMonitor": "lightning_lora.callbacks",
    "export_lora": "lightning_lora.export",
    "checkpoint_lora": "lightning_lora.export",
    "plan_training": "lightning_lora.plan",
}
"""Public name -> the module that defines it. The model families are public too, by their class names, as the family
registry (:data:`lightning_lora.families.FAMILIES`) lists them: asked for only when one of them (or ``__all__``) is."""


def _families() -> dict[str, type]:
    from lightning_lora.families import FAMILIES

    return {cls.__name__: cls for cls in FAMILIES.values()}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name == "__all__":  # made on demand: the families' names come from their registry, which imports torch
        return ["__version__", *_PUBLIC, *_families()]
    if not name.startswith("_") and name in (families := _families()):
        return families[name]
    raise AttributeError(f"module 'lightning_lora' has no attribute {name!r}")
