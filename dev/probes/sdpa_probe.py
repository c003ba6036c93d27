"""One SDPA backend at one attention shape: forward and backward time, TFLOP/s, agreement with the flash kernel, or
the error. Prints one JSON line (``--out`` also appends it to a file).

    python dev/probes/sdpa_probe.py --backend cudnn --layout bshd [--batch 2 --heads 24 --tokens 4608 --head-dim 128]

Why: at 1024x1024 FLUX.1 spent 45% of its GPU time in PyTorch's flash kernel (FlashAttention-2, about 285 TFLOP/s
on an H200, against 710 for its GEMMs: dev/LOG.md, call 30), and cuDNN's SDPA, the Hopper kernel PyTorch has,
crashed in FLUX's backward with an illegal memory access (calls 8 and 30). This probe runs the attention alone, or
FLUX's own blocks, so one call can say whether a crash follows the backend, the tensor layout, the shape or the model
(call 31: the layout of the output's gradient in FLUX's single-stream blocks; ``lightning_lora.model.attention``).

``--layout contiguous`` gives SDPA ``[B, H, S, D]`` tensors as allocated; ``bshd`` gives it the ``[B, S, H, D]``
tensors transposed to ``[B, H, S, D]`` (strided, as diffusers' attention processors hand them over), and the output's
gradient arrives in that layout too (as it does from the processor's ``flatten``), unless ``--grad contiguous``.

``--model flux`` runs the real thing instead of SDPA alone: a FLUX.1 transformer at full width (3,072, 24 heads of 128)
with ``--double`` / ``--single`` blocks, built on the GPU with random weights, frozen, forward and the input gradient
backward as in LoRA training, with diffusers' attention dispatch (``--dispatch native``: SDPA as diffusers calls it,
the kernel chosen by ``--backend``; ``--dispatch cudnn``: diffusers' ``_native_cudnn`` backend, which hands cuDNN
contiguous tensors). ``--tokens`` is then the image tokens and ``--text`` the text tokens.

Run each backend in its own process (one command each; ``tools/bench_suite.py`` ran it as a ``"script"`` row when it
lived in tools/): an illegal memory access leaves the process's CUDA context unusable. The default shape is
``flux_h100``'s: batch 2, 24 heads, 4,096 image + 512 text tokens, head dimension 128.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def attention_inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v as SDPA receives them (``[B, H, S, D]``), leaves that need gradients, in ``args.layout``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    tensors = []
    for _ in range(3):
        if args.layout == "contiguous":
            t = torch.randn(args.batch, args.heads, args.tokens, args.head_dim, generator=g)
            t = t.to(device, dtype).requires_grad_()
            tensors.append(t)
        else:  # [B, S, H, D] storage, seen as [B, H, S, D]
            t = torch.randn(args.batch, args.tokens, args.heads, args.head_dim, generator=g)
            leaf = t.to(device, dtype).requires_grad_()
            tensors.append(leaf.transpose(1, 2))
    return tensors


def output_gradient(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The gradient SDPA's backward receives: in ``[B, S, H, D]`` storage for ``bshd`` (what the processor's
    ``flatten`` hands back), contiguous ``[B, H, S, D]`` for ``contiguous`` or ``--grad contiguous``."""
    b, h, s, d = args.batch, args.heads, args.tokens, args.head_dim
    if args.layout == "bshd" and args.grad == "layout":
        return torch.randn(b, s, h, d, device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(b, h, s, d, device=device, dtype=dtype)


def storage_layout(t: torch.Tensor) -> str:
    """Which ``[B, H, S, D]`` layout ``t``'s storage has: ``"bhsd"`` (contiguous as seen), ``"bshd"`` (heads inside
    tokens, as diffusers' processors make q / k / v, whose ``flatten`` of the output is then a view) or ``"other"``.
    Whether a backend's output follows its query's layout decides whether the processor copies it (the memory
    planner's meta count allocates it in the query's ``[B, H, S, D]`` shape; dev/LOG.md, stop 46)."""
    if t.is_contiguous():
        return "bhsd"
    return "bshd" if t.transpose(1, 2).is_contiguous() else "other"


def attention_flops(args: argparse.Namespace) -> tuple[float, float]:
    """Forward and backward FLOPs as fused kernels compute them (``4 B H S^2 D`` forward, 2.5x that backward)."""
    forward = 4.0 * args.batch * args.heads * args.tokens**2 * args.head_dim
    return forward, 2.5 * forward


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warm: int = 2) -> float:
    """Milliseconds per call of ``fn``, after ``warm`` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warm):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps * 1000


def probe(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    out: dict[str, Any] = {
        "tool": "sdpa_probe",
        **{
            k: getattr(args, k)
            for k in ("backend", "layout", "grad", "chain", "batch", "heads", "tokens", "head_dim", "dtype")
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
    }
    if args.model:
        out.update(model_probe(args, device, dtype))
        return out
    q, k, v = attention_inputs(args, device, dtype)
    grad = output_gradient(args, device, dtype)
    try:
        with sdpa_kernel([BACKENDS[args.backend]]):
            forward_ms = timed(lambda: F.scaled_dot_product_attention(q, k, v), device, args.reps, args.warm)

            def step() -> torch.Tensor:
                o = F.scaled_dot_product_attention(q, k, v)
                for _ in range(args.chain - 1):  # the next attention's query is this one's output, as in a model
                    o = F.scaled_dot_product_attention(o, k, v)
                o.backward(grad)
                return o

            step_ms = timed(step, device, args.reps, args.warm)
            output = F.scaled_dot_product_attention(q, k, v)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the probe's answer: the kernel's error, by name
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return out
    forward_flops, backward_flops = attention_flops(args)
    backward_ms = max(step_ms - forward_ms, 1e-9)
    out.update(
        forward_ms=round(forward_ms, 3),
        backward_ms=round(backward_ms, 3),
        forward_tflops=round(forward_flops / forward_ms / 1e9, 1),
        backward_tflops=round(backward_flops / backward_ms / 1e9, 1),
        query_layout=storage_layout(q),
        output_layout=storage_layout(output),
    )
    reference = "flash" if device.type == "cuda" else "math"
    if args.backend != reference:
        with torch.no_grad(), sdpa_kernel([BACKENDS[reference]]):
            expected = F.scaled_dot_product_attention(q, k, v)
        out[f"max_abs_diff_vs_{reference}"] = float((output.detach() - expected).abs().max())
    return out


def flux_transformer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """FLUX.1-dev's transformer at full width with ``args.double`` / ``args.single`` blocks, random weights, frozen."""
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        model = FluxTransformer2DModel(
            num_layers=args.double,
            num_single_layers=args.single,
            attention_head_dim=args.head_dim,
            num_attention_heads=args.heads,
            axes_dims_rope=(args.head_dim // 8, 7 * args.head_dim // 16, 7 * args.head_dim // 16),  # 16, 56, 56
            guidance_embeds=True,
        ).to(dtype)
    return model.requires_grad_(False).train()


def model_probe(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Forward and input-gradient backward of :func:`flux_transformer` with the chosen attention: ms per step, or the
    error. The process is the unit: an illegal memory access leaves its CUDA context unusable."""
    model = flux_transformer(args, device, dtype)
    if args.grad_fix:
        from lightning_lora.model.attention import hand_sdpa_matching_gradients

        hand_sdpa_matching_gradients(True)
    if args.dispatch == "cudnn":
        model.set_attention_backend("_native_cudnn")
    b, s, t = args.batch, args.tokens, args.text
    g = torch.Generator(device="cpu").manual_seed(0)
    latents = torch.randn(b, s, 64, generator=g).to(device, dtype).requires_grad_()
    inputs = {
        "encoder_hidden_states": torch.randn(b, t, 4096, generator=g).to(device, dtype),
        "pooled_projections": torch.randn(b, 768, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 0.5, device=device),
        "guidance": torch.full((b,), 3.5, device=device),
        "img_ids": torch.zeros(s, 3, device=device),
        "txt_ids": torch.zeros(t, 3, device=device),
    }
    side = int(s**0.5)
    inputs["img_ids"][:, 1] = torch.arange(s, device=device) // side
    inputs["img_ids"][:, 2] = torch.arange(s, device=device) % side

    def step() -> None:
        with torch.set_grad_enabled(not args.forward_only):
            out = model(hidden_states=latents, return_dict=False, **inputs)[0]
        if not args.forward_only:
            out.float().square().mean().backward()

    try:
        with sdpa_kernel([BACKENDS[args.backend]]):
            step_ms = timed(step, device, args.reps, args.warm)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the probe's answer
        return {"model": args.model, "dispatch": args.dispatch, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {
        "model": args.model,
        "dispatch": args.dispatch,
        "forward_only": args.forward_only,
        "grad_fix": args.grad_fix,
        "double": args.double,
        "single": args.single,
        "text": t,
        "step_ms": round(step_ms, 3),
        "peak_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=list(BACKENDS), default="flash")
    p.add_argument("--layout", choices=["contiguous", "bshd"], default="bshd")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--grad", choices=["layout", "contiguous"], default="layout", help="the output gradient's layout")
    p.add_argument("--chain", type=int, default=1, help="attentions in a row before the backward (SDPA alone)")
    p.add_argument("--model", choices=["", "flux"], default="", help="a real FLUX transformer instead of SDPA alone")
    p.add_argument(
        "--dispatch",
        choices=["native", "cudnn"],
        default="native",
        help="diffusers' attention backend (cudnn: set process-wide)",
    )
    p.add_argument("--double", type=int, default=1, help="--model: double-stream blocks")
    p.add_argument("--single", type=int, default=1, help="--model: single-stream blocks")
    p.add_argument("--text", type=int, default=512, help="--model: text tokens")
    p.add_argument(
        "--grad-fix", action="store_true", help="--model: dO in O's strides (lightning_lora.model.attention)"
    )
    p.add_argument("--forward-only", action="store_true", help="--model: the forward without gradients")
    p.add_argument("--warm", type=int, default=2, help="calls before the timed ones")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default=None, help="default: cuda when there is one")
    p.add_argument("--out", default="", help="also append the JSON line to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = probe(args)
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with Path(args.out).open("a") as f:
            f.write(line + "\n")
    return 1 if "error" in out else 0


if __name__ == "__main__":
    raise SystemExit(main())
