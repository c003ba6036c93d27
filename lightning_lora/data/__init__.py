"""Data: image folders -> latent cache -> batches."""

from lightning_lora.data.cache import LatentCache
from lightning_lora.data.datamodule import LatentDataModule

__all__ = ["LatentCache", "LatentDataModule"]
