"""One SDPA backend at one attention shape: forward and backward time, TFLOP/s, agreement with the flash kernel, or
the error. Prints one JSON line (``--out`` also appends it to a file).

    python tools/sdpa_probe.py --backend cudnn --layout bshd [--batch 2 --heads 24 --tokens 4608 --head-dim 128]

Why: at 1024x1024 FLUX.1 spends 45% of its GPU time in PyTorch's flash kernel (FlashAttention-2, about 285 TFLOP/s
on an H200, against 710 for its GEMMs: BENCHMARKS.md call 30), and cuDNN's SDPA, the Hopper kernel PyTorch has,
crashed in FLUX's backward with an illegal memory access (calls 8 and 30). This probe runs the attention alone, so
one call can say whether the crash follows the backend, the tensor layout or the shape, and what cuDNN would gain.

``--layout contiguous`` gives SDPA ``[B, H, S, D]`` tensors as allocated; ``bshd`` gives it the ``[B, S, H, D]``
tensors transposed to ``[B, H, S, D]`` (strided, as diffusers' attention processors hand them over). Run each
backend in its own process (``tools/bench_suite.py`` rows with ``"script": "sdpa_probe.py"``): an illegal memory
access leaves the process's CUDA context unusable. The default shape is ``flux_h100``'s: batch 2, 24 heads, 4,096
image + 512 text tokens, head dimension 128.
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
        **{k: getattr(args, k) for k in ("backend", "layout", "batch", "heads", "tokens", "head_dim", "dtype")},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
    }
    q, k, v = attention_inputs(args, device, dtype)
    grad = torch.randn(args.batch, args.heads, args.tokens, args.head_dim, device=device, dtype=dtype)
    try:
        with sdpa_kernel([BACKENDS[args.backend]]):
            forward_ms = timed(lambda: F.scaled_dot_product_attention(q, k, v), device, args.reps)

            def step() -> torch.Tensor:
                o = F.scaled_dot_product_attention(q, k, v)
                o.backward(grad)
                return o

            step_ms = timed(step, device, args.reps)
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
    )
    reference = "flash" if device.type == "cuda" else "math"
    if args.backend != reference:
        with torch.no_grad(), sdpa_kernel([BACKENDS[reference]]):
            expected = F.scaled_dot_product_attention(q, k, v)
        out[f"max_abs_diff_vs_{reference}"] = float((output.detach() - expected).abs().max())
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=list(BACKENDS), default="flash")
    p.add_argument("--layout", choices=["contiguous", "bshd"], default="bshd")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--head-dim", type=int, default=128)
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
