"""FLUX.1 (dev and schnell): a rectified-flow transformer on packed VAE latents.

Shapes, for an image of ``H x W`` pixels and a batch ``B``:

* The VAE downsamples by 8 into 16 channels: latents ``[B, 16, H/8, W/8]``, normalized as
  ``(z - shift_factor) * scaling_factor``.
* The transformer sees 2x2 patches of those latents as tokens: *packing* turns ``[B, C, h, w]`` into
  ``[B, (h/2)(w/2), 4C]`` (64 features per token for the real model). So image sides must be multiples of 16.
* Each image token has an id ``(0, row, col)`` used by the rotary position embedding; text tokens have id ``(0, 0, 0)``.
* Text: T5-XXL gives ``prompt_embeds [B, L, 4096]`` (L = ``max_sequence_length``, 512 for dev) and CLIP-L gives
  ``pooled_prompt_embeds [B, 768]``.
* FLUX.1-dev is guidance-distilled: the guidance scale is an *input* (``guidance``), embedded like the timestep.
  Training with guidance 1.0 is the usual choice for LoRAs; samples use 3.5 as FLUX.1-dev does.
* Timesteps are noise levels ``sigma`` in (0, 1); the model multiplies them by 1000 inside.

The objective (rectified flow, timestep sampling) is in :mod:`lightning_lora.objectives`.

LoRA files: the diffusers layout (``transformer.<module>``, compact) loads in diffusers and, part by part, in ComfyUI
(which maps each diffusers name onto its row slice of BFL's fused weights); the kohya layout names modules as Black
Forest Labs' code does (:mod:`lightning_lora.formats.bfl`), q/k/v (and the single blocks' MLP input) fused as
sd-scripts needs them, and loads in ComfyUI, sd-scripts and diffusers. :meth:`Flux.lora_coverage` says which layers
each tool applies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_lora import objectives
from lightning_lora.families.base import (
    DiffusersModel,
    DiffusionFamily,
    ModelSource,
    PromptLimit,
    SampleSettings,
    SampleText,
    compute_dtype,
    load_component,
    load_weights,
)
from lightning_lora.families.encoders import CLIP_L, T5_XXL
from lightning_lora.families.facts import Architecture, Compiling, LoraFiles, Planning, RandomModels
from lightning_lora.formats.adapters import Adapter
from lightning_lora.formats.bfl import flux_lora_dims, flux_lora_slices, flux_slices_of
from lightning_lora.formats.clients import COMFY_DORA, COMFY_PEFT_DORA, DIFFUSERS_DORA, Coverage
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.kohya import KohyaLayout, KohyaNetwork, flux_from_kohya, fused_to_kohya, separate_parts
from lightning_lora.objectives import TimestepSampling

__all__ = [
    "FLUX1_VAE",
    "Flux",
    "flux_vae_latents",
    "latent_image_ids",
    "pack_latents",
    "unpack_latents",
    "with_control_tokens",
]

_ATTENTION = r"attn\.(to_q|to_k|to_v|to_out\.0)"
_TEXT_ATTENTION = r"attn\.(add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_MLP = r"(ff|ff_context)\.net\.(0\.proj|2)"
_SINGLE = r"(proj_mlp|proj_out)"
# The modules outside the blocks (diffusers' kohya converter drops them; sd-scripts makes no LoRA modules there).
DIFFUSERS_KOHYA_WIDTHS: tuple[int, int] | None = (3072, 12288)
"""The widths (inner, MLP) at which diffusers' kohya FLUX converter (``_convert_kohya_flux_lora_to_diffusers``) splits a
single block's fused ``linear1`` LoRA: it hard-codes FLUX.1's, and asserts they add up to the file's rows (None: any
widths, as tests make it read them: ``tests/helpers/diffusers_quirks.py``)."""

_LINEAR1_PART = re.compile(r"single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp)$")
"""The parts of a single block's fused ``linear1``."""

_OUTSIDE_BLOCKS = re.compile(r"^(x_embedder|context_embedder|time_text_embed\..+|proj_out|norm_out\.linear)$")
# The joint attention's layers of a diffusers file (Qwen-Image's blocks name theirs alike).
_JOINT_ATTENTION = re.compile(
    r"transformer\.transformer_blocks\.\d+\.attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)\."
)


FLUX1_TRANSFORMER: dict[str, Any] = {
    "_class_name": "FluxTransformer2DModel",
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
"""FLUX.1-dev's ``transformer/config.json`` (12 B parameters); schnell differs only in ``guidance_embeds``."""

FLUX1_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}
"""FLUX.1-dev's (and schnell's) ``vae/config.json`` (84 M parameters; Z-Image uses the same VAE)."""


@torch.no_grad()
def flux_vae_latents(vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
    """The cached latents of ``pixels`` ([-1, 1]) through FLUX.1's VAE (FLUX.1, Z-Image, Chroma): the posterior's mean,
    not a sample (deterministic, so a content-hashed cache entry has one right value), shifted and scaled as the
    pipelines do before the transformer; float32."""
    posterior = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
    z = posterior.mode()
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]``: each 2x2 latent patch becomes one token."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for a latent grid of ``h x w``."""
    b, _, f = tokens.shape
    x = tokens.view(b, h // 2, w // 2, f // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, f // 4, h, w)


def latent_image_ids(
    h: int, w: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Position ids ``[(h/2)(w/2), 3]`` = ``(0, row, col)`` of the packed tokens of an ``h x w`` latent grid."""
    rows = torch.arange(h // 2, device=device).repeat_interleave(w // 2)
    cols = torch.arange(w // 2, device=device).repeat(h // 2)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1)
    return ids.to(dtype)


def with_control_tokens(inputs: dict[str, Any], controls: int) -> dict[str, Any]:
    """A packed transformer's example inputs (``hidden_states [B, N, C]``, ``img_ids [N, D]``: FLUX.1's and FLUX.2's)
    with the tokens of ``controls`` images of the target's size appended, as their edit pipelines append them (twice
    the image tokens for one); shapes only, for the planner."""
    if controls:
        hidden, ids = inputs["hidden_states"], inputs["img_ids"]
        inputs["hidden_states"] = hidden.new_empty(hidden.shape[0], hidden.shape[1] * (1 + controls), hidden.shape[2])
        inputs["img_ids"] = ids.new_zeros(ids.shape[0] * (1 + controls), ids.shape[1])
    return inputs


class Flux(DiffusionFamily):
    """FLUX.1-dev / FLUX.1-schnell.

    Args:
        guidance: the guidance value fed to a guidance-distilled model (FLUX.1-dev) during training.
        max_sequence_length: T5 tokens per prompt (512 for dev, 256 for schnell); longer prompts are truncated.
        timestep_sampling: ``flux_shift`` (logit-normal, shifted by image size like FLUX's sampler), ``logit_normal``
            (SD3) or ``uniform``.
        logit_mean: mean of the logit-normal draw.
        logit_std: standard deviation of the logit-normal draw.
        shift: a fixed shift for ``flux_shift``; null means FLUX's resolution-dependent value.
    """

    name: ClassVar[str] = "flux"
    architecture: ClassVar[Architecture] = Architecture(
        pipeline_classes=("FluxPipeline",),
        denoiser_class="FluxTransformer2DModel",
        denoiser_subfolder="transformer",
        text_encoders=("text_encoder", "text_encoder_2"),  # CLIP-L (pooled), T5-XXL
        latent_divisor=16,
        lora_presets={
            # The set the public FLUX LoRA recipes (and our reference benchmark) use.
            "attention": rf".*transformer_blocks\.\d+\.{_ATTENTION}",
            # Plus the text stream's projections in the double blocks.
            "attention_all": rf".*transformer_blocks\.\d+\.({_ATTENTION}|{_TEXT_ATTENTION})",
            # Every linear layer inside the blocks (attention, feed-forward, single-block MLP and output).
            "all_linear": rf".*(transformer_blocks\.\d+\.({_ATTENTION}|{_TEXT_ATTENTION}|{_MLP}|{_SINGLE}))",
        },
        step_distilled={"black-forest-labs/FLUX.1-schnell": ""},  # 4 steps; no undistilled schnell is published
    )
    compiling: ClassVar[Compiling] = Compiling(
        stream_sources=("x_embedder", "context_embedder"), joined_streams=("transformer_blocks",)
    )
    planning: ClassVar[Planning] = Planning(
        known_denoisers={
            "black-forest-labs/FLUX.1-dev": FLUX1_TRANSFORMER,
            "black-forest-labs/FLUX.1-schnell": {**FLUX1_TRANSFORMER, "guidance_embeds": False},
        },
        known_text_encoders=dict.fromkeys(
            ("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell"),
            {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL},
        ),
        vae_architecture=FLUX1_VAE,
    )
    # diffusers: compact, loads in diffusers and (part by part) in ComfyUI; kohya: BFL module names, q/k/v (and the
    # single blocks' MLP input) fused, as sd-scripts needs them.
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(
            DiffusersLayout("transformer"),
            KohyaLayout(
                KohyaNetwork("networks.lora_flux", "flux1"),
                to_kohya=partial(fused_to_kohya, slices=flux_lora_slices),
                from_kohya=flux_from_kohya,
            ),
        ),
        modelspec={"architecture": "flux-1-dev/lora", "implementation": "https://github.com/black-forest-labs/flux"},
        markers=("flux",),  # kohya's flux1, ModelSpec's flux-1-dev/lora and flux-1-schnell/lora
    )

    def __init__(
        self,
        guidance: float = 1.0,
        max_sequence_length: int = 512,
        timestep_sampling: TimestepSampling = "flux_shift",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        shift: float | None = None,
    ) -> None:
        self.guidance = guidance
        self.max_sequence_length = max_sequence_length
        self.timestep_sampling = timestep_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.shift = shift

    # -- loading -----------------------------------------------------------------------------------------------
    def load_text_encoders(self, source: ModelSource) -> Any:
        from diffusers import FluxPipeline
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast  # type: ignore[attr-defined]
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

        te = load_weights(CLIPTextModel.from_pretrained, source, "text_encoder", dtype=source.dtype)
        te2 = load_weights(T5EncoderModel.from_pretrained, source, "text_encoder_2", dtype=source.dtype)
        # A pipeline with only its text parts: encode_prompt is then exactly what inference does.
        return FluxPipeline(
            scheduler=None,
            vae=None,
            text_encoder=te.requires_grad_(False).eval(),
            tokenizer=load_component(CLIPTokenizer.from_pretrained, source, "tokenizer"),
            text_encoder_2=te2.requires_grad_(False).eval(),
            tokenizer_2=load_component(T5TokenizerFast.from_pretrained, source, "tokenizer_2"),
            transformer=None,
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.flux import save_tiny_flux

        return save_tiny_flux(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        device = encoders.text_encoder_2.device
        prompt_embeds, pooled, _ = encoders.encode_prompt(
            prompt=prompts, prompt_2=prompts, device=device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.flux import RANDOM_FLUX

        return RANDOM_FLUX

    @torch.no_grad()
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        return flux_vae_latents(vae, pixels)

    @property
    @override
    def text_tokens(self) -> int:
        return self.max_sequence_length

    @override
    def text_cache_tag(self) -> str:
        return f"flux-t5len{self.max_sequence_length}"

    def prompt_limit(self, encoders: Any) -> PromptLimit:
        # T5 carries the prompt (CLIP-L gives only the pooled vector, from its first 77 tokens).
        return PromptLimit(encoders.tokenizer_2, self.max_sequence_length, "T5")

    # -- training ----------------------------------------------------------------------------------------------
    def sample_timesteps(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        b, _, h, w = latents.shape
        shift = self.shift if self.shift is not None else objectives.resolution_shift((h // 2) * (w // 2))
        return objectives.sample_sigmas(
            b,
            self.timestep_sampling,
            generator=generator,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            shift=shift,
        )

    @override
    def prediction_layout(self, latent_map: torch.Tensor) -> torch.Tensor:
        """Packed as the latents are (:func:`pack_latents`)."""
        return pack_latents(latent_map)

    def predict(
        self, denoiser: DiffusersModel, batch: dict[str, torch.Tensor], noise: torch.Tensor, timesteps: torch.Tensor
    ) -> objectives.Prediction:
        x0 = batch["latents"]
        b, _, h, w = x0.shape
        dtype = compute_dtype(denoiser)
        sigmas = timesteps.to(x0.device)
        noisy = objectives.flow_match_noisy(x0.float(), noise.float(), sigmas)
        text = batch["prompt_embeds"]
        guidance = None
        if getattr(denoiser.config, "guidance_embeds", False):
            guidance = torch.full((b,), self.guidance, device=x0.device, dtype=dtype)
        tokens = pack_latents(noisy)
        hidden, ids = self.with_controls(tokens, latent_image_ids(h, w, device=x0.device), batch.get("controls"))
        prediction = denoiser(
            hidden_states=hidden.to(dtype),
            timestep=sigmas.to(dtype),
            guidance=guidance,
            pooled_projections=batch["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=text.to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=x0.device, dtype=dtype),
            img_ids=ids.to(dtype),
            return_dict=False,
        )[0][:, : tokens.shape[1]]  # the control tokens' outputs are not predicted: the pipeline drops them
        target = pack_latents(objectives.flow_match_target(x0.float(), noise.float()))
        return objectives.Prediction(prediction, target)

    def with_controls(
        self, tokens: torch.Tensor, ids: torch.Tensor, controls: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed image ``tokens [B, n, 4C]`` and their ``ids [n, 3]`` with a batch's control latents ``[B, N, C,
        h, w]`` appended as an edit variant's pipeline appends them (:class:`~lightning_lora.families.kontext.
        FluxKontext`); FLUX.1 itself takes none."""
        if controls is not None:
            raise ValueError(f"the {self.name} family takes no control images (edit training: FluxKontext)")
        return tokens, ids

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """The prompt's embeddings and ``guidance_scale``, FLUX.1-dev's distilled guidance input (no negative
        prompt)."""
        return {
            "prompt_embeds": text.to_denoiser(text.embeddings["prompt_embeds"]),
            "pooled_prompt_embeds": text.to_denoiser(text.embeddings["pooled_prompt_embeds"]),
            "guidance_scale": settings.guidance_scale,
        }

    # -- interop: what diffusers, ComfyUI and sd-scripts make of a FLUX LoRA file (lightning_lora.formats.clients) --
    @override
    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        c = Coverage()
        modules = list(variants)
        outside = [m for m in modules if _OUTSIDE_BLOCKS.match(m)]
        dora = [m for m, v in variants.items() if v == "DoRA"]
        lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
        if format == "diffusers":
            c.approx("ComfyUI", dora, COMFY_PEFT_DORA)
            c.skip("kohya", modules, "sd-scripts reads lora_unet_<BFL module> keys, not diffusers names")
            return c
        separate = sorted(separate_parts(variants, flux_slices_of(variants)))
        c.skip("diffusers", lycoris, "diffusers' kohya converter reads lora_down/lora_up only")
        c.skip("diffusers", separate, "diffusers' kohya converter reads lora_unet_ keys only")
        c.skip(
            "kohya",
            separate,
            "no fused form (LoKr, or DoRA on part of q/k/v/mlp): written under ComfyUI's per-part names",
        )
        c.skip("diffusers", outside, "diffusers' kohya FLUX converter drops the layers outside the blocks")
        c.approx("diffusers", dora, DIFFUSERS_DORA)
        c.approx("ComfyUI", dora, COMFY_DORA)
        plain = [m for m in outside if variants[m] == "LoRA"]  # DoRA/LoKr/LoHa load through LyCORIS: every module
        c.skip("kohya", plain, "networks/lora_flux.py makes LoRA modules inside the double/single blocks only")
        return c

    @override
    def file_coverage(self, format: str, adapters: Mapping[str, Adapter]) -> Coverage:
        """:meth:`lora_coverage`, and for a kohya file with layers of the single blocks' fused ``linear1`` (q, k, v,
        MLP) the widths diffusers' converter takes (:data:`DIFFUSERS_KOHYA_WIDTHS`): at other widths (a tiny test
        model's) it refuses the whole file, so the file is not said to load there."""
        coverage = super().file_coverage(format, adapters)
        widths = DIFFUSERS_KOHYA_WIDTHS
        if format != "kohya" or widths is None or not any(_LINEAR1_PART.search(m) for m in adapters):
            return coverage
        dims = flux_lora_dims(adapters)
        if (dims.inner_dim, dims.mlp_hidden_dim) != widths:
            why = (
                f"diffusers' kohya FLUX converter splits single_blocks' linear1 at FLUX.1's widths {widths}, and "
                f"this model's are ({dims.inner_dim}, {dims.mlp_hidden_dim}): it refuses the file"
            )
            coverage.skipped["diffusers"] = dict.fromkeys(adapters, why)
            coverage.approximate["diffusers"] = {}
        return coverage

    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """1 for FLUX's module names (diffusers' under ``transformer.``, BFL's ``double_blocks`` / ``single_blocks``),
        which the other transformer families' files share in part; 0 for joint-attention layers alone, which
        Qwen-Image names alike."""
        keys = list(tensors)
        if not any(k.startswith("transformer.") or "double_blocks" in k or "single_blocks" in k for k in keys):
            return 0
        return 0 if all(_JOINT_ATTENTION.match(k) for k in keys) else 1

    # -- memory planning ---------------------------------------------------------------------------------------
    def example_inputs(
        self, model: DiffusersModel, batch: int, height: int, width: int, text_len: int, device: str, dtype: torch.dtype
    ) -> dict[str, Any]:
        c = model.config
        h, w = height // 8, width // 8
        tokens = (h // 2) * (w // 2)
        return {
            "hidden_states": torch.empty(batch, tokens, c.in_channels, device=device, dtype=dtype),
            "encoder_hidden_states": torch.empty(batch, text_len, c.joint_attention_dim, device=device, dtype=dtype),
            "pooled_projections": torch.empty(batch, c.pooled_projection_dim, device=device, dtype=dtype),
            "timestep": torch.empty(batch, device=device, dtype=dtype),
            "guidance": torch.empty(batch, device=device, dtype=dtype) if c.guidance_embeds else None,
            "img_ids": torch.empty(tokens, 3, device=device, dtype=dtype),
            "txt_ids": torch.empty(text_len, 3, device=device, dtype=dtype),
            "return_dict": False,
        }

    def block_count(self, model: DiffusersModel) -> int:
        return model.config.num_layers + model.config.num_single_layers

    @override
    def cached_latent_shape(self, config: Mapping[str, Any], height: int, width: int) -> tuple[int, int, int]:
        return (config["in_channels"] // 4, height // 8, width // 8)  # 2x2 patches of 16 channels packed

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """T5 padded to ``text_len`` (the denoiser attends over every position), CLIP's pooled vector."""
        embeds = torch.randn(batch, text_len, config["joint_attention_dim"], generator=generator)
        pooled = torch.randn(batch, config["pooled_projection_dim"], generator=generator)
        return {"prompt_embeds": embeds.bfloat16(), "pooled_prompt_embeds": pooled.bfloat16()}

    @classmethod
    @override
    def text_length_options(cls, text_len: int) -> tuple[dict[str, Any], int]:
        return {"max_sequence_length": text_len}, text_len

    def sampling_bytes(self, model: DiffusersModel, height: int, width: int, text_len: int) -> float:
        c = model.config
        tokens = (height // 16) * (width // 16) + text_len
        inner = c.num_attention_heads * c.attention_head_dim
        # The widest intermediates of a single block (qkv + 4x MLP, bf16) and the VAE decode at full resolution
        # (128 channels at full size, a few buffers).
        block = tokens * (3 * inner + 4 * inner + inner) * 2 * 2
        vae = height * width * 128 * 2 * 4
        return float(block + vae + 84e6 * 2)
