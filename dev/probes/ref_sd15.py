"""The plain diffusers + peft LoRA recipe for Stable Diffusion 1.5, from before ``shared/bench/ref_recipe.py`` had an
SD1.5 mode. Its ``sd15-bf16 --clip 0`` mode is the same loop (the same UNet config, LoRA targets, casts, noise and
loss); new plans use it. This file stays for the rows it produced (the SD1.5 recipe rows of dev/LOG.md and
BENCHMARKS.md).

``ref_recipe.py`` was the reference for FLUX.1 and SDXL only; ``configs/sd15_8gb.yaml`` had nothing to stand beside.
This is the same plain loop for SD1.5, written here: the UNet of SD1.5's real config
(:data:`lightning_lora.families.sd15.SD15_UNET`, 860 M parameters) with random bf16 weights, frozen; peft's LoRA on
``to_k/to_q/to_v/to_out.0`` added with ``add_adapter`` and its parameters cast to float32 (what diffusers'
``train_text_to_image_lora.py`` does); bf16 autocast; epsilon prediction on a cosine noise schedule; ``mse_loss``;
``enable_gradient_checkpointing`` with ``--gc 1``; ``compile_repeated_blocks`` with ``--rcompile`` (the two lines a
recipe user adds); batch 1 of random latents and CLIP-L embeddings (77 x 768). Nothing of lightning-lora runs but the
config dict.

    python dev/probes/ref_sd15.py --rank 16 --gc 0 --h 512 --w 512 --opt adamw8bit [--rcompile] [--steps 6 --warm 3]

Prints one JSON line with ``ref_recipe.py``'s keys (``s_per_step``, ``peak_alloc_GiB``, ``peak_reserved_GiB``, ``loss``,
``lora_params_M``...), ``mode`` ``sd15-bf16``; an error in the steps is the line's ``error``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
TINY = {
    "block_out_channels": [32, 64, 64, 64],
    "attention_head_dim": 8,
    "cross_attention_dim": 32,
    "sample_size": 8,
    "layers_per_block": 1,
}
"""``--tiny``: the same block types at a width a CPU test runs in a second."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--gc", type=int, choices=(0, 1), default=0)
    p.add_argument("--h", type=int, default=512)
    p.add_argument("--w", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--opt", choices=("adamw8bit", "adamw"), default="adamw8bit")
    p.add_argument("--rcompile", action="store_true", help="regional compile of the repeated blocks")
    p.add_argument("--sdp", choices=("all", "nocudnn"), default="all", help="nocudnn: SDPA without cuDNN's kernel")
    p.add_argument("--tiny", action="store_true", help="a small UNet of the same block types (CPU tests)")
    return p.parse_args(argv)


def build_unet(tiny: bool, device: str, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    from diffusers import UNet2DConditionModel

    from lightning_lora.families.sd15 import SD15_UNET

    cfg = {k: v for k, v in SD15_UNET.items() if not k.startswith("_")}
    if tiny:
        cfg.update(TINY)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: Any = UNet2DConditionModel(**cfg)
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    return model, cfg


def add_lora(model: Any, rank: int) -> list[torch.nn.Parameter]:
    """peft's LoRA on the recipe's four attention projections; the trainable parameters, cast to float32."""
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


def make_step(
    model: Any, opt: torch.optim.Optimizer, cfg: dict[str, Any], a: argparse.Namespace, device: str
) -> Callable[[], torch.Tensor]:
    dt = torch.bfloat16
    x0 = torch.randn(1, 4, a.h // 8, a.w // 8, device=device, dtype=dt)
    enc = torch.randn(1, 77, cfg["cross_attention_dim"], device=device, dtype=dt)

    def step() -> torch.Tensor:
        t = torch.randint(0, 1000, (1,), device=device)
        noise = torch.randn_like(x0)
        ab = torch.cos(t.float() / 1000 * 1.5707) ** 2
        xt = ab.sqrt()[:, None, None, None].to(dt) * x0 + (1 - ab).sqrt()[:, None, None, None].to(dt) * noise
        with torch.autocast(device, dtype=dt):
            pred = model(xt, t, encoder_hidden_states=enc, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run(a: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.sdp == "nocudnn" and device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    out: dict[str, Any] = {"mode": "sd15-bf16", "rank": a.rank, "gc": a.gc, "h": a.h, "w": a.w, "opt": a.opt}
    out.update(rcompile=a.rcompile, sdp=a.sdp, recipe="dev/probes/ref_sd15.py")
    t0 = time.time()
    model, cfg = build_unet(a.tiny, device, torch.bfloat16)
    out["base_params_B"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
    params = add_lora(model, a.rank)
    out["lora_params_M"] = round(sum(p.numel() for p in params) / 1e6, 3)
    if a.gc:
        model.enable_gradient_checkpointing()
    model.train()
    if a.opt == "adamw8bit":
        import bitsandbytes as bnb

        opt: torch.optim.Optimizer = bnb.optim.AdamW8bit(params, lr=1e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)
    step = make_step(model, opt, cfg, a, device)
    if a.rcompile:
        model.compile_repeated_blocks()
    out["setup_s"] = round(time.time() - t0, 1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            out["static_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        t1 = time.time()
        for _ in range(a.warm):
            step()
        sync()
        out["warm_s"] = round(time.time() - t1, 1)
        t1 = time.time()
        for _ in range(a.steps):
            loss = step()
        sync()
        out["s_per_step"] = round((time.time() - t1) / a.steps, 4)
        out["loss"] = round(float(loss), 4)
        if device == "cuda":
            out["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            out["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    except Exception as e:  # one JSON line per configuration, as ref_recipe.py reports
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse(argv))), flush=True)


if __name__ == "__main__":
    main()
