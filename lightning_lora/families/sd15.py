"""SD1.5 (and SD1.x / SD2.x models of the same pipeline class): a UNet conditioned on one CLIP text encoder.

Shapes, for a batch ``B``: CLIP-L's last hidden state (after its final layer norm; with ``clip_skip`` an earlier
layer's) is ``prompt_embeds [B, 77, 768]`` (1024 for SD2's OpenCLIP-H), the UNet's cross-attention context. There is
no pooled embedding and no size conditioning. SD2-768 models predict ``v``; their scheduler config says so and is read.

Classifier-free guidance at sampling time uses the embedding of the empty prompt ``""`` as the negative, exactly like
``StableDiffusionPipeline`` with no negative prompt. The objective and LoRA presets are in
:mod:`lightning_lora.families.unet`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_lora.families.base import ModelSource, SampleSettings, SampleText, load_component, load_weights
from lightning_lora.families.encoders import CLIP_L
from lightning_lora.families.facts import Architecture, Compiling, LoraFiles, Planning, RandomModels
from lightning_lora.families.sdxl import SDXL_VAE
from lightning_lora.families.unet import UNetFamily, cross_attention_widths
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.kohya import KohyaLayout, KohyaNetwork, unet_from_kohya, unet_to_kohya

__all__ = ["SD15", "SD15_VAE"]


SD15_UNET: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 768,
}
"""Stable Diffusion 1.5's ``unet/config.json`` (the fields that decide shapes; 860 M parameters)."""

_HUB_IDS = ("stable-diffusion-v1-5/stable-diffusion-v1-5", "runwayml/stable-diffusion-v1-5")

SD15_VAE: dict[str, Any] = {**SDXL_VAE, "sample_size": 512, "scaling_factor": 0.18215}
"""Stable Diffusion 1.5's ``vae/config.json``: SDXL's VAE architecture (SDXL's VAE is a retrained SD VAE)."""


class SD15(UNetFamily):
    """Stable Diffusion 1.5 and models of its pipeline class (SD1.x fine-tunes, SD2.x): UNet-only LoRA.

    See :class:`~lightning_lora.families.unet.UNetFamily` for the options (prediction type, noise offset, min-SNR,
    zero terminal SNR, timestep range, clip skip) and the LoRA presets (``attention``, ``attention_ff``, ``locon``).
    """

    name: ClassVar[str] = "sd15"
    architecture: ClassVar[Architecture] = replace(
        UNetFamily.architecture,
        pipeline_classes=("StableDiffusionPipeline",),
        text_encoders=("text_encoder",),  # CLIP-L (OpenCLIP-H for SD2)
    )
    # The first transformer block's input: the first level's first attention.
    compiling: ClassVar[Compiling] = replace(
        UNetFamily.compiling, stream_sources=("down_blocks.0.attentions.0.proj_in",)
    )
    planning: ClassVar[Planning] = replace(
        UNetFamily.planning,
        known_denoisers=dict.fromkeys(_HUB_IDS, SD15_UNET),
        known_text_encoders=dict.fromkeys(_HUB_IDS, {"text_encoder": CLIP_L}),
        vae_architecture=SD15_VAE,
        # The whole forward's share of the eager count with the transformer blocks compiled and the ResNets eager (the
        # UNets' compiled regions): calibrated on an H100's 3.72 / 9.73 GiB at batch 2 / 8 (planned 3.86 / 9.36).
        compiled_saved_fraction=0.70,
    )
    # kohya: diffusers' module names with "_", as sd-scripts trains SD1.x.
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(
            DiffusersLayout("unet"),
            KohyaLayout(KohyaNetwork("networks.lora", "sd_v1"), to_kohya=unet_to_kohya, from_kohya=unet_from_kohya),
        ),
        modelspec={
            "architecture": "stable-diffusion-v1/lora",
            "implementation": "diffusers",  # what sd-scripts writes for an SD1.x LoRA (library/sai_model_spec.py)
        },
        markers=("sd_v1", "v1/"),  # kohya's sd_v1, ModelSpec's stable-diffusion-v1/lora
    )

    # -- loading -----------------------------------------------------------------------------------------------
    def load_text_encoders(self, source: ModelSource) -> Any:
        from diffusers import StableDiffusionPipeline
        from transformers import CLIPTextModel, CLIPTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        te = load_weights(CLIPTextModel.from_pretrained, source, "text_encoder", dtype=source.dtype)
        return StableDiffusionPipeline(
            vae=None,
            text_encoder=te.requires_grad_(False).eval(),
            tokenizer=load_component(CLIPTokenizer.from_pretrained, source, "tokenizer"),
            unet=None,
            scheduler=None,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.sd15 import save_tiny_sd15

        return save_tiny_sd15(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        te = encoders.text_encoder
        if self.clip_skip is None:
            prompt_embeds, _ = encoders.encode_prompt(
                prompts, te.device, num_images_per_prompt=1, do_classifier_free_guidance=False
            )
            return {"prompt_embeds": prompt_embeds}
        # What StableDiffusionPipeline.encode_prompt(clip_skip=k) computes: the hidden state k layers before the last,
        # through the final layer norm. (diffusers 0.42 reaches that norm as text_encoder.text_model.final_layer_norm,
        # which transformers 5 no longer has, so the pipeline's own path fails there.)
        tok = encoders.tokenizer
        ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt")
        hidden = te(ids.input_ids.to(te.device), output_hidden_states=True).hidden_states[-(self.clip_skip + 1)]
        final_layer_norm = getattr(te, "text_model", te).final_layer_norm
        return {"prompt_embeds": final_layer_norm(hidden).to(te.dtype)}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.sd15 import RANDOM_SD15

        return RANDOM_SD15

    def text_cache_tag(self) -> str:
        return f"sd15-{self._clip_tag()}"

    # -- interop -----------------------------------------------------------------------------------------------
    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """2 for a cross attention as wide as CLIP-L (768, SD1.x) or OpenCLIP-H (1024, SD2.x)."""
        return 2 if cross_attention_widths(tensors) & {768, 1024} else 0

    # -- training ----------------------------------------------------------------------------------------------
    def unet_conditions(
        self, batch: dict[str, torch.Tensor], latents: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, Any]:
        return {"encoder_hidden_states": batch["prompt_embeds"].to(dtype)}

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """CLIP-L's 77 tokens; no pooled vector."""
        return {"prompt_embeds": torch.randn(batch, 77, config["cross_attention_dim"], generator=generator).bfloat16()}

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def pipeline_options(self, source: ModelSource) -> dict[str, Any]:
        return {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}

    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        self._require_negative(text.negative, settings.guidance_scale)
        negative = None if text.negative is None else text.to_denoiser(text.negative["prompt_embeds"])
        return {
            "prompt_embeds": text.to_denoiser(text.embeddings["prompt_embeds"]),
            "negative_prompt_embeds": negative,
            "guidance_scale": settings.guidance_scale,
        }
