"""FP8 base weights: half the memory of bf16 ("storage"), and optionally FP8 matmuls ("compute").

Both store each frozen weight ``W [out, in]`` as ``float8_e4m3fn`` with one float32 scale per output channel
(``s[o] = max|W[o, :]| / 448``, 448 being e4m3's largest value), so ``W ~ s[:, None] * W8``. On an MI300 the format
is ``float8_e4m3fnuz`` (largest value 240), the one its matrix units multiply
(:func:`lightning_lora.hardware.fp8_dtype`); activations and gradients are quantized in the weight's format. e4m3
keeps 3 mantissa bits: about 4% relative error per element, which a frozen, pretrained weight tolerates well in
practice (musubi-tuner and SimpleTuner ship the same idea).

**Storage** dequantizes ``W8`` to bf16 inside the matmul and multiplies in bf16. Any GPU (and the CPU) can do it. A
custom autograd function keeps only ``W8`` for the backward pass and dequantizes again there; plain autograd would keep
the bf16 copy of every layer alive until the backward, which is the bf16 model again.

**Compute** multiplies in FP8 with ``torch._scaled_mm`` and row-wise scales, on FP8 matrix units (compute capability
8.9+: RTX 40xx, L4, H100/H200; AMD MI300 / gfx94x+; :func:`lightning_lora.hardware.fp8_compute_supported`):

* forward ``y = x W^T``: ``x`` is quantized per row (token), ``W8`` per output channel, and
  ``_scaled_mm(x8, W8^T, s_x, s_W)`` applies both scales in the epilogue;
* input gradient ``gx = gy W``: the contraction now runs over ``out``, where ``W``'s scale lives, so the scale is
  folded into ``gy`` first (``gy * s_W``), then ``gy`` is quantized per row and multiplied with ``W8`` (no weight
  scale left). The weight gradient is never needed: the base is frozen, and the LoRA path runs in bf16 beside it.

Quantizing the activations is a separate pass over memory (max, divide, cast). Done as separate eager kernels it
costs more than FP8 saves (measured 0.72x of bf16 on FLUX shapes); fused by ``torch.compile`` into one kernel it
gives 1.30x, and the matmul alone 1.66x (an H200, torch 2.11, FLUX linear shapes; our whole-step figures are in
BENCHMARKS.md). So the quantizer is compiled on CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_lora.hardware import fp8_compute_supported, fp8_dtype
from lightning_lora.precision.layers import linear_layers

__all__ = ["FP8Linear", "fp8_compute_supported", "quantize_fp8", "quantize_rowwise"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rowwise(t: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [rows, cols]`` -> (``t8``, ``scale [rows, 1]`` float32) with ``t ~ scale * t8``.

    ``t8`` is row-major whatever ``t``'s layout, as ``torch._scaled_mm`` (cuBLASLt) needs its first operand: a
    column-major view (SDXL's ``proj_in`` input, an output gradient) is laid out row-major in the same pass.
    """
    amax = t.abs().amax(dim=1, keepdim=True).float()
    scale = amax.clamp(min=1e-12) / torch.finfo(dtype).max
    return (t.float() / scale).to(dtype).contiguous(), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W8 [out, in]`` and ``scale [out]`` -> ``W`` in ``dtype``."""
    return w8.to(dtype) * scale.to(dtype)[:, None]


def quantize_scaled_rowwise(
    t: torch.Tensor, column_scale: torch.Tensor, dtype: torch.dtype = E4M3
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rowwise` of ``t * column_scale[None, :]`` (the input gradient's pre-scaling), in one pass."""
    return quantize_rowwise(t.float() * column_scale[None, :], dtype)


@functools.lru_cache(maxsize=8)
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=True)


def _fused(fn: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """``fn`` as one fused kernel on CUDA in eager mode (one pass over memory instead of three or four). Inside a
    compiled region (``model.compile_blocks``) the plain function, which the region's compiler fuses with its
    neighbours; a nested compiled function would be its own kernel there. Eager elsewhere."""
    if device_type == "cuda" and not torch.compiler.is_compiling():
        return _compiled(fn)
    return fn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


class _StorageMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(w8, scale)
        ctx.dtype = dtype
        w = _fused(dequantize, x.device.type)(w8, scale, dtype)
        return x.to(dtype) @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        w8, scale = ctx.saved_tensors
        w = _fused(dequantize, grad.device.type)(w8, scale, ctx.dtype)
        return grad.to(ctx.dtype) @ w, None, None, None


class _ScaledMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        quantize = _fused(quantize_rowwise, x.device.type)
        shape = x.shape
        x8, x_scale = quantize(x.reshape(-1, shape[-1]), w8.dtype)
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=dtype)
        ctx.save_for_backward(w8, scale)
        ctx.dtype = dtype
        return y.reshape(*shape[:-1], w8.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        w8, scale = ctx.saved_tensors
        shape = grad.shape
        g8, g_scale = _fused(quantize_scaled_rowwise, grad.device.type)(grad.reshape(-1, shape[-1]), scale, w8.dtype)
        # _scaled_mm wants its second operand column-major: a transposed copy of W8 (1 byte per weight, transient).
        w8_cm = w8.t().contiguous().t()
        ones = torch.ones(1, w8.shape[1], device=grad.device, dtype=torch.float32)
        gx = torch._scaled_mm(g8, w8_cm, scale_a=g_scale, scale_b=ones, out_dtype=ctx.dtype)
        return gx.reshape(*shape[:-1], w8.shape[1]), None, None, None


class FP8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is stored as float8 e4m3 with a per-output-channel scale.

    It stays an ``nn.Linear`` subclass so peft wraps it like any linear layer. ``weight`` (float8) and
    ``weight_scale`` are buffers, not parameters, so nothing mistakes them for trainable or float weights (optimizers,
    dtype probes). ``compute_dtype`` is what peft reads (as for bitsandbytes layers) to decide the adapter's dtype:
    float32, not the weight's float8.
    """

    weight_scale: torch.Tensor  # a buffer (registered in __init__)

    compute_dtype = torch.float32

    def __init__(self, linear: nn.Linear, compute: bool = False, dtype: torch.dtype = E4M3) -> None:
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.compute = compute
        w = linear.weight.data
        w8, scale = quantize_rowwise(w, dtype)
        self.register_buffer("weight", w8)
        self.register_buffer("weight_scale", scale.squeeze(1).contiguous())
        self.bias = linear.bias  # frozen with the rest of the base

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            dtype = torch.bfloat16
        if self.compute and x.device.type == "cuda" and dtype != torch.float32:
            y = _ScaledMatmul.apply(x, self.weight, self.weight_scale, dtype)
        else:
            y = _StorageMatmul.apply(x, self.weight, self.weight_scale, dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        mode = "compute" if self.compute else "storage"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={mode}"


def quantize_fp8(
    model: nn.Module, skip: list[str], device: torch.device, compute: bool, on_cpu: frozenset[int] = frozenset()
) -> int:
    """Swap every linear layer of ``model`` (but those ``skip`` matches) for an :class:`FP8Linear` in the FP8 format of
    ``device`` (:func:`~lightning_lora.hardware.fp8_dtype`), quantized on ``device`` (on the CPU for the layers whose
    ``id`` is in ``on_cpu``); returns how many were swapped."""
    dtype = fp8_dtype(device)
    count = 0
    for parent, name, _, linear in linear_layers(model, skip):
        linear.to(torch.device("cpu") if id(linear) in on_cpu else device)
        layer = FP8Linear(linear, compute=compute, dtype=dtype)
        setattr(parent, name, layer)
        del linear
        count += 1
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return count
