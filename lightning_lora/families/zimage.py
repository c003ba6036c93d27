"""Z-Image (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image): a single-stream flow-matching transformer with Qwen3 text.

Shapes, for an image of ``H x W`` pixels and a batch ``B``:

* The VAE is FLUX.1's: 16 channels, downsampling 8, latents ``[B, 16, H/8, W/8]`` normalized as
  ``(z - shift_factor) * scaling_factor`` (``ZImagePipeline`` decodes ``latents / scaling_factor + shift_factor``).
* The transformer (6.15 B parameters: ``dim`` 3840, 30 heads of 128) cuts each latent image into 2x2 patches, one
  token of 64 features each: ``(H/16) * (W/16)`` image tokens, so image sides are multiples of 16. It takes *lists*,
  one entry per sample: ``x[i]`` is ``[16, 1, H/8, W/8]`` (a frame axis of 1) and ``cap_feats[i]`` is ``[L_i, 2560]``,
  the caption's own tokens only. Inside, each sequence is padded to a multiple of 32 tokens with a learned pad token;
  2 *noise refiner* blocks see the image tokens alone, 2 *context refiner* blocks the caption tokens alone (no
  timestep modulation), then 30 main blocks the joint sequence ``[image; caption]`` (one stream, one set of weights).
  Rotary positions are 3-D: caption token ``j`` sits at ``(1 + j, 0, 0)``, image patch ``(r, c)`` at
  ``(L + 1, r, c)``, ``L`` the padded caption length.
* Text: Qwen3-4B (as ``Qwen3Model``) reads the prompt wrapped in Qwen's chat template
  (``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``), padded or cut to ``max_sequence_length``
  (512) tokens, and the *second-to-last* layer's hidden states of the real (unpadded) tokens are the caption features.
  The cache stores them padded to ``max_sequence_length`` with a mask, so batches stack: ``prompt_embeds [B, 512,
  2560]`` (zeros past the caption) and ``prompt_mask [B, 512]``; the loss and the sampler hand the transformer only
  the masked tokens, as the pipeline does.

The objective, and its signs
----------------------------
Rectified flow, as for FLUX (:mod:`lightning_lora.objectives`): ``x_sigma = (1 - sigma) * x0 + sigma * noise`` with the
noise level ``sigma`` in (0, 1). Two conventions differ from FLUX and are easy to get backwards:

* the *timestep* the transformer takes is ``t = 1 - sigma`` (1 = clean image, 0 = pure noise; it multiplies by
  ``t_scale`` = 1000 inside): ``ZImagePipeline`` feeds ``(1000 - scheduler_timestep) / 1000``;
* the transformer predicts ``x0 - noise``, the *negative* of the flow-matching velocity: the pipeline negates its
  output (``noise_pred = -noise_pred``) before the Euler step ``x += (sigma_next - sigma) * noise_pred``.

So the loss is ``MSE(transformer(x_sigma, 1 - sigma), x0 - noise)``; ``tests/families/test_zimage.py`` checks it against
the pipeline's own scheduler, timestep and sign. Noise levels are drawn like FLUX's ``flux_shift`` (a logit-normal draw
moved towards noise by ``shift``), but with Z-Image's *static* shift: its scheduler has ``use_dynamic_shifting: false``
and ``shift`` 3.0 (Turbo; the base model ships 6.0), whatever the image size.

Guidance: Z-Image-Turbo is distilled to sample without classifier-free guidance (``guidance_scale`` 0); the base model
samples with CFG (``pos + scale * (pos - neg)``, the empty prompt as negative), as :meth:`ZImage.generate` does when
``guidance_scale > 0``.

LoRA files: the diffusers layout (``transformer.<module>``: ``ZImagePipeline.load_lora_weights``; ComfyUI maps it only
in the releases that have its Z-Image LoRA rule) and the ComfyUI layout (``diffusion_model.<original module>``, q/k/v
fused into one ``qkv`` LoRA), which every ComfyUI release that runs Z-Image maps (:mod:`lightning_lora.formats.nextdit`
says which rule came when). LoKr and LoHa go in the ComfyUI layout only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_lora import objectives
from lightning_lora.errors import ConfigError
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
from lightning_lora.families.encoders import QWEN3_4B
from lightning_lora.families.facts import Architecture, Compiling, LoraFiles, Planning, RandomModels
from lightning_lora.families.flux import FLUX1_VAE, flux_vae_latents
from lightning_lora.formats.clients import COMFY_DORA, DIFFUSERS_DORA, Coverage, rules_unknown
from lightning_lora.formats.comfyui import ComfyLayout
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.kohya import separate_parts
from lightning_lora.formats.nextdit import comfy_target, zimage_from_comfy, zimage_lora_slices, zimage_slice
from lightning_lora.objectives import TimestepSampling

__all__ = ["ZIMAGE_TRANSFORMER", "ZImage", "caption_features"]

_BLOCK = r"(layers|noise_refiner|context_refiner)\.\d+"
_ATTENTION = r"attention\.(to_q|to_k|to_v|to_out\.0)"
_FEED_FORWARD = r"feed_forward\.(w1|w2|w3)"
_OWN_MODULES = re.compile(  # its blocks ("attention", not FLUX's "attn") and its own embedders and final layer
    r"(^|[._])((layers|noise_refiner|context_refiner)[._]\d+[._](attention|feed_forward|adaLN_modulation)"
    r"|all_x_embedder|all_final_layer|cap_embedder|t_embedder[._]mlp)[._]"
)

_HUB_IDS = ("Tongyi-MAI/Z-Image-Turbo", "Tongyi-MAI/Z-Image")
# The layers whose ComfyUI name is not their diffusers name: diffusers does not load them from a ComfyUI-layout file.
_NOT_DIFFUSERS_NAMED = re.compile(r"^(.*\.attention\.to_[qkv]|all_x_embedder\..*|all_final_layer\..*)$")
_COMFY_RULE = (
    "ComfyUI maps Z-Image's diffusers names only since its Z-Image LoRA rule (ComfyUI PR #10978; not in releases "
    "before 0.7): the comfyui-format file loads in every release"
)

ZIMAGE_TRANSFORMER: dict[str, Any] = {
    "_class_name": "ZImageTransformer2DModel",
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}
"""Tongyi-MAI/Z-Image-Turbo's ``transformer/config.json`` (6.15 B parameters); the base Tongyi-MAI/Z-Image has the same
(plus ``siglip_feat_dim: null``)."""


def caption_features(
    embeds: torch.Tensor, mask: torch.Tensor, device: torch.device | str, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The transformer's ``cap_feats``: for each sample of cached ``embeds [B, L, D]`` its masked tokens
    ``[L_i, D]`` (``mask [B, L]``), on ``device`` in ``dtype`` -- what ``ZImagePipeline.encode_prompt`` returns."""
    embeds = embeds.to(device=device, dtype=dtype)
    mask = mask.to(device=device, dtype=torch.bool)
    return [e[m] for e, m in zip(embeds, mask, strict=True)]


class ZImage(DiffusionFamily):
    """Z-Image-Turbo / Z-Image.

    Args:
        max_sequence_length: Qwen3 tokens per prompt, chat template included (the pipeline's 512); longer prompts are
            cut. Pass the same value to ``ZImagePipeline`` at inference if you change it.
        timestep_sampling: ``flux_shift`` (a logit-normal draw moved towards noise by ``shift``, as Z-Image's
            sampling schedule moves its steps), ``logit_normal`` (SD3) or ``uniform``.
        logit_mean: mean of the logit-normal draw.
        logit_std: standard deviation of the logit-normal draw.
        shift: the static shift of the model's scheduler (``scheduler/scheduler_config.json``): 3.0 for
            Z-Image-Turbo, 6.0 for the base Z-Image.
    """

    name: ClassVar[str] = "zimage"
    architecture: ClassVar[Architecture] = Architecture(
        pipeline_classes=("ZImagePipeline",),
        denoiser_class="ZImageTransformer2DModel",
        denoiser_subfolder="transformer",
        text_encoders=("text_encoder",),  # Qwen3-4B
        latent_divisor=16,
        lora_presets={
            # q, k, v and the output projection of every block (refiners and main blocks).
            "attention": rf".*{_BLOCK}\.{_ATTENTION}",
            # Plus each block's SwiGLU feed-forward (w1, w3 in, w2 out): every linear layer that mixes tokens' features.
            "attention_ff": rf".*{_BLOCK}\.({_ATTENTION}|{_FEED_FORWARD})",
            # Plus each block's timestep modulation (adaLN_modulation.0; the context refiners have none).
            "all_linear": rf".*{_BLOCK}\.({_ATTENTION}|{_FEED_FORWARD}|adaLN_modulation\.0)",
        },
        step_distilled={"Tongyi-MAI/Z-Image-Turbo": "Tongyi-MAI/Z-Image"},  # 8 steps, no guidance
    )
    compiling: ClassVar[Compiling] = Compiling(stream_sources=("all_x_embedder", "cap_embedder"))
    planning: ClassVar[Planning] = Planning(
        known_denoisers=dict.fromkeys(_HUB_IDS, ZIMAGE_TRANSFORMER),
        known_text_encoders=dict.fromkeys(_HUB_IDS, {"text_encoder": QWEN3_4B}),
        vae_architecture=FLUX1_VAE,  # Z-Image decodes with FLUX.1's VAE
        # Its six RMSNorms per block (four full-width "sandwich" norms, q and k) each keep a float32 copy of their input
        # in the eager forward, 37% of what a block saves; compiled, those fuse away. A full-width block (3840, 4608
        # tokens) compiled by inductor on the CPU kept 15.5 of the 31.1 units of one activation the eager forward keeps.
        compiled_saved_fraction=0.5,
    )
    # diffusers; ComfyUI's own names, which every ComfyUI release maps (see the module docstring).
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(DiffusersLayout("transformer"), ComfyLayout(slices=zimage_lora_slices, from_comfy=zimage_from_comfy)),
        tools=("diffusers", "ComfyUI"),  # sd-scripts has no network for it
        # The IDs kohya-ss/musubi-tuner writes for Z-Image LoRAs (src/musubi_tuner/utils/sai_model_spec.py).
        modelspec={"architecture": "Z-Image/lora", "implementation": "https://github.com/Tongyi-MAI/Z-Image"},
        markers=("Z-Image/",),  # ModelSpec's (musubi-tuner's, ours)
    )

    def __init__(
        self,
        max_sequence_length: int = 512,
        timestep_sampling: TimestepSampling = "flux_shift",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        shift: float = 3.0,
    ) -> None:
        option = "model.family.init_args"
        if max_sequence_length < 16:
            raise ConfigError(
                f"{option}.max_sequence_length: {max_sequence_length} leaves no room for a prompt (the chat template "
                "alone is 8 tokens); use 512, the pipeline's default."
            )
        if shift <= 0:
            raise ConfigError(f"{option}.shift: {shift} must be positive (3.0 for Z-Image-Turbo, 6.0 for Z-Image).")
        self.max_sequence_length = max_sequence_length
        self.timestep_sampling = timestep_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.shift = shift

    # -- loading -----------------------------------------------------------------------------------------------
    def load_text_encoders(self, source: ModelSource) -> Any:
        from diffusers import ZImagePipeline
        from transformers import AutoTokenizer, Qwen3Model
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

        text_encoder = load_weights(Qwen3Model.from_pretrained, source, "text_encoder", dtype=source.dtype)
        # A pipeline with only its text parts: encode_prompt is then exactly what inference does.
        return ZImagePipeline(
            scheduler=None,
            vae=None,
            text_encoder=text_encoder.requires_grad_(False).eval(),
            tokenizer=load_component(AutoTokenizer.from_pretrained, source, "tokenizer"),
            transformer=None,
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.zimage import save_tiny_zimage

        return save_tiny_zimage(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        device = encoders.text_encoder.device
        captions, _ = encoders.encode_prompt(  # a copy: the pipeline writes the templated prompts into the list
            prompt=list(prompts),
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        first = captions[0]
        embeds = first.new_zeros(len(captions), self.max_sequence_length, first.shape[-1])
        mask = torch.zeros(len(captions), self.max_sequence_length, dtype=torch.bool, device=first.device)
        for i, caption in enumerate(captions):
            embeds[i, : len(caption)] = caption
            mask[i, : len(caption)] = True
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.zimage import RANDOM_ZIMAGE

        return RANDOM_ZIMAGE

    @torch.no_grad()
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        return flux_vae_latents(vae, pixels)

    @property
    @override
    def text_tokens(self) -> int:
        return self.max_sequence_length

    @override
    def text_cache_tag(self) -> str:
        # The layer (second-to-last) and the chat template are fixed by the pipeline; the length is ours.
        return f"zimage-qwen3-chat-hidden-2-len{self.max_sequence_length}"

    @override
    def prompt_limit(self, encoders: Any) -> PromptLimit:
        tokenizer = encoders.tokenizer
        template = tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        overhead = len(tokenizer(template).input_ids)  # the template's own tokens, around every prompt
        return PromptLimit(tokenizer, self.max_sequence_length - overhead, "Qwen3")

    # -- training ----------------------------------------------------------------------------------------------
    def sample_timesteps(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Noise levels ``sigma`` (not the transformer's ``1 - sigma``), one per sample, on the CPU."""
        return objectives.sample_sigmas(
            latents.shape[0],
            self.timestep_sampling,
            generator=generator,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            shift=self.shift,
        )

    def predict(
        self, denoiser: DiffusersModel, batch: dict[str, torch.Tensor], noise: torch.Tensor, timesteps: torch.Tensor
    ) -> objectives.Prediction:
        x0 = batch["latents"].float()
        noise = noise.float()
        dtype = compute_dtype(denoiser)
        sigmas = timesteps.to(x0.device).float()
        noisy = objectives.flow_match_noisy(x0, noise, sigmas)
        prediction = denoiser(
            list(noisy.to(dtype).unsqueeze(2).unbind(0)),  # per sample [C, 1, h, w]
            1.0 - sigmas,  # the model's time runs from noise (0) to image (1); float32 as the pipeline feeds it
            caption_features(batch["prompt_embeds"], batch["prompt_mask"], x0.device, dtype),
            return_dict=False,
        )[0]
        # The negative velocity: x0 - noise (the pipeline negates the output before its Euler step).
        target = -objectives.flow_match_target(x0, noise)
        return objectives.Prediction(torch.stack(prediction).squeeze(2), target)

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        negative_embeds = None
        if settings.guidance_scale > 0:  # ZImagePipeline's CFG: pos + scale * (pos - neg), the empty prompt as negative
            if text.negative is None:
                raise ConfigError(
                    f"SampleImages guidance_scale: {settings.guidance_scale} needs the empty prompt's embeddings; use "
                    "0.0 (Z-Image-Turbo samples without guidance)."
                )
            negative_embeds = caption_features(
                text.negative["prompt_embeds"], text.negative["prompt_mask"], text.device, text.dtype
            )
        return {
            "prompt_embeds": caption_features(
                text.embeddings["prompt_embeds"], text.embeddings["prompt_mask"], text.device, text.dtype
            ),
            "negative_prompt_embeds": negative_embeds,
            "guidance_scale": settings.guidance_scale,
        }

    # -- interop -----------------------------------------------------------------------------------------------
    @override
    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        """diffusers loads its layout, and of a ComfyUI-layout file the plain LoRA layers whose original name is its
        own; ComfyUI loads its layout in every release, and a diffusers file only in the releases with its Z-Image rule
        (:mod:`lightning_lora.formats.nextdit`); sd-scripts nothing. DoRA loads as a plain LoRA where the DoRA
        magnitude is not read."""
        c = Coverage()
        modules = list(variants)
        dora = [m for m, v in variants.items() if v == "DoRA"]
        c.skip("kohya", modules, "sd-scripts reads lora_unet_<module> keys, and has no Z-Image network")
        if format == "diffusers":
            c.skip("ComfyUI", modules, _COMFY_RULE)
            return c
        if format != "comfyui":
            return rules_unknown(self.name, format, variants)
        slices = {m: zimage_slice(m, 1) for m in modules if comfy_target(m, 1) is not None}
        separate = separate_parts(variants, slices)
        c.skip(
            "ComfyUI",
            sorted(separate),
            f"no fused form (LoKr, or DoRA on part of q/k/v): per-part names. {_COMFY_RULE}",
        )
        c.approx("ComfyUI", dora, COMFY_DORA)
        if any(v == "LoHa" for v in variants.values()):
            c.skip("diffusers", modules, "diffusers' Z-Image converter refuses a file with LoHa tensors")
        renamed = [m for m in modules if _NOT_DIFFUSERS_NAMED.match(m)]
        c.skip("diffusers", renamed, "its ComfyUI name (the fused qkv, x_embedder, final_layer) is no diffusers module")
        lokr_out = [m for m, v in variants.items() if v == "LoKr" and m.endswith(".attention.to_out.0")]
        c.skip("diffusers", lokr_out, "diffusers' Z-Image converter renames attention.out for lora_down/up keys only")
        c.approx("diffusers", dora, DIFFUSERS_DORA)
        return c

    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """2 for Z-Image's own names: its blocks (``attention``, not FLUX's ``attn``) and its embedders and final
        layer, in any layout."""
        return 2 if any(_OWN_MODULES.search(k) for k in tensors) else 0

    # -- memory planning ---------------------------------------------------------------------------------------
    def example_inputs(
        self, model: DiffusersModel, batch: int, height: int, width: int, text_len: int, device: str, dtype: torch.dtype
    ) -> dict[str, Any]:
        """One forward's arguments; the batch tensors ``x [B, C, 1, h, w]`` and ``cap_feats [B, L, D]`` iterate as the
        per-sample lists the transformer takes."""
        c = model.config
        return {
            "x": torch.empty(batch, c.in_channels, 1, height // 8, width // 8, device=device, dtype=dtype),
            "t": torch.empty(batch, device=device, dtype=torch.float32),
            "cap_feats": torch.empty(batch, text_len, c.cap_feat_dim, device=device, dtype=dtype),
            "return_dict": False,
        }

    def block_count(self, model: DiffusersModel) -> int:
        return model.config.n_layers + 2 * model.config.n_refiner_layers

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Qwen3 features of ``text_len`` tokens, zeros to the cached length, with a bool mask."""
        embeds = torch.zeros(batch, self.max_sequence_length, config["cap_feat_dim"])
        embeds[:, :text_len] = torch.randn(batch, text_len, config["cap_feat_dim"], generator=generator)
        mask = (torch.arange(self.max_sequence_length) < text_len).expand(batch, -1)
        return {"prompt_embeds": embeds.bfloat16(), "prompt_mask": mask}

    @classmethod
    @override
    def text_length_options(cls, text_len: int) -> tuple[dict[str, Any], int]:
        # The denoiser sees the caption's tokens alone: the cache keeps its default length (512, the shipped configs').
        return {"max_sequence_length": max(text_len, 512)}, text_len

    def sampling_bytes(self, model: DiffusersModel, height: int, width: int, text_len: int) -> float:
        c = model.config
        tokens = (height // 16) * (width // 16) + text_len
        hidden = int(c.dim / 3 * 8)  # the SwiGLU width
        # The widest intermediates of a block (q, k, v, w1 and w3 outputs, bf16), for the CFG batch of 2, and the
        # VAE decode at full resolution (128 channels at full size, a few buffers), as for FLUX.
        block = tokens * (4 * c.dim + 2 * hidden) * 2 * 2
        vae = height * width * 128 * 2 * 4
        return float(block + vae + 84e6 * 2)
