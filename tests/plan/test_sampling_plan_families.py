"""The planner's sample-image peak for FLUX.2 and Qwen-Image: both declare their VAE's architecture, so the decode at
full resolution is measured on the ``meta`` device (:func:`lightning_lora.plan.sampling_pieces`) with the latents their
pipelines decode, not estimated by hand (``sampling_bytes``, which counted too little: BENCHMARKS.md)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from helpers import REPO

from lightning_lora.families import DiffusionFamily, Flux2, ModelSource, QwenImage
from lightning_lora.families.flux2 import FLUX2_VAE
from lightning_lora.families.qwenimage import QWEN_IMAGE_VAE
from lightning_lora.lora import LoraOptions
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan import plan_training, sampling_bytes, sampling_pieces

CASES = [
    # FLUX.2's pipelines undo the batch norm and the 2x2 patches first: the decode sees 32 channels at H/8.
    pytest.param(
        Flux2(variant="klein"), "black-forest-labs/FLUX.2-klein-base-4B", FLUX2_VAE, (1, 32, 128, 128), id="flux2"
    ),
    # Qwen-Image's video VAE decodes one frame: [1, 16, 1, H/8, W/8].
    pytest.param(QwenImage(), "Qwen/Qwen-Image", QWEN_IMAGE_VAE, (1, 16, 1, 128, 128), id="qwenimage"),
]


@pytest.mark.parametrize(("family", "hub_id", "vae_config", "latent_shape"), CASES)
def test_sample_decode_is_measured_at_1024(
    family: DiffusionFamily, hub_id: str, vae_config: dict[str, Any], latent_shape: tuple[int, ...]
) -> None:
    """At 1024x1024 the planned sampling transient is the measured one: the decode of the latents the family's
    pipeline passes to ``vae.decode`` (its VAE built from the family's ``vae_architecture``), the VAE's weights, and
    more than the family's hand estimate."""
    import diffusers

    from lightning_lora.families.base import build_from_config
    from lightning_lora.plan.live_bytes import flash_like_attention, peak_bytes

    assert family.planning.vae_architecture is vae_config
    source = ModelSource(hub_id, dtype=torch.bfloat16)
    recipe = ModelRecipe(family, source, lora=LoraOptions(rank=16, targets="attention"))
    skeleton = family.denoiser_skeleton(source)
    pieces = sampling_pieces(recipe, skeleton, 1024, 1024, 512)
    assert pieces is not None

    vae: Any = build_from_config(getattr(diffusers, vae_config["_class_name"]), vae_config, torch.bfloat16)
    latents = torch.empty(latent_shape, device="meta", dtype=torch.bfloat16)
    with flash_like_attention():
        decode, _ = peak_bytes(lambda: vae.decode(latents, return_dict=False)[0], torch.bfloat16)
    assert pieces.decode == decode
    assert pieces.vae_weights == sum(p.numel() * 2 for p in vae.parameters())
    # At least two bf16 copies of the decoder's full-resolution activation (128 channels for FLUX.2, 96 for Qwen-Image).
    widest = (vae_config.get("block_out_channels") or [vae_config.get("base_dim")])[0]
    assert pieces.decode > 2 * widest * 1024 * 1024 * 2
    planned = sampling_bytes(recipe, skeleton, 1024, 1024, 512)
    assert planned == pieces.total > family.sampling_bytes(skeleton, 1024, 1024, 512)


def test_flux2_klein_sampling_peak_matches_the_h200() -> None:
    """configs/flux2_klein_24gb.yaml (FLUX.2 klein base 4B in bf16, LoRA rank 16 on attention, AdamW; samples at
    1024x1024 with CFG) peaked at 11.11 GiB allocated while sampling on an H200 (2026-12-01); the hand estimate
    planned 9.60 GiB. The planned peak does not depend on the training size."""
    source = ModelSource("black-forest-labs/FLUX.2-klein-base-4B", dtype=torch.bfloat16)
    recipe = ModelRecipe(Flux2(variant="klein"), source, lora=LoraOptions(rank=16, targets="attention"))
    plan = plan_training(recipe, 256, 256, 1, 512, optimizer="AdamW", sample_size=(1024, 1024))
    assert plan.sampling_peak == pytest.approx(11.11, rel=0.05)


def test_bench_builds_the_families_vaes() -> None:
    """tools/bench.py draws its random VAEs from the families' configs (no copies of its own)."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench

    assert bench.vae_config("flux2") == FLUX2_VAE
    assert bench.vae_config("qwenimage") == QWEN_IMAGE_VAE
