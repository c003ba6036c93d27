"""The FLOP floor of one LoRA training step: the FLOPs of a family's denoiser at its real size, counted, and the seconds
they take at a GPU's peak throughput.

Issue 20 asks of every family (bf16, no checkpointing, compiled, 1024x1024) that a step take at most 1.5x its FLOP
floor. The floor is counted here, not estimated, with no weights and no GPU:

1. the family's real denoiser is built on PyTorch's ``meta`` device (:meth:`DiffusionFamily.denoiser_skeleton`: the
   shipped architecture of a known hub id, or a local folder's ``config.json``; shapes, no memory), frozen, and the
   project's own LoRA injected (:func:`lightning_lora.lora.inject_lora`; rank 16 on the family's ``attention`` preset
   by default), as the memory planner (:mod:`lightning_lora.plan`) builds it;
2. one forward pass on the batch the planner uses (:meth:`DiffusionFamily.example_inputs`: latents, text embeddings at
   the family's text length, timesteps...) and the backward of its output run under
   :class:`torch.utils.flop_counter.FlopCounterMode`, forward and backward counted apart (:func:`count_step`).

What is counted: every matmul (``mm``, ``addmm``, ``bmm``), convolution and attention kernel, 2 FLOPs per multiply-add.
Elementwise work (norms, activations, RoPE, modulation, the loss, the optimizer) is not: it is memory-bound, and a
compiled step fuses it. The counter sees what autograd runs, so:

* the frozen base costs **no weight gradients**: a frozen linear layer's backward is one matmul (the input gradient,
  as many FLOPs as its forward), not two;
* the backward stops where nothing before needs a gradient: as in training, the latents and text embeddings do not
  require grad, so the embedders and the layers of the first block that come before its first adapter compute no input
  gradient (``--rank 0`` drops the adapter and makes every floating-point input require grad instead: the backward of
  the whole frozen base, a slightly higher bound);
* the adapter's own FLOPs (its forward, input and weight gradients: ``2 * r * (in + out)`` per token and layer, three
  times) are included; at rank 16 they are ~0.3% of a FLUX step, about what the skipped input gradients save.

Attention is counted as the GPU's flash / memory-efficient / cuDNN kernels run it (what ``FlopCounterMode`` counts for
them): forward ``QK^T`` and ``PV``, ``4 * B * H * Sq * Sk * D``; backward 2.5x that (the scores ``QK^T`` are computed
again, then ``dV``, ``dP``, ``dQ``, ``dK``). On the meta device (and the CPU) PyTorch would pick its math backend
instead, whose backward keeps the attention matrix and costs 2x the forward; :func:`flash_attention` routes
``scaled_dot_product_attention`` to PyTorch's fused (flash) attention operator, which has meta and CPU kernels, and
the counter counts it with ``torch.utils.flop_counter``'s own attention formulas. (Unpatched, the counter would see
the math backend's matmuls on meta, and nothing at all for the CPU's fused kernel.) The usual MFU convention, which
does not count the recomputed scores, would give a FLUX step 2% (512x768) to 4% (1024x1024) fewer FLOPs.

The throughput: ``--tflops`` (default 989.5) is the NVIDIA H200 SXM's dense BF16 tensor-core peak. NVIDIA's H200
datasheet lists "BF16 Tensor Core 1,979 TFLOPS" for H200 SXM with the footnote "with sparsity"; dense is half. (H200
NVL: 1,671 with sparsity, 835.5 dense; H100 SXM: the same 989.5.) Large bf16 GEMMs measured 715-790 TFLOP/s on
the project's H200 (shared/bench/REFERENCE.md), so no step reaches its floor: it is a lower bound, not a target.

Checked by hand, FLUX.1-dev at 512x768 with T5's 512 tokens, batch 1: S = 32 * 48 + 512 = 2,048 tokens, D = 3,072,
19 double- and 38 single-stream blocks. Each block multiplies every token by 12 D^2 weights (a double block: its
stream's q, k, v, out, 4 D^2, and MLP, 8 D^2; a single block: q, k, v and MLP-in, 7 D^2, and the output, 5 D^2), so
the linear layers' forward is 57 * 2 * 12 D^2 * S = 26.44 TFLOP (+0.02 for the embedders and the output), attention
57 * 4 S^2 D = 2.94: forward 29.4 TFLOP; the backward, input gradients 26.46 + attention 2.5 * 2.94 = 33.8; total
63.2 TFLOP (63.3 with the rank-16 adapter), 0.064 s at 989.5 TFLOP/s. This tool prints the same. "2 * N * tokens"
with N = 11.9 B (97 TFLOP for forward and input gradients, ~104 with attention) overcounts 1.85x: 3.2 B of FLUX's
parameters are AdaLN modulation weights, which see one conditioning vector per sample, not every token, and a double
block's two streams each see only their own tokens (image or text), so a token meets 57 * 12 D^2 = 6.45 B weights.
The profile of the eager step agrees: its base-forward matmuls took 37 ms (dev/LOG.md, issue 7), 715 TFLOP/s for
26.5 TFLOP; 48.7 TFLOP in 37 ms would be 1,300 TFLOP/s, above the peak.

    python tools/flop_floor.py --family flux --h 1024 --w 1024 --tlen 512
    python tools/flop_floor.py --family flux --h 512 --w 768 --tlen 512     # the BENCHMARKS.md FLUX shape
    python tools/flop_floor.py --family flux2 --variant dev --tflops 700
    python tools/flop_floor.py --family all --h 1024 --w 1024 --tlen 512    # one line per model

Each prints one JSON line per model: the model, the input shapes, the base's parameters, forward / backward / total
TFLOP (attention's forward and backward part beside), the assumed TFLOP/s and ``floor_s = total / tflops``.
``--family all`` (seven models: FLUX.1-dev, SDXL, SD1.5, Z-Image, Qwen-Image, FLUX.2 klein base 4B, FLUX.2 dev) takes
about a minute on one CPU core (50-70 s on the 2-core development machine: ~10 s of imports, then 2-12 s a model,
mostly PyTorch's meta kernels running one by one in Python); it needs no GPU, no memory to speak of and no network.

SDXL and SD1.5 read CLIP's 77 tokens whatever ``--tlen`` says; FLUX.1 and FLUX.2 attend over the padded T5 / LLM
length, Z-Image and Qwen-Image over the caption's tokens: ``--tlen`` is that length (the planner's ``text_len``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from lightning_lora.families import SD15, SDXL, DiffusionFamily, Flux, Flux2, QwenImage, ZImage
from lightning_lora.families.base import ModelSource
from lightning_lora.lora import LoraOptions, inject_lora

H200_BF16_TFLOPS = 989.5
"""NVIDIA H200 SXM, dense BF16 tensor-core peak (the datasheet's 1,979 TFLOPS is with 2:4 sparsity)."""

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _attention_forward_flop(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _attention_backward_flop(
    grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    return sdpa_backward_flop_count(grad, query, key, value)


ATTENTION_FLOPS: dict[Any, Callable[..., int]] = {
    _FLASH: _attention_forward_flop,
    _FLASH_BACKWARD: _attention_backward_flop,
}
"""``FlopCounterMode``'s ``custom_mapping`` for the fused attention operator :func:`flash_attention` calls: the
formulas torch counts the GPU's flash / efficient / cuDNN attention with (shapes in, FLOPs out)."""


@contextlib.contextmanager
def flash_attention() -> Iterator[None]:
    """Route ``F.scaled_dot_product_attention`` to PyTorch's fused (flash) attention operator while inside, on any
    device (it has meta and CPU kernels), so that :data:`ATTENTION_FLOPS` counts attention as the GPU kernels compute
    it. A boolean mask becomes the additive mask the operator takes; grouped-query attention repeats K and V to the
    query's heads (the same FLOPs a GQA kernel counts)."""
    original = F.scaled_dot_product_attention

    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        elif attn_mask is not None:
            attn_mask = attn_mask.to(query.dtype)
        return _FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = attention  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one forward and one backward pass; ``attention_*`` is the attention kernels' part of each."""

    forward: int
    backward: int
    attention_forward: int
    attention_backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def _counted(mode: FlopCounterMode) -> tuple[int, int]:
    """All FLOPs ``mode`` counted, and those of the attention operator."""
    ops = mode.get_flop_counts().get("Global", {})
    return sum(ops.values()), sum(n for op, n in ops.items() if op in ATTENTION_FLOPS)


def count_step(model: nn.Module, inputs: dict[str, Any]) -> StepFlops:
    """Count one forward pass ``model(**inputs)`` and the backward of its output (the sum of every output tensor that
    requires grad), apart, with attention counted as the fused kernels run it (:func:`flash_attention`). What the
    backward computes is what requires grad: the trainable parameters and the inputs that require grad. Works on the
    meta device (shapes only) and on real tensors alike."""
    with flash_attention():
        with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
            out = model(**inputs)
        forward = _counted(counter)
        graded = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not graded:
            raise ValueError(
                "nothing to differentiate: no output requires grad (inject an adapter, or make an input require grad)"
            )
        with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
            torch.stack([t.float().sum() for t in graded]).sum().backward()
        backward = _counted(counter)
    return StepFlops(forward[0], backward[0], forward[1], backward[1])


def adapt(model: nn.Module, family: DiffusionFamily, lora: LoraOptions | None) -> nn.Module:
    """Freeze ``model`` and inject ``lora`` as training does (:func:`~lightning_lora.lora.inject_lora`); ``None``: no
    adapter. Returns ``model`` in training mode."""
    model.requires_grad_(False)
    if lora is not None:
        inject_lora(model, family, lora)
    return model.train()


def require_input_grads(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with every floating-point tensor requiring grad: the backward then reaches every layer."""
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.requires_grad_(True)
    return inputs


def training_step_flops(
    family: DiffusionFamily, model: nn.Module, batch: int, height: int, width: int, lora: LoraOptions | None
) -> tuple[StepFlops, dict[str, Any]]:
    """The FLOPs of one training step of ``model`` (the family's denoiser on the meta device, not yet adapted) at this
    batch and image size and the family's text length, and the inputs it ran on. ``lora=None``: no adapter, every
    floating-point input requires grad instead."""
    dtype = next(model.parameters()).dtype
    adapt(model, family, lora)
    inputs = family.example_inputs(model, batch, height, width, family.text_tokens, device="meta", dtype=dtype)
    if lora is None:
        require_input_grads(inputs)
    return count_step(model, inputs), inputs


@dataclass(frozen=True)
class Model:
    """One model of ``--family``: the family built for a text length, and the hub id whose architecture ships with
    lightning-lora."""

    family: str
    variant: str | None
    pretrained: str
    build: Callable[[int], DiffusionFamily]


MODELS: tuple[Model, ...] = (
    Model("flux", None, "black-forest-labs/FLUX.1-dev", lambda t: Flux(max_sequence_length=t)),
    Model("sdxl", None, "stabilityai/stable-diffusion-xl-base-1.0", lambda t: SDXL()),  # CLIP: 77 tokens
    Model("sd15", None, "stable-diffusion-v1-5/stable-diffusion-v1-5", lambda t: SD15()),
    Model("zimage", None, "Tongyi-MAI/Z-Image-Turbo", lambda t: ZImage(max_sequence_length=t)),
    Model("qwenimage", None, "Qwen/Qwen-Image", lambda t: QwenImage(max_sequence_length=t)),
    Model("flux2", "klein", "black-forest-labs/FLUX.2-klein-base-4B", lambda t: Flux2("klein", max_sequence_length=t)),
    Model("flux2", "dev", "black-forest-labs/FLUX.2-dev", lambda t: Flux2("dev", max_sequence_length=t)),
)
"""What ``--family all`` counts, in this order (Z-Image base shares Turbo's transformer, FLUX.2 klein its distilled
model's)."""


def _shapes(inputs: dict[str, Any]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def floor_line(
    model: Model,
    height: int,
    width: int,
    text_len: int,
    batch: int,
    tflops: float,
    lora: LoraOptions | None,
    pretrained: str | None = None,
) -> dict[str, Any]:
    """The JSON line of ``model`` at these shapes: FLOPs of one training step and its floor in seconds."""
    family = model.build(text_len)
    source = ModelSource(pretrained or model.pretrained, dtype=torch.bfloat16)
    family.check_resolution(height, width, "--h/--w")
    denoiser = family.denoiser_skeleton(source)  # meta device: shapes only
    params = sum(p.numel() for p in denoiser.parameters())
    flops, inputs = training_step_flops(family, denoiser, batch, height, width, lora)
    trainable = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    tera = 1e12

    def tflop(n: int) -> float:
        return float(f"{n / tera:.4g}")

    return {
        "family": model.family,
        "variant": model.variant,
        "pretrained": source.pretrained,
        "height": height,
        "width": width,
        "batch": batch,
        "text_tokens": family.text_tokens,
        "shapes": _shapes(inputs),
        "params_b": round(params / 1e9, 3),
        "lora": f"rank {lora.rank} {lora.targets}, {trainable / 1e6:.1f} M parameters" if lora else None,
        "forward_tflop": tflop(flops.forward),
        "backward_tflop": tflop(flops.backward),
        "total_tflop": tflop(flops.total),
        "attention_tflop": [tflop(flops.attention_forward), tflop(flops.attention_backward)],
        "tflops": tflops,
        "floor_s": float(f"{flops.total / tera / tflops:.4g}"),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = sorted({m.family for m in MODELS})
    p.add_argument("--family", default="flux", choices=[*names, "all"], help="a family, or all: every model")
    p.add_argument("--variant", default=None, help="FLUX.2: klein (default) or dev")
    p.add_argument("--pretrained", default=None, help="another hub id with shipped facts, or a local folder")
    p.add_argument("--h", type=int, default=1024, help="image height in pixels")
    p.add_argument("--w", type=int, default=1024, help="image width in pixels")
    p.add_argument("--tlen", type=int, default=512, help="text tokens (FLUX.1/2, Z-Image, Qwen-Image; CLIP reads 77)")
    p.add_argument("--batch", type=int, default=1, help="images per step")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank; 0: no adapter, every input requires grad")
    p.add_argument("--targets", default="attention", help="LoRA targets: a family preset or a module-name pattern")
    p.add_argument("--tflops", type=float, default=H200_BF16_TFLOPS, help="throughput, TFLOP/s (H200 dense bf16)")
    return p


def chosen(family: str, variant: str | None, pretrained: str | None = None) -> list[Model]:
    """The models ``--family`` / ``--variant`` name (every one for ``all``); without ``--variant``, the one whose hub id
    ``--pretrained`` names, where it names one (``--pretrained black-forest-labs/FLUX.2-dev`` is FLUX.2 dev, not the
    family's first variant built over dev's architecture)."""
    if family == "all":
        return list(MODELS)
    models = [m for m in MODELS if m.family == family and variant in (None, m.variant)]
    if variant is None:
        models = [m for m in models if m.pretrained == pretrained] or models
    if not models:
        variants = [m.variant for m in MODELS if m.family == family]
        raise SystemExit(f"--variant: {variant!r} is not a {family} variant here ({', '.join(map(str, variants))})")
    return models[:1]


def main(argv: Sequence[str] | None = None) -> None:
    a = parser().parse_args(argv)
    lora = LoraOptions(rank=a.rank, targets=a.targets) if a.rank > 0 else None
    if a.pretrained is not None and a.family == "all":
        raise SystemExit("--pretrained: one model at a time (a --family, not all)")
    for model in chosen(a.family, a.variant, a.pretrained):
        line = floor_line(model, a.h, a.w, a.tlen, a.batch, a.tflops, lora, a.pretrained)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
