"""Data: image folders -> latent cache -> batches, as the frozen :class:`DataRecipe` of the ``data:`` options says.

Imports are lazy, so the pure decoding module (:mod:`lightning_lora.data.images`) loads without torch or Lightning
(DataLoader workers and the memory test import it alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_lora.data.cache import LatentCache
    from lightning_lora.data.datamodule import LatentDataModule
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.data.sources import ImageFolder

__all__ = ["DataRecipe", "ImageFolder", "LatentCache", "LatentDataModule"]

_WHERE = {
    "DataRecipe": "lightning_lora.data.recipe",
    "ImageFolder": "lightning_lora.data.sources",
    "LatentCache": "lightning_lora.data.cache",
    "LatentDataModule": "lightning_lora.data.datamodule",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
