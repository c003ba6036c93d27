"""Quantized storage (and compute) for the frozen base, applied before LoRA injection.

* :mod:`lightning_lora.quant.nf4`: bitsandbytes NF4 (QLoRA): 4-bit weights, dequantized per matmul.
* :mod:`lightning_lora.quant.fp8`: float8_e4m3fn weights with a per-channel scale; dequantized per matmul
  ("storage"), or multiplied in FP8 with ``torch._scaled_mm`` ("compute").

Why before LoRA: peft's adapters are ``nn.Linear`` too, so a quantizer that runs afterwards (Lightning's
``BitsandbytesPrecision``) would quantize the adapters. Here the base layers are swapped first; peft then wraps the
quantized layers and the adapters stay float32.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_lora.quant.options import QuantOptions

__all__ = ["QuantOptions", "quantize_base"]


def quantize_base(
    model: nn.Module,
    options: QuantOptions,
    device: torch.device,
    compute_dtype: torch.dtype,
    on_cpu: frozenset[int] = frozenset(),
) -> int:
    """Swap the base's linear layers for quantized ones on ``device``; returns how many were swapped.

    FP8 layers whose ``id`` is in ``on_cpu`` are quantized on the CPU instead (the blocks ``model.offload_blocks``
    keeps in CPU memory: the GPU never holds them whole).
    """
    if options.mode == "none":
        return 0
    if options.mode == "nf4":
        from lightning_lora.quant.nf4 import quantize_nf4

        return quantize_nf4(model, options, device, compute_dtype)
    from lightning_lora.hardware import fp8_compute_supported
    from lightning_lora.quant.fp8 import quantize_fp8

    compute = options.mode == "fp8_compute"
    if compute:
        supported, reason = fp8_compute_supported(device)
        if not supported:
            import warnings

            warnings.warn(
                f"model.quantization.mode: fp8_compute needs FP8 matrix units ({reason}); using fp8 storage "
                "instead (same memory, bf16 matmuls).",
                stacklevel=2,
            )
            compute = False
    return quantize_fp8(model, options, device, compute=compute, on_cpu=on_cpu)
