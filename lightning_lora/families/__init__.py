"""Model families behind one interface; see :mod:`lightning_lora.families.base`."""

from lightning_lora.families.base import FAMILIES, DiffusionFamily, ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.families.flux2 import Flux2
from lightning_lora.families.krea2 import Krea2
from lightning_lora.families.qwenimage import QwenImage
from lightning_lora.families.sd15 import SD15
from lightning_lora.families.sdxl import SDXL
from lightning_lora.families.zimage import ZImage

__all__ = [
    "FAMILIES",
    "SD15",
    "SDXL",
    "DiffusionFamily",
    "Flux",
    "Flux2",
    "Krea2",
    "ModelSource",
    "QwenImage",
    "ZImage",
]
