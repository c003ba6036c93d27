"""SDXL (stable-diffusion-xl-base-1.0 and the models of its architecture): a UNet with two text encoders and size
conditioning.

Shapes, for a batch ``B`` (``D1``/``D2`` the text encoders' widths, 768 and 1280 for SDXL):

* Text: CLIP-L and OpenCLIP-G each encode the prompt (77 tokens); their *penultimate* hidden states are concatenated
  into ``prompt_embeds [B, 77, D1 + D2]`` (2048), the UNet's cross-attention context. OpenCLIP-G's projected pooled
  output is ``pooled_prompt_embeds [B, P]`` (1280).
* Micro-conditioning ("add_time_ids", SDXL paper section 2.2): six numbers per image, ``original_size (h, w)``,
  ``crop_top_left (top, left)`` and ``target_size (h, w)``, in pixels. Each is embedded like a timestep
  (``addition_time_embed_dim`` = 256 features), concatenated with the pooled text embedding (6 x 256 + 1280 = 2816)
  and added to the timestep embedding. Training on crops and small images with their true sizes lets inference ask
  for "an uncropped image at full size": ``(H, W), (0, 0), (H, W)``, what the diffusers pipeline passes by default.
* The batch carries ``original_size``, ``crop_top_left`` and ``target_size`` (int64 ``[B, 2]``) from the cache's
  bucket/crop records; a batch without them (an older cache) is treated as uncropped at the latent's size.

Classifier-free guidance at sampling time uses zeros as the negative embedding when the model's pipeline config says
``force_zeros_for_empty_prompt`` (SDXL base does), exactly like ``StableDiffusionXLPipeline`` with no negative prompt.
The objective and LoRA presets are in :mod:`lightning_lora.families.unet`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_lora.families.base import ModelSource, SampleSettings, SampleText, load_component, load_weights
from lightning_lora.families.encoders import CLIP_L, OPENCLIP_BIGG
from lightning_lora.families.facts import Architecture, Compiling, LoraFiles, Planning, RandomModels
from lightning_lora.families.flux import FLUX1_VAE
from lightning_lora.families.unet import UNetFamily, cross_attention_widths
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.kohya import KohyaLayout, KohyaNetwork, unet_from_kohya, unet_to_kohya
from lightning_lora.formats.ldm import SDXL_LAYOUT

__all__ = ["SDXL", "SDXL_VAE", "sdxl_time_ids"]

SIZE_KEYS = ("original_size", "crop_top_left", "target_size")


def sdxl_time_ids(original_size: torch.Tensor, crop_top_left: torch.Tensor, target_size: torch.Tensor) -> torch.Tensor:
    """SDXL's ``add_time_ids`` ``[B, 6]`` (float32): ``(orig_h, orig_w, crop_top, crop_left, target_h, target_w)``.

    Each argument is ``[B, 2]`` (or ``[2]`` for one image), in pixels.
    """
    parts = [torch.as_tensor(x).reshape(-1, 2).to(torch.float32) for x in (original_size, crop_top_left, target_size)]
    batch = max(p.shape[0] for p in parts)
    return torch.cat([p.expand(batch, 2) for p in parts], dim=1)


def default_size_conditioning(latents: torch.Tensor, vae_scale_factor: int = 8) -> dict[str, torch.Tensor]:
    """The size conditioning of uncropped images at the latents' size: ``(H, W), (0, 0), (H, W)`` per sample."""
    b, _, h, w = latents.shape
    size = torch.tensor([h * vae_scale_factor, w * vae_scale_factor], dtype=torch.int64, device=latents.device)
    return {
        "original_size": size.expand(b, 2),
        "crop_top_left": torch.zeros(b, 2, dtype=torch.int64, device=latents.device),
        "target_size": size.expand(b, 2),
    }


SDXL_BASE_UNET: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [320, 640, 1280],
    "layers_per_block": 2,
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}
"""SDXL base 1.0's ``unet/config.json`` (the fields that decide shapes; 2.6 B parameters)."""

SDXL_VAE: dict[str, Any] = {**FLUX1_VAE, "latent_channels": 4, "scaling_factor": 0.13025, "shift_factor": None}
SDXL_VAE.update(use_quant_conv=True, use_post_quant_conv=True)
"""SDXL base 1.0's ``vae/config.json``: FLUX.1's VAE architecture with 4 latent channels and the quant convolutions."""


class SDXL(UNetFamily):
    """SDXL base 1.0 and fine-tunes of its architecture (Pony, Illustrious, ...): UNet-only LoRA.

    See :class:`~lightning_lora.families.unet.UNetFamily` for the options (prediction type, noise offset, min-SNR,
    zero terminal SNR, timestep range, clip skip) and the LoRA presets (``attention``, ``attention_ff``, ``locon``).
    """

    name: ClassVar[str] = "sdxl"
    architecture: ClassVar[Architecture] = replace(
        UNetFamily.architecture,
        pipeline_classes=("StableDiffusionXLPipeline",),
        text_encoders=("text_encoder", "text_encoder_2"),  # CLIP-L, OpenCLIP-G
    )
    # The first transformer block's input: SDXL's first level has ResNets alone, its second the first attention.
    compiling: ClassVar[Compiling] = replace(
        UNetFamily.compiling, stream_sources=("down_blocks.1.attentions.0.proj_in",)
    )
    planning: ClassVar[Planning] = replace(
        UNetFamily.planning,
        known_denoisers={"stabilityai/stable-diffusion-xl-base-1.0": SDXL_BASE_UNET},
        known_text_encoders={
            "stabilityai/stable-diffusion-xl-base-1.0": {"text_encoder": CLIP_L, "text_encoder_2": OPENCLIP_BIGG}
        },
        vae_architecture=SDXL_VAE,
    )
    # kohya: the original SGM UNet's module names, as sd-scripts trains SDXL.
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(
            DiffusersLayout("unet"),
            KohyaLayout(
                KohyaNetwork("networks.lora", "sdxl_base_v1-0"),
                to_kohya=partial(unet_to_kohya, layout=SDXL_LAYOUT),
                from_kohya=partial(unet_from_kohya, layout=SDXL_LAYOUT),
            ),
        ),
        modelspec={
            "architecture": "stable-diffusion-xl-v1-base/lora",
            # what sd-scripts writes for an SDXL LoRA (library/sai_model_spec.py)
            "implementation": "https://github.com/Stability-AI/generative-models",
        },
        markers=("sdxl", "stable-diffusion-xl"),  # kohya's sdxl_base_v1-0, ModelSpec's
    )

    # -- loading -----------------------------------------------------------------------------------------------
    def load_text_encoders(self, source: ModelSource) -> Any:
        from diffusers import StableDiffusionXLPipeline
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        te = load_weights(CLIPTextModel.from_pretrained, source, "text_encoder", dtype=source.dtype)
        te2 = load_weights(CLIPTextModelWithProjection.from_pretrained, source, "text_encoder_2", dtype=source.dtype)
        # A pipeline with only its text parts: encode_prompt is then exactly what inference does.
        return StableDiffusionXLPipeline(
            vae=None,
            text_encoder=te.requires_grad_(False).eval(),
            text_encoder_2=te2.requires_grad_(False).eval(),
            tokenizer=load_component(CLIPTokenizer.from_pretrained, source, "tokenizer"),
            tokenizer_2=load_component(CLIPTokenizer.from_pretrained, source, "tokenizer_2"),
            unet=None,
            scheduler=None,
            add_watermarker=False,
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.sdxl import save_tiny_sdxl

        return save_tiny_sdxl(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        prompt_embeds, _, pooled, _ = encoders.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            device=encoders.text_encoder_2.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            clip_skip=self.clip_skip,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.sdxl import RANDOM_SDXL

        return RANDOM_SDXL

    def text_cache_tag(self) -> str:
        return f"sdxl-{self._clip_tag()}"

    # -- interop -----------------------------------------------------------------------------------------------
    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """2 for the original SGM UNet's names (``input_blocks``..., its size embedding) or a 2048-wide cross
        attention (CLIP-L and OpenCLIP-G side by side)."""
        sgm = ("input_blocks", "output_blocks", "middle_block", "label_emb", "add_embedding")
        if any(s in k for k in tensors for s in sgm):
            return 2
        return 2 if 2048 in cross_attention_widths(tensors) else 0

    # -- training ----------------------------------------------------------------------------------------------
    def unet_conditions(
        self, batch: dict[str, torch.Tensor], latents: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, Any]:
        sizes = default_size_conditioning(latents, self.vae_scale_factor)
        sizes.update({k: batch[k] for k in SIZE_KEYS if k in batch})
        time_ids = sdxl_time_ids(*(sizes[k] for k in SIZE_KEYS)).to(latents.device)
        pooled = batch["pooled_prompt_embeds"].to(dtype)
        return {
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
            "added_cond_kwargs": {"text_embeds": pooled, "time_ids": time_ids.to(dtype)},
        }

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """CLIP-L and OpenCLIP-G side by side, 77 tokens; the pooled vector is what the size conditioning leaves of the
        added embedding's input."""
        embeds = torch.randn(batch, 77, config["cross_attention_dim"], generator=generator)
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        return {
            "prompt_embeds": embeds.bfloat16(),
            "pooled_prompt_embeds": torch.randn(batch, pooled, generator=generator).bfloat16(),
        }

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def sampling_vae_dtype(self, vae_config: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
        # StableDiffusionXLPipeline decodes a float16 VAE in float32 when its config says force_upcast (SDXL's does).
        return torch.float32 if dtype == torch.float16 and vae_config.get("force_upcast", True) else dtype

    @override
    def pipeline_options(self, source: ModelSource) -> dict[str, Any]:
        from diffusers import StableDiffusionXLPipeline

        index = load_component(StableDiffusionXLPipeline.load_config, source, "")
        return {"force_zeros_for_empty_prompt": bool(index.get("force_zeros_for_empty_prompt", True))}

    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """The prompt's embeddings and the negative's (zeros when the model's pipeline config says
        ``force_zeros_for_empty_prompt``: what the pipeline does for "no negative prompt" with it)."""
        prompt = {k: text.to_denoiser(v) for k, v in text.embeddings.items()}
        negative = text.negative
        if pipeline.config.force_zeros_for_empty_prompt:
            negative = {k: torch.zeros_like(v) for k, v in prompt.items()}
        self._require_negative(negative, settings.guidance_scale)
        negative = {k: text.to_denoiser(v) for k, v in (negative or {}).items()}
        return {
            "prompt_embeds": prompt["prompt_embeds"],
            "pooled_prompt_embeds": prompt["pooled_prompt_embeds"],
            "negative_prompt_embeds": negative.get("prompt_embeds"),
            "negative_pooled_prompt_embeds": negative.get("pooled_prompt_embeds"),
            "guidance_scale": settings.guidance_scale,
        }
