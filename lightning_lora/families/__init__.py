"""Model families behind one interface; see :mod:`lightning_lora.families.base`."""

from lightning_lora.families.base import FAMILIES, DiffusionFamily, ModelSource
from lightning_lora.families.flux import Flux

__all__ = ["FAMILIES", "DiffusionFamily", "Flux", "ModelSource"]
