"""lightning-lora: a Lightning trainer for LoRA adapters on diffusion models (FLUX.1-dev, SDXL, SD1.5).

The public surface is small: the LightningModule, the DataModule, the callbacks, and the export function.
Everything is wired together by the ``lightning-lora`` command (``lightning_lora.cli``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
