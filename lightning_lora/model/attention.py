"""SDPA's cuDNN backward needs the output's gradient in the output's own strides; this module hands it over so.

cuDNN's fused attention is the Hopper kernel in PyTorch's SDPA: on an H200 at FLUX's 1024x1024 attention (batch 2, 24
heads, 4,608 tokens, head dimension 128) it runs the forward at 660 TFLOP/s and the backward at 528, against 341 and
281 for the flash kernel (FlashAttention-2) that PyTorch picks without it (``dev/probes/sdpa_probe.py``). Attention
is 45% of a FLUX step's GPU time at that size, so this is the largest single speed-up left for the transformer
families.

It crashed: an illegal memory access, or ``mha_graph.execute(...).is_good()`` false, in the backward of full-size
FLUX (torch 2.11, cuDNN 9.19). A bisection on an H200 found where. SDPA alone never crashed, in any layout; one FLUX
block of either kind did not either; a double-stream block followed by a single-stream one did, every time: with
``CUDA_LAUNCH_BLOCKING=1`` the failing call is cuDNN's ``mha_graph.execute`` in the backward, and compute-sanitizer saw
16-byte reads up to 238 KB past the end of a 2 MiB allocation. The single-stream block concatenates
the attention output with its MLP branch (``torch.cat([attn, mlp], dim=2)``), so the gradient that reaches SDPA's
backward is a slice of a wider tensor, with other strides than the output ``O``. PyTorch then materializes a copy of
``dO`` "with matching strides" before calling cuDNN. Handing the backward a ``dO`` already laid out as ``O`` (this
module's :class:`OutputGradientInOutputLayout`, an identity in the forward) avoided the crash in every case that had
crashed, eager and with diffusers' contiguous ``_native_cudnn`` dispatch alike, and full-size ``flux_h100`` (57
blocks, compiled) then trained 18% faster than with flash attention. So the bad read is on PyTorch's path for a
mismatched ``dO``; which step of it is wrong was not pinned down.

The copy it makes is the one PyTorch would make (one output-sized tensor per attention in the backward, when the
strides differ; none when they match). Under ``torch.compile`` the copy is traced into the backward graph, and
inductor keeps SDPA's inputs in their traced stride order (its ``sdpa_constraint``), so cuDNN sees the same layouts.

:func:`hand_sdpa_matching_gradients` installs it process-wide, as the ``torch.backends.cuda`` switches that choose
the kernel are process-wide: diffusers' attention processors, old and new, call
``torch.nn.functional.scaled_dot_product_attention`` by name when they run, so every family is covered without a
processor of ours. :func:`lightning_lora.model.assembly.configure_attention` installs it whenever cuDNN's SDPA is
allowed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

PLAIN_SDPA = F.scaled_dot_product_attention


class OutputGradientInOutputLayout(torch.autograd.Function):
    """The identity; its backward hands on the incoming gradient copied into the forward output's strides (the same
    tensor when they already match)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
        ctx.stride = output.stride()
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == ctx.stride:
            return grad
        return torch.empty_strided(grad.shape, ctx.stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def sdpa_with_matching_gradients(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, whose backward receives ``dO`` in ``O``'s strides."""
    output = PLAIN_SDPA(*args, **kwargs)
    if output.requires_grad:
        return OutputGradientInOutputLayout.apply(output)
    return output


def hand_sdpa_matching_gradients(on: bool) -> None:
    """Install (``on``) or remove :func:`sdpa_with_matching_gradients` as ``F.scaled_dot_product_attention``."""
    F.scaled_dot_product_attention = sdpa_with_matching_gradients if on else PLAIN_SDPA  # type: ignore[assignment]


def sdpa_hands_matching_gradients() -> bool:
    """Whether :func:`hand_sdpa_matching_gradients` is on."""
    return F.scaled_dot_product_attention is sdpa_with_matching_gradients
