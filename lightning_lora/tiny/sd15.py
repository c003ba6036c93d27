"""The tiny SD1.5 pipeline (see :mod:`lightning_lora.tiny` for the approach).

:func:`build_tiny_sd15` is an SD1.5-like pipeline: attention at the high-resolution level, 1x1-convolution
``proj_in``/``proj_out`` as in SD1.5, one CLIP encoder, ``PNDMScheduler`` as shipped with SD1.5
(``prediction_type="v_prediction"`` makes an SD2-768-like one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny import shared
from lightning_lora.tiny.shared import _build, _save_tiny, _tiny_clip_config, _tiny_sd_vae, make_clip_tokenizer

__all__ = ["RANDOM_SD15", "SD15_SCHEDULER_CONFIG", "build_tiny_sd15", "save_tiny_sd15"]

#: The scheduler config of the SD1.5 release (``scheduler/scheduler_config.json``: PNDM, scaled-linear betas).
SD15_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
}


def build_tiny_sd15(seed: int = 0, prediction_type: str = "epsilon") -> StableDiffusionPipeline:
    """An SD1.5-shaped ``StableDiffusionPipeline`` with tiny random weights (fp32, every component in ``eval()``).

    Args:
        seed: determines every weight.
        prediction_type: written into the scheduler config; ``v_prediction`` makes an SD2-768-like model.
    """
    tok = make_clip_tokenizer()
    width = 32
    unet = _build(seed, "unet", lambda: UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=2,
        attention_head_dim=4,
        use_linear_projection=False,  # SD1.5's proj_in / proj_out are 1x1 convolutions
        cross_attention_dim=width,
        norm_num_groups=8,
    ))  # fmt: skip
    text_encoder = _build(seed, "text_encoder", lambda: CLIPTextModel(_tiny_clip_config(tok, width)))
    return StableDiffusionPipeline(
        vae=_tiny_sd_vae(seed, scaling_factor=0.18215, force_upcast=False),
        text_encoder=text_encoder,
        tokenizer=tok,
        unet=unet,
        scheduler=PNDMScheduler(**{**SD15_SCHEDULER_CONFIG, "prediction_type": prediction_type}),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def save_tiny_sd15(folder: Path, seed: int = 0, prediction_type: str = "epsilon") -> Path:
    """Build the tiny SD1.5 pipeline and save it to ``folder`` (atomically, idempotent; see :func:`save_tiny_flux`)."""
    wanted = {"family": "sd15", "seed": seed, "prediction_type": prediction_type}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_sd15(seed, prediction_type), "SD1.5")


RANDOM_SD15 = RandomModels(
    denoiser="stable-diffusion-v1-5/stable-diffusion-v1-5",
    tiny_denoiser={
        "block_out_channels": (32, 32, 64, 64),
        "layers_per_block": 1,
        "attention_head_dim": 2,
        "cross_attention_dim": 64,
        "sample_size": 8,
    },
    tiny_vae=shared.SMALL_VAE,
    scheduler="PNDMScheduler",
    scheduler_config=SD15_SCHEDULER_CONFIG,
)
"""What the benchmark builds for SD1.5 with random weights (:meth:`lightning_lora.families.SD15.random_models`)."""
