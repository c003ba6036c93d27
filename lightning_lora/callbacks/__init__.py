"""Callbacks: sample images, fixed evaluation loss, LoRA export."""

from lightning_lora.callbacks.evaluation import FixedEvalLoss
from lightning_lora.callbacks.lora_export import LoraExport
from lightning_lora.callbacks.samples import SampleImages

__all__ = ["FixedEvalLoss", "LoraExport", "SampleImages"]
