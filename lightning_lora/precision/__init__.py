"""The frozen base's format, as Lightning precision plugins (:mod:`lightning_lora.precision.plugins`):

* :class:`BF16`: unquantized, in bf16 (or fp16 / fp32: its ``dtype``);
* :class:`FP8`: float8 weights with a per-channel scale, dequantized per matmul (:mod:`lightning_lora.precision.fp8`);
* :class:`FP8Compute`: the same weights multiplied in FP8 on GPUs with FP8 matrix units;
* :class:`NF4`: bitsandbytes 4-bit NormalFloat, QLoRA (:mod:`lightning_lora.precision.nf4`).

Why the quantized formats replace the base's layers before LoRA is injected: peft's adapters are ``nn.Linear`` too,
so a quantizer that runs afterwards (Lightning's ``BitsandbytesPrecision``, which converts the module) would quantize
the adapters. Here the base layers are swapped first; peft then wraps the quantized layers and the adapters stay
float32.
"""

from lightning_lora.precision import plugins
from lightning_lora.precision.plugins import *  # noqa: F403 - the names of the plugins module, listed once (its __all__)

__all__ = plugins.__all__
