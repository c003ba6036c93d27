"""The quantization options of the frozen base, and the one function that applies them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from lightning_lora.errors import ConfigError

__all__ = ["QuantOptions", "quantize_base", "linear_layers"]


@dataclass
class QuantOptions:
    """How the frozen base's linear layers are stored.

    Args:
        mode: ``none`` (``model.base_dtype``), ``nf4`` (bitsandbytes 4-bit, QLoRA: about a quarter of bf16),
            ``fp8`` (float8 weights + per-channel scale, dequantized per matmul: half of bf16, any GPU), or
            ``fp8_compute`` (FP8 weights multiplied in FP8 with ``torch._scaled_mm``: needs compute capability 8.9+
            (RTX 40xx, L4, H100, H200) or an MI300; elsewhere it falls back to ``fp8`` with a warning).
        double_quant: NF4 only: quantize the quantization constants too (saves ~0.4 bit per weight).
        upcast_small_params: NF4 only: keep the parameters that stay unquantized (norms, embeddings, the biases of
            unquantized layers) in float32, as peft's ``prepare_model_for_kbit_training`` does. The biases of NF4
            layers stay in the compute dtype, where bitsandbytes computes them.
        skip: regular expressions of module names to leave unquantized.
    """

    mode: Literal["none", "nf4", "fp8", "fp8_compute"] = "none"
    double_quant: bool = True
    upcast_small_params: bool = True
    skip: list[str] = field(default_factory=list)


def linear_layers(model: nn.Module, skip: list[str]) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """``(parent, child name, full name, layer)`` for every plain ``nn.Linear`` not matched by ``skip``."""
    patterns = [re.compile(p) for p in skip]
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and not any(p.fullmatch(full) or p.search(full) for p in patterns):
                found.append((parent, name, full, child))
    return found


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
    for pattern in options.skip:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"model.quantization.skip: {pattern!r} is not a regular expression ({e}).") from e
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
