"""The quantization options of the frozen base, and the layers they apply to."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

__all__ = ["QuantOptions", "linear_layers"]


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
