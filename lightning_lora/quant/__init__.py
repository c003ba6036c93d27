"""Quantized storage (and compute) for the frozen base, applied before LoRA injection.

* :mod:`lightning_lora.quant.nf4`: bitsandbytes NF4 (QLoRA): 4-bit weights, dequantized per matmul.
* :mod:`lightning_lora.quant.fp8`: float8_e4m3fn weights with a per-channel scale; dequantized per matmul
  ("storage"), or multiplied in FP8 with ``torch._scaled_mm`` ("compute").

Why before LoRA: peft's adapters are ``nn.Linear`` too, so a quantizer that runs afterwards (Lightning's
``BitsandbytesPrecision``) would quantize the adapters. Here the base layers are swapped first; peft then wraps the
quantized layers and the adapters stay float32.
"""

from lightning_lora.quant.options import QuantOptions, quantize_base

__all__ = ["QuantOptions", "quantize_base"]
