"""The tiny SDXL pipeline (see :mod:`lightning_lora.tiny` for the approach).

:func:`build_tiny_sdxl` keeps SDXL's real UNet *layout* (three levels: no attention, then two with attention;
two ResNets per level; the LDM/kohya block numbering depends on that) at tiny widths, with two CLIP text encoders of
different widths (the UNet's cross-attention width is their sum; the pooled embedding is the second's projection)
and SDXL's real scheduler (``EulerDiscreteScheduler``, scaled-linear betas).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny.shared import (
    SMALL_VAE,
    _build,
    _save_tiny,
    _tiny_clip_config,
    _tiny_sd_vae,
    make_clip_tokenizer,
)

__all__ = ["RANDOM_SDXL", "SDXL_SCHEDULER_CONFIG", "build_tiny_sdxl", "save_tiny_sdxl"]

#: The scheduler config of stabilityai/stable-diffusion-xl-base-1.0 (``scheduler/scheduler_config.json``).
SDXL_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "interpolation_type": "linear",
    "timestep_spacing": "leading",
    "steps_offset": 1,
    "use_karras_sigmas": False,
}


def build_tiny_sdxl(seed: int = 0) -> StableDiffusionXLPipeline:
    """An SDXL-shaped ``StableDiffusionXLPipeline`` with tiny random weights (fp32, every component in ``eval()``).

    The UNet has SDXL's block layout (see the module docstring); the text encoders are 32 (CLIP-L's place) and 48
    (OpenCLIP-G's place, with a 32-wide projection for the pooled embedding) wide, so the cross-attention width is
    80 and the added-embedding input is ``6 * 8`` (time ids) ``+ 32`` (pooled) = 80.
    """
    tok = make_clip_tokenizer()
    tok_2 = make_clip_tokenizer(pad_token="!")
    te_width, te2_width, pooled = 32, 48, 32
    time_dim = 8
    unet = _build(seed, "unet", lambda: UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32, 32),
        layers_per_block=2,
        attention_head_dim=(2, 4, 4),
        transformer_layers_per_block=(1, 1, 2),
        use_linear_projection=True,
        cross_attention_dim=te_width + te2_width,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + pooled,
        norm_num_groups=8,
    ))  # fmt: skip
    text_encoder = _build(seed, "text_encoder", lambda: CLIPTextModel(_tiny_clip_config(tok, te_width)))
    text_encoder_2 = _build(seed, "text_encoder_2", lambda: CLIPTextModelWithProjection(
        _tiny_clip_config(tok_2, te2_width, projection_dim=pooled, hidden_act="gelu")
    ))  # fmt: skip
    return StableDiffusionXLPipeline(
        vae=_tiny_sd_vae(seed, scaling_factor=0.13025, force_upcast=True),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tok,
        tokenizer_2=tok_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER_CONFIG),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )


def save_tiny_sdxl(folder: Path, seed: int = 0) -> Path:
    """Build the tiny SDXL pipeline and save it to ``folder`` (atomically, idempotent; see :func:`save_tiny_flux`)."""
    return _save_tiny(Path(folder), {"family": "sdxl", "seed": seed}, lambda: build_tiny_sdxl(seed=seed), "SDXL")


RANDOM_SDXL = RandomModels(
    denoiser="stabilityai/stable-diffusion-xl-base-1.0",
    tiny_denoiser={
        "block_out_channels": (32, 64, 64),
        "transformer_layers_per_block": (1, 1, 1),
        "attention_head_dim": (2, 4, 4),
        "cross_attention_dim": 64,
        "addition_time_embed_dim": 32,
        "projection_class_embeddings_input_dim": 64 + 6 * 32,
    },
    tiny_vae=SMALL_VAE,
    scheduler="EulerDiscreteScheduler",
    scheduler_config=SDXL_SCHEDULER_CONFIG,
)
"""What the benchmark builds for SDXL with random weights (:meth:`lightning_lora.families.SDXL.random_models`)."""
