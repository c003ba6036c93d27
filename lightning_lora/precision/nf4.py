"""NF4 (QLoRA) base weights through bitsandbytes.

Each frozen ``nn.Linear`` becomes a ``bnb.nn.Linear4bit``: weights in 4-bit NormalFloat with one absmax per block of
64 (itself quantized to 8 bits with ``double_quant``), about 0.53 bytes per weight instead of 2. The matmul
dequantizes to ``compute_dtype`` (bf16) on the fly, so a step costs more than bf16 but the 12B FLUX transformer fits in
about 6 GB. The layers are quantized directly on the training device, one at a time, so the full bf16 model never has
to fit there.

bitsandbytes quantizes in blocks of 64 along the input dimension; a layer whose ``in_features`` is not a multiple of 64
is left in the base dtype (real FLUX has none; tiny test models might). On the CPU (tests) bitsandbytes works in
train mode; its CPU inference fast path is switched off (see below).

Inside blocks compiled by ``model.compile_blocks`` the layers dequantize with torch operations instead of
bitsandbytes' kernels (:func:`nf4_linear`; ``NF4(compiled_dequantize=False)`` turns it off): the same weights, but
inductor fuses the dequantization into one kernel per layer and launches it from its generated code. Through
bitsandbytes each 4-bit matmul cost 172 µs of host time for 102 µs of GPU time, and ``flux_8gb``'s step was host-bound
(GPU busy 23%, 39,992 launches per step, on an H200). With the torch operations the same step made 30,264
launches, the GPU was busy 36-39%, and it took 1.81-1.91 s against 2.21-2.81 with bitsandbytes' kernels at the same
peak (6.65 GiB; BENCHMARKS.md, "What each option measured"); Qwen-Image's NF4 config compiled this way took 2.95 s
per step against 5.60 eager. Eager layers keep bitsandbytes' kernels (one launch where the torch operations would be
several).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.precision.layers import linear_layers

__all__ = ["nf4_weight", "quantize_nf4", "require_bitsandbytes"]


def nf4_weight(weight: Any, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[out, in]`` weight a bitsandbytes 4-bit ``Params4bit`` holds, in ``dtype``, from torch operations:
    two 4-bit code indices per byte (the first element in the high nibble), each the index of one of the 16 values of
    ``quant_state.code``, scaled by its block's absmax; with double quantization the absmaxes are themselves 8-bit
    indices into ``state2.code``, scaled per block of ``state2.blocksize`` and shifted by ``offset``."""
    state = weight.quant_state
    return _dequantize(weight, *_state_tensors(state), tuple(state.shape), state.blocksize, _blocksize2(state), dtype)


def _blocksize2(state: Any) -> int:
    return int(state.state2.blocksize) if state.nested else 0


def _state_tensors(state: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quant state's tensors, as :func:`_dequantize` takes them (the nested ones empty without double quant)."""
    if state.nested:
        offset = torch.as_tensor(state.offset, dtype=torch.float32, device=state.absmax.device)
        return state.absmax, state.code, state.state2.absmax, state.state2.code, offset
    none = state.absmax.new_empty(0)
    return state.absmax, state.code, none, none, none


def _dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    shape: tuple[int, ...],
    blocksize: int,
    blocksize2: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    n = shape[0] * shape[1]
    if blocksize2:  # double quantization: the per-block absmax is an 8-bit code itself
        blocks = absmax.numel()
        scale = absmax2.repeat_interleave(blocksize2)[:blocks]
        absmax = code2[absmax.long()] * scale + offset
    nibbles = packed.reshape(-1)
    indices = torch.stack((nibbles >> 4, nibbles & 0xF), dim=-1).reshape(-1)[:n]
    values = code[indices.long()].view(-1, blocksize) * absmax.float().view(-1, 1)
    return values.view(shape).to(dtype)


def nf4_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """What ``bnb.nn.Linear4bit`` computes for ``x`` already in the compute dtype, with the weight dequantized by
    :func:`nf4_weight`'s torch operations, for compiled regions. The dequantization is wrapped in a (non-reentrant)
    checkpoint: the frozen weight needs no gradient, but ``x``'s gradient needs the weight, and without the checkpoint's
    tag the compiler keeps every layer's dense weight from the forward to the backward (a bf16 copy of the base);
    with it the backward dequantizes again."""
    from torch.utils.checkpoint import checkpoint

    state = weight.quant_state
    layout = (tuple(state.shape), int(state.blocksize), _blocksize2(state))
    dense = checkpoint(_dequantize, weight, *_state_tensors(state), *layout, x.dtype, use_reentrant=False)
    return nn.functional.linear(x, dense, None if bias is None else bias.to(x.dtype))


@functools.lru_cache(maxsize=1)
def _autocast_linear4bit() -> type:
    """``bnb.nn.Linear4bit`` that returns the autocast dtype, like ``nn.Linear`` under autocast.

    bitsandbytes casts its output back to the *input's* dtype. Under autocast the input of a linear layer is often
    float32 (a norm's output), so every quantized layer would hand float32 activations to the next op: a third more
    activation memory than the bf16 model for the same graph (measured on FLUX: +4.3 GiB at rank 16 without
    checkpointing). Casting the input to the compute dtype first keeps activations in bf16, as ``nn.Linear`` does.
    """
    bnb = require_bitsandbytes()

    base: Any = bnb.nn.Linear4bit

    class AutocastLinear4bit(base):
        compiled_dequantize = False  # NF4(compiled_dequantize=...): nf4_linear inside compiled regions

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled(x.device.type) and self.compute_dtype is not None:
                x = x.to(self.compute_dtype)
            if self.compiled_dequantize and torch.compiler.is_compiling() and self.weight.quant_state is not None:
                wanted = x.dtype
                compute = self.compute_dtype or x.dtype
                return nf4_linear(x.to(compute), self.weight, self.bias).to(wanted)
            return super().forward(x)

    return AutocastLinear4bit


@functools.lru_cache(maxsize=1)
def require_bitsandbytes() -> Any:
    """Import bitsandbytes, or say how to get it.

    On ROCm the import can also fail inside bitsandbytes (no native library for this ROCm version): that is a
    ``RuntimeError`` or ``OSError``, not an ``ImportError``, and gets the same message with the ROCm hint.
    """
    try:
        import bitsandbytes
    except (ImportError, RuntimeError, OSError) as e:
        hint = ""
        if torch.version.hip is not None:
            hint = f" (this is a ROCm {torch.version.hip} build of torch: bitsandbytes needs a ROCm-enabled release)"
        raise ConfigError(
            "NF4 (lightning_lora.precision.NF4, data.text_encoder_quantization: nf4) needs bitsandbytes: pip install "
            f"'lightning-lora[bnb]'{hint}; "
            f"importing it failed with: {e}"
        ) from e
    return bitsandbytes


def quantize_nf4(
    model: nn.Module,
    skip: list[str],
    device: torch.device,
    compute_dtype: torch.dtype,
    double_quant: bool,
    upcast_small_params: bool,
    compiled_dequantize: bool,
) -> int:
    """Swap every linear layer of ``model`` (but those ``skip`` matches, and those whose ``in_features`` is not a
    multiple of 64) for an NF4 layer on ``device`` that computes in ``compute_dtype``; returns how many were swapped.
    ``double_quant``, ``upcast_small_params`` and ``compiled_dequantize``: see :class:`lightning_lora.precision.NF4`,
    whose defaults are the only ones."""
    bnb = require_bitsandbytes()
    count = 0
    for parent, name, _, linear in linear_layers(model, skip):
        if linear.in_features % 64:
            continue
        layer = _autocast_linear4bit()(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=double_quant,
            quant_type="nf4",
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            linear.weight.data,
            requires_grad=False,
            compress_statistics=double_quant,
            quant_type="nf4",
            module=layer,
        )._quantize(device)
        if linear.bias is not None:
            # In compute_dtype, and not upcast below: bitsandbytes' forward otherwise rewrites `bias.data` to the
            # compute dtype in the first call. Inside a compiled, checkpointed block that changes the parameter between
            # the forward and its recomputation, dynamo picks another graph, and the backward fails ("A different
            # number of tensors was saved during the original forward and recomputation").
            layer.bias = nn.Parameter(linear.bias.data.to(device, compute_dtype), requires_grad=False)
        # bitsandbytes 0.50 repacks weights for an AVX512-BF16 CPU fast path in eval mode; that path breaks on the
        # bias add and never goes back. It is an inference optimisation for CPUs: a trainer does not need it.
        layer.support_avx512bf16_for_cpu = False
        layer.compiled_dequantize = compiled_dequantize
        setattr(parent, name, layer)
        count += 1
        del linear
    if upcast_small_params:
        keep = {id(m.bias) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit) and m.bias is not None}
        for p in model.parameters():
            small = not isinstance(p, bnb.nn.Params4bit) and id(p) not in keep
            if small and p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return count
