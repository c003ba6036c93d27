"""Does a quantized base change what is learned? The LoRA gradients of one step on a quantized base (FP8 storage, FP8
compute, NF4) against the same step on the bf16 base: same random weights, same LoRA (its B matrices set to small
random values so every LoRA tensor has a gradient), same batch. Prints one JSON line per mode: the cosine of the
concatenated LoRA gradients to the bf16 ones, the worst per-tensor cosine, and the relative norm of the difference.

    python dev/probes/fp8_numerics.py                          # FLUX.1-dev at full size (random weights), on the GPU
    python dev/probes/fp8_numerics.py --tiny --modes none fp8  # a CPU smoke run of the same code

Random weights at full size are a hard case (nothing in them is smooth); issue 16 asks for a cosine of at least 0.99.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # tools/bench.py builds the model and the batch

from bench import Synthetic, denoiser_config, random_family  # noqa: E402

from lightning_lora.lora import LoraOptions, set_lora_input_casts  # noqa: E402
from lightning_lora.module import LoraModule  # noqa: E402
from lightning_lora.precision import PRECISIONS  # noqa: E402


def lora_gradients(mode: str, a: argparse.Namespace, device: str) -> dict[str, torch.Tensor]:
    """The LoRA gradients of one step on a base stored in ``mode`` (float32, on the CPU, by parameter name)."""
    config = denoiser_config("flux", a.tiny)
    torch.manual_seed(0)  # the same random base for every mode
    family = random_family("flux", config, device, max_sequence_length=a.tlen)
    module = LoraModule(
        pretrained="random-init",
        family=family,
        lora=LoraOptions(rank=a.rank, alpha=a.rank, targets=a.targets),
    )
    module.use_precision(PRECISIONS[{"none": "BF16", "nf4": "NF4", "fp8": "FP8", "fp8_compute": "FP8Compute"}[mode]]())
    denoiser = module.build(torch.device(device))
    set_lora_input_casts(denoiser, enabled=False)  # as under bf16-mixed: the step runs under autocast
    trainable = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
    with torch.no_grad():  # the same small update in every mode, so that lora_A has a gradient too
        for name, p in trainable.items():
            if "lora_B" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(0.01 * torch.randn(p.shape, generator=g).to(p.dtype))
    item = Synthetic("flux", config, a.h, a.w, a.tlen, family_obj=family)[0]
    batch = {k: v[None].to(device) for k, v in item.items()}
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = family.loss(denoiser, batch, batch["noise"], batch["timesteps"]).mean()
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in trainable.items() if p.grad is not None}
    del module, denoiser, trainable
    if device == "cuda":
        torch.cuda.empty_cache()
    return grads


def compare(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = sorted(reference)
    a = torch.cat([grads[n].flatten() for n in names])
    b = torch.cat([reference[n].flatten() for n in names])
    per_tensor = [
        torch.nn.functional.cosine_similarity(grads[n].flatten(), reference[n].flatten(), dim=0) for n in names
    ]
    return {
        "cosine": round(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), 5),
        "worst_tensor_cosine": round(float(min(per_tensor)), 5),
        "relative_difference": round(float((a - b).norm() / b.norm()), 5),
        "tensors": len(names),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", nargs="+", default=["none", "fp8", "fp8_compute", "nf4"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="attention")
    p.add_argument("--h", type=int, default=512)
    p.add_argument("--w", type=int, default=768)
    p.add_argument("--tlen", type=int, default=512)
    a = p.parse_args()
    if a.tiny:
        a.h, a.w, a.tlen = 32, 32, 8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # crashes in FLUX's backward on an H200 (ENVIRONMENT.md)
    reference = lora_gradients("none", a, device)
    for mode in a.modes:
        if mode == "none":
            continue
        try:
            row = {
                "mode": mode,
                "h": a.h,
                "w": a.w,
                "rank": a.rank,
                **compare(lora_gradients(mode, a, device), reference),
            }
        except Exception as e:  # one mode failing must not lose the others
            row = {"mode": mode, "error": repr(e)[:300]}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
