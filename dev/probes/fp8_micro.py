"""Micro-benchmark of one frozen linear layer, forward + input gradient, on FLUX.1 shapes: bf16 vs FP8 storage vs
FP8 compute (lightning_lora.precision.fp8). Prints one JSON line per shape with ms per call and the speed-up over bf16.

    python dev/probes/fp8_micro.py [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_lora.precision.fp8 import FP8Linear

SHAPES = {"qkv": (3072, 3072), "mlp_up": (3072, 12288), "mlp_down": (12288, 3072), "single_out": (15360, 3072)}


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    a = p.parse_args()
    total = {}
    for name, (n_in, n_out) in SHAPES.items():
        linear = torch.nn.Linear(n_in, n_out, bias=True, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        layers = {"bf16": linear, "fp8_storage": FP8Linear(linear), "fp8_compute": FP8Linear(linear, compute=True)}
        x = torch.randn(a.tokens, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(a.tokens, n_out, device="cuda", dtype=torch.bfloat16)
        row = {"shape": name, "in": n_in, "out": n_out}
        for label, layer in layers.items():

            def step(layer=layer, x=x, g=g) -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = layer(x)
                y.backward(g)

            row[f"{label}_ms"] = round(timed(step), 3)
            total[label] = total.get(label, 0.0) + row[f"{label}_ms"]
        print(json.dumps(row), flush=True)
    print(
        json.dumps({"total_ms": total, "speedup_vs_bf16": {k: round(total["bf16"] / v, 3) for k, v in total.items()}})
    )


if __name__ == "__main__":
    main()
