"""Qwen-Image: a 20 B-parameter MMDiT (60 dual-stream blocks) on packed latents of a video VAE, conditioned on the last
hidden state of Qwen2.5-VL-7B read text-only through a chat template.

Shapes, for an image of ``H x W`` pixels and a batch ``B``:

* The VAE (``AutoencoderKLQwenImage``: causal 3D convolutions, made for videos ``[B, 3, T, H, W]``) sees an image as
  one frame and downsamples by 8 into ``z_dim = 16`` channels: ``[B, 16, 1, H/8, W/8]``. Latents are normalised *per
  channel* with the VAE config's 16 ``latents_mean`` / ``latents_std`` values: ``(z - mean_c) / std_c`` (the pipeline
  decodes ``x * std_c + mean_c``). The cache keeps them without the frame axis: ``[B, 16, H/8, W/8]``.
* The transformer sees 2x2 latent patches as tokens, packed exactly as FLUX packs them (:func:`pack_latents`):
  ``[B, (h/2)(w/2), 64]``. So image sides must be multiples of 16.
* Positions are not ids but ``img_shapes``: per sample, the ``(frames, rows, cols)`` of its packed image,
  ``[[(1, h/2, w/2)]] * B``, from which the transformer builds its 3-axis RoPE (rows and columns centred on 0); text
  positions continue after the largest image index.
* Text: the pipeline puts the prompt into a chat template (a system turn "Describe the image by detailing the color,
  shape, size, texture, quantity, text, spatial relationships of the objects and background:", then the prompt as the
  user turn, then the assistant turn's header), runs Qwen2.5-VL (28 layers, 3584 wide) on it and keeps the last hidden
  state without the template's first 34 tokens (``prompt_template_encode_start_idx``: the system turn and the user
  header). What remains is the prompt's tokens plus the 5 that close the template, at most ``max_sequence_length``
  (512): ``prompt_embeds [B, L, 3584]`` with ``prompt_embeds_mask [B, L]`` (1 for real tokens), ``L`` the longest
  prompt of the batch. There is no pooled vector.
* Timesteps are noise levels ``sigma`` in (0, 1); the transformer multiplies them by 1000 inside (the pipeline feeds
  ``t / 1000`` for its scheduler's ``t = 1000 sigma``).
* The prediction is the velocity ``noise - x0`` of the straight path ``x = (1 - sigma) x0 + sigma noise`` (the
  scheduler's Euler step is ``x + (sigma_next - sigma) * prediction``), the same rectified-flow objective as FLUX
  (:mod:`lightning_lora.objectives`).
* Qwen-Image is not guidance-distilled (``guidance_embeds`` false): samples use classifier-free guidance,
  ``true_cfg_scale`` with the empty prompt as the negative; the pipeline rescales the guided prediction to the norm of
  the conditional one, token by token.

Timestep shift: Qwen-Image's scheduler shifts its sigmas by ``exp(mu)`` (``sigma' = e^mu sigma / (1 + (e^mu - 1)
sigma)``), with ``mu`` linear in the image tokens from 0.5 at 256 tokens to 0.9 at 8192 (FLUX: 1.15 at 4096), so at
1024x1024 (4096 tokens) the shift is 2.0. ``timestep_sampling: qwen_shift`` (the default) draws logit-normal sigmas
and shifts them the same way, so training sees the noise levels inference uses (musubi-tuner's ``qwen_shift``; the
scheduler's ``shift_terminal`` 0.02 only stretches the end of the inference schedule).

Cached text and batches: prompts have different lengths, and a batch of cached tensors is stacked by the default
collate. So each prompt's embeddings are cached padded with zeros to ``max_sequence_length`` with their mask
(``prompt_embeds [512, 3584]`` in the encoder's dtype, 3.5 MiB in bf16, as FLUX's padded T5 embeddings), and
:meth:`QwenImage.loss` cuts the batch back to its longest prompt (:func:`trim_text`), passing the mask only when the
prompts' lengths differ: the transformer computes what the pipeline computes for the same prompts, and never attends
over 512 positions for a 20-token caption. (Under ``model.compile_blocks`` the text length varies between batches: the
first new length recompiles once, after which PyTorch compiles for dynamic lengths.)

LoRA files: ComfyUI builds Qwen-Image with diffusers' module names (diffusers' ``from_single_file`` reads ComfyUI's
checkpoints unconverted), and ``comfy/lora.py`` maps a Qwen-Image LoRA's ``transformer.<module>`` keys onto them, but
only since ComfyUI 0.3.50 (PR #9208): 0.3.49, the first release that runs Qwen-Image, leaves every key of a diffusers
file "not loaded", so that file does not claim ComfyUI. The ``kohya`` layout is musubi-tuner's
(``networks.lora_qwen_image``): ``lora_unet_<module with _>`` with one ``.alpha`` per module, which ComfyUI maps for
every model in every release and diffusers' Qwen-Image converter reads (plain LoRA); it also holds LoKr and LoHa
(LyCORIS tensors), which only ComfyUI applies. See :meth:`QwenImage.lora_coverage`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from safetensors import safe_open
from torch import nn
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
from lightning_lora.families.encoders import QWEN25_VL_7B
from lightning_lora.families.facts import Architecture, Compiling, LoraFiles, Planning, RandomModels
from lightning_lora.families.flux import pack_latents, unpack_latents
from lightning_lora.formats.clients import COMFY_DORA, DIFFUSERS_DORA, Coverage
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.kohya import KohyaLayout, KohyaNetwork, from_kohya_by, unet_to_kohya

__all__ = [
    "QWEN_IMAGE_NETWORK",
    "QWEN_IMAGE_TRANSFORMER",
    "QWEN_IMAGE_VAE",
    "QwenImage",
    "QwenTimestepSampling",
    "image_shapes",
    "pack_latents",
    "trim_text",
    "unpack_latents",
]

QwenTimestepSampling = Literal["qwen_shift", "logit_normal", "uniform"]

_ATTENTION = r"attn\.(to_q|to_k|to_v|to_out\.0)"
_TEXT_KV = r"attn\.(add_k_proj|add_v_proj)"
_IMAGE_MLP = r"img_mlp\.net\.(0\.proj|2)"
_OWN_MODULES = re.compile(r"transformer_blocks[._]\d+[._](img|txt)_(mlp|mod)[._]")

QWEN_IMAGE_TRANSFORMER: dict[str, Any] = {
    "_class_name": "QwenImageTransformer2DModel",
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
"""Qwen/Qwen-Image's ``transformer/config.json`` (20.4 B parameters)."""

QWEN_IMAGE_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKLQwenImage",
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
}
"""Qwen/Qwen-Image's ``vae/config.json`` (the class's defaults, its 16 ``latents_mean`` / ``latents_std`` too): 8x
down (2x per level after the first of ``dim_mult``) into ``z_dim`` channels, one frame per image; the decode's input
is :meth:`QwenImage.sampling_latent_shape`."""

QWEN_IMAGE_NETWORK = KohyaNetwork("networks.lora_qwen_image", "qwen_image")
"""kohya metadata of a Qwen-Image file: musubi-tuner's network module (sd-scripts has no Qwen-Image network)."""

_COMFY_RULE = (
    "ComfyUI maps Qwen-Image's diffusers names only since its Qwen-Image LoRA rule (ComfyUI PR #9208, in 0.3.50; "
    "0.3.49 runs Qwen-Image without it): the kohya-format file loads in every release"
)

# Qwen/Qwen-Image's scheduler_config.json: the dynamic shift's mu is linear from base_shift (0.5) at
# base_image_seq_len (256) image tokens to max_shift (0.9) at max_image_seq_len (8192);
# lightning_lora.tiny.qwenimage.QWEN_IMAGE_SCHEDULER_CONFIG holds the whole file.
_BASE_TOKENS, _MAX_TOKENS, _BASE_SHIFT, _MAX_SHIFT = 256, 8192, 0.5, 0.9
# Prefixes a single-file checkpoint may put before the transformer's own names (a ComfyUI all-in-one checkpoint).
_SINGLE_FILE_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def image_shapes(batch: int, h: int, w: int) -> list[list[tuple[int, int, int]]]:
    """The transformer's ``img_shapes`` for a batch of ``h x w`` latent grids: one frame of ``(h/2) x (w/2)`` packed
    tokens per sample, as the pipeline builds it."""
    return [[(1, h // 2, w // 2)]] * batch


def trim_text(embeds: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cut cached text ``[B, L, D]`` (padded to ``max_sequence_length``) to the batch's longest prompt, with its mask
    ``[B, n]`` as bool, or ``None`` when every prompt fills the ``n`` positions (the pipeline passes no mask then)."""
    if mask is None:
        return embeds, None
    n = max(int(mask.sum(dim=1).max()), 1)
    kept = mask[:, :n].bool()
    return embeds[:, :n], None if bool(kept.all()) else kept


@functools.cache
def _template() -> tuple[str, int, int]:
    """The pipeline's prompt template, the number of its tokens it drops, and its tokenizer length limit (read from a
    pipeline with no components, so a diffusers release that changes them changes the text cache key)."""
    from diffusers import QwenImagePipeline

    pipe: Any = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)  # type: ignore[arg-type]
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx, pipe.tokenizer_max_length


class QwenImage(DiffusionFamily):
    """Qwen-Image (``Qwen/Qwen-Image``).

    Args:
        max_sequence_length: text tokens kept per prompt (the prompt's tokens plus the 5 that close the template; at
            most 1024, the pipeline's limit; 512 is its default); a longer prompt is cut.
        timestep_sampling: ``qwen_shift`` (logit-normal, shifted by image size as Qwen-Image's scheduler shifts),
            ``logit_normal`` (SD3) or ``uniform``.
        logit_mean: mean of the logit-normal draw.
        logit_std: standard deviation of the logit-normal draw.
        shift: a fixed shift for ``qwen_shift``; null means Qwen-Image's resolution-dependent value.
    """

    name: ClassVar[str] = "qwenimage"
    architecture: ClassVar[Architecture] = Architecture(
        pipeline_classes=("QwenImagePipeline",),
        denoiser_class="QwenImageTransformer2DModel",
        denoiser_subfolder="transformer",
        text_encoders=("text_encoder",),  # Qwen2.5-VL-7B
        latent_divisor=16,
        # Only layers that reach the image in every block. The last block's text output is discarded (the transformer's
        # output is its image tokens), so a LoRA on its text query (add_q_proj), text output (to_add_out) or text MLP
        # would never train; a targets pattern of your own can add those layers (they train in the other blocks).
        lora_presets={
            # The image stream's attention: the default targets of diffusers' Qwen-Image LoRA script.
            "attention": rf".*transformer_blocks\.\d+\.{_ATTENTION}",
            # Plus the text keys and values the image attends to in the joint attention.
            "attention_all": rf".*transformer_blocks\.\d+\.({_ATTENTION}|{_TEXT_KV})",
            # Plus the image stream's MLP (the modulation layers img_mod / txt_mod stay frozen, as in musubi-tuner).
            "all_linear": rf".*transformer_blocks\.\d+\.({_ATTENTION}|{_TEXT_KV}|{_IMAGE_MLP})",
        },
    )
    compiling: ClassVar[Compiling] = Compiling(stream_sources=("img_in", "txt_in"))
    planning: ClassVar[Planning] = Planning(
        known_denoisers={"Qwen/Qwen-Image": QWEN_IMAGE_TRANSFORMER},
        known_text_encoders={"Qwen/Qwen-Image": {"text_encoder": QWEN25_VL_7B}},
        vae_architecture=QWEN_IMAGE_VAE,
        # Not measured for Qwen-Image: FLUX's 0.78 of the eager count as it was first made, rebased to the count made
        # as the GPU runs, under autocast (21% larger), so the compiled plan stays as measured (+4.8%, on an H200).
        compiled_saved_fraction=0.64,
    )
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(
            DiffusersLayout("transformer"),
            # musubi-tuner's names are the diffusers modules with "_", like sd-scripts' SD1.x names.
            KohyaLayout(
                QWEN_IMAGE_NETWORK,
                to_kohya=unet_to_kohya,
                from_kohya=functools.partial(
                    from_kohya_by, loader="QwenImageLoraLoaderMixin"
                ),  # alpha / rank folded in
            ),
        ),
        tools=("diffusers", "ComfyUI"),  # sd-scripts has no network for it
        # as musubi-tuner writes them (utils/sai_model_spec.py)
        modelspec={"architecture": "Qwen-Image/lora", "implementation": "https://github.com/QwenLM/Qwen-Image"},
        markers=("qwen_image", "Qwen-Image/"),  # kohya's, ModelSpec's (musubi-tuner)
    )

    def __init__(
        self,
        max_sequence_length: int = 512,
        timestep_sampling: QwenTimestepSampling = "qwen_shift",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        shift: float | None = None,
    ) -> None:
        if not 1 <= max_sequence_length <= 1024:
            raise ConfigError(
                f"model.family.init_args.max_sequence_length: {max_sequence_length} must be between 1 and 1024 "
                "(QwenImagePipeline reads at most 1024 prompt tokens; 512 is its default)."
            )
        if shift is not None and shift <= 0:
            raise ConfigError(f"model.family.init_args.shift: {shift} must be positive (null: by image size).")
        self.max_sequence_length = max_sequence_length
        self.timestep_sampling = timestep_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.shift = shift

    # -- loading -----------------------------------------------------------------------------------------------
    def load_denoiser(self, source: ModelSource) -> nn.Module:
        from diffusers import QwenImageTransformer2DModel

        if source.denoiser_file is None:
            return self.load_denoiser_weights(QwenImageTransformer2DModel, source)
        # diffusers reads a Qwen-Image single file as it is (no key conversion): keys it does not know are dropped with
        # a log line and weights it does not find stay empty. So the file's names are checked here first.
        prefix = self._single_file_prefix(source)
        if not prefix:
            return self.load_denoiser_weights(QwenImageTransformer2DModel, source)
        from safetensors.torch import load_file

        weights = {k.removeprefix(prefix): v for k, v in load_file(source.denoiser_file).items()}  # type: ignore[arg-type]
        model = QwenImageTransformer2DModel.from_single_file(
            weights,
            config=source.local_path,
            subfolder=self.architecture.denoiser_subfolder,
            torch_dtype=source.dtype,
            local_files_only=source.is_local,
        )
        return model.requires_grad_(False).eval()

    def _single_file_prefix(self, source: ModelSource) -> str:
        """The prefix of ``source.denoiser_file``'s keys (``""``, or a ComfyUI checkpoint's ``model.diffusion_model.``)
        after checking that they are exactly the transformer's weights; :class:`ConfigError` naming the difference."""
        assert source.denoiser_file is not None
        expected = set(self.denoiser_skeleton(source).state_dict())
        with safe_open(source.denoiser_file, framework="pt") as f:
            keys = set(f.keys())
        prefix = next((p for p in _SINGLE_FILE_PREFIXES if any(k.startswith(p) for k in keys)), "")
        names = {k.removeprefix(prefix) for k in keys if k.startswith(prefix)}
        missing, unknown = sorted(expected - names), sorted(names - expected)
        if missing or unknown:
            what = []
            if missing:
                what.append(f"lacks {len(missing)} of its weights (e.g. {', '.join(missing[:2])})")
            if unknown:
                what.append(f"has {len(unknown)} keys it does not have (e.g. {', '.join(unknown[:2])})")
            raise ConfigError(
                f"model.denoiser_file: {source.denoiser_file!r} is not a Qwen-Image transformer in diffusers / ComfyUI "
                f"names: it {' and '.join(what)}. Use the bf16 diffusion model file (a scaled-FP8 file holds scales "
                "diffusers does not read; a full checkpoint, or another model, goes elsewhere), or leave "
                "model.denoiser_file empty to load model.pretrained's transformer."
            )
        return prefix

    def load_vae(self, source: ModelSource) -> nn.Module:
        from diffusers import AutoencoderKLQwenImage

        vae = load_weights(AutoencoderKLQwenImage.from_pretrained, source, "vae", torch_dtype=source.dtype)
        return vae.requires_grad_(False).eval()

    def load_text_encoders(self, source: ModelSource) -> Any:
        from diffusers import QwenImagePipeline
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        te = load_weights(
            Qwen2_5_VLForConditionalGeneration.from_pretrained, source, "text_encoder", dtype=source.dtype
        )
        # A pipeline with only its text parts: encode_prompt is then exactly what inference does.
        return QwenImagePipeline(
            scheduler=None,  # type: ignore[arg-type]
            vae=None,  # type: ignore[arg-type]
            text_encoder=te.requires_grad_(False).eval(),
            tokenizer=load_component(Qwen2Tokenizer.from_pretrained, source, "tokenizer"),
            transformer=None,  # type: ignore[arg-type]
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.qwenimage import save_tiny_qwenimage

        return save_tiny_qwenimage(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompt_embeds [B, max_sequence_length, D]`` (zeros after each prompt) and ``prompt_embeds_mask [B,
        max_sequence_length]`` (int64, 1 for the prompt's tokens): the pipeline's ``encode_prompt``, padded to the
        fixed length the cache stores (module docstring)."""
        device = encoders.text_encoder.device
        embeds, mask = encoders.encode_prompt(
            prompt=prompts, device=device, max_sequence_length=self.max_sequence_length
        )
        b, n, d = embeds.shape
        if mask is None:  # the pipeline's "every prompt fills all n positions"
            mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
        padded = embeds.new_zeros(b, self.max_sequence_length, d)
        padded[:, :n] = embeds
        full = torch.zeros(b, self.max_sequence_length, dtype=torch.long, device=embeds.device)
        full[:, :n] = mask
        return {"prompt_embeds": padded, "prompt_embeds_mask": full}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.qwenimage import RANDOM_QWENIMAGE

        return RANDOM_QWENIMAGE

    @torch.no_grad()
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [-1, 1] -> normalised latents ``[B, z_dim, H/8, W/8]`` (float32): one frame
        through the video VAE, the mean of its posterior (deterministic, so a cached entry has one right value),
        minus the per-channel ``latents_mean``, over ``latents_std``."""
        frames = pixels.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)  # [B, 3, 1, H, W]
        z = vae.encode(frames).latent_dist.mode()[:, :, 0].float()  # [B, C, h, w]
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1)
        return (z - mean) / std

    @property
    @override
    def text_tokens(self) -> int:
        return self.max_sequence_length

    @override
    def text_cache_tag(self) -> str:
        template, drop, limit = _template()
        digest = hashlib.sha256(json.dumps([template, drop, limit]).encode()).hexdigest()[:8]
        return f"qwenimage-len{self.max_sequence_length}-template{digest}"

    @override
    def prompt_limit(self, encoders: Any) -> PromptLimit | None:
        # The kept embeddings are the prompt's tokens plus those that close the template (5 with Qwen's tokenizer).
        template, drop, _ = _template()
        closing = len(encoders.tokenizer(template.format("")).input_ids) - drop
        return PromptLimit(encoders.tokenizer, max(self.max_sequence_length - closing, 1), "Qwen2.5-VL")

    # -- training ----------------------------------------------------------------------------------------------
    def resolution_shift(self, image_tokens: int) -> float:
        """The shift ``exp(mu)`` Qwen-Image's scheduler applies for ``image_tokens`` packed tokens (the pipeline's
        ``calculate_shift`` with its scheduler config), or the fixed ``shift``."""
        if self.shift is not None:
            return self.shift
        return objectives.resolution_shift(image_tokens, _BASE_TOKENS, _MAX_TOKENS, _BASE_SHIFT, _MAX_SHIFT)

    def sample_timesteps(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        b, _, h, w = latents.shape
        mode = self.timestep_sampling
        return objectives.sample_sigmas(
            b,
            "flux_shift" if mode == "qwen_shift" else mode,  # a logit-normal draw moved by the shift
            generator=generator,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            shift=self.resolution_shift((h // 2) * (w // 2)),
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
        text, mask = trim_text(batch["prompt_embeds"], batch.get("prompt_embeds_mask"))
        tokens = pack_latents(noisy)
        hidden, shapes = self.with_controls(tokens, image_shapes(b, h, w), batch.get("controls"))
        prediction = denoiser(
            hidden_states=hidden.to(dtype),
            encoder_hidden_states=text.to(dtype),
            encoder_hidden_states_mask=mask,
            timestep=sigmas.to(dtype),
            img_shapes=shapes,
            return_dict=False,
        )[0][:, : tokens.shape[1]]  # the control tokens' outputs are not predicted: the pipelines drop them
        target = pack_latents(objectives.flow_match_target(x0.float(), noise.float()))
        return objectives.Prediction(prediction, target)

    def with_controls(
        self, tokens: torch.Tensor, shapes: list[list[tuple[int, int, int]]], controls: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[list[tuple[int, int, int]]]]:
        """The packed image ``tokens [B, n, 4C]`` and their ``img_shapes`` with a batch's control latents ``[B, N, C,
        h, w]`` appended as the edit pipelines append them (:mod:`lightning_lora.families.qwenimage_edit`); Qwen-Image
        itself takes none."""
        if controls is not None:
            raise ValueError(f"the {self.name} family takes no control images (edit training: QwenImageEdit)")
        return tokens, shapes

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """Classifier-free guidance ``true_cfg_scale = guidance_scale`` (none at 1 or below), the empty prompt as the
        negative, as ``pipe(prompt, negative_prompt="", true_cfg_scale=...)`` draws it."""

        def trimmed(cached: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            n = max(int(cached["prompt_embeds_mask"].sum(dim=1).max()), 1)  # a batch of one: its own length
            return {
                "embeds": text.to_denoiser(cached["prompt_embeds"][:, :n]),
                "mask": cached["prompt_embeds_mask"][:, :n].to(device=text.device),
            }

        prompt = trimmed(text.embeddings)
        guided: dict[str, Any] = {}
        if settings.guidance_scale > 1:
            if text.negative is None:
                raise ValueError(
                    "classifier-free guidance (guidance_scale > 1) needs the empty prompt's embeddings as `negative`"
                )
            neg = trimmed(text.negative)
            guided = {"negative_prompt_embeds": neg["embeds"], "negative_prompt_embeds_mask": neg["mask"]}
        return {
            "prompt_embeds": prompt["embeds"],
            "prompt_embeds_mask": prompt["mask"],
            "true_cfg_scale": settings.guidance_scale,
            "max_sequence_length": self.max_sequence_length,
            **guided,
        }

    # -- interop: what diffusers, ComfyUI and sd-scripts make of a Qwen-Image LoRA file (formats.clients) ------------
    @override
    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        """ComfyUI maps the kohya layout onto its own (diffusers-named) modules in every release, the diffusers layout
        only since its Qwen-Image rule (0.3.50); diffusers reads both (a kohya file as plain LoRA), kohya's sd-scripts
        reads neither."""
        c = Coverage()
        modules = list(variants)
        dora = [m for m, v in variants.items() if v == "DoRA"]
        lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
        c.skip("kohya", modules, "kohya's sd-scripts has no Qwen-Image network (musubi-tuner trains Qwen-Image LoRAs)")
        if format == "diffusers":
            c.skip("ComfyUI", modules, _COMFY_RULE)
            return c
        c.skip(
            "diffusers", lycoris, "diffusers' Qwen-Image converter reads lora_down/lora_up only (it refuses the file)"
        )
        c.approx("diffusers", dora, DIFFUSERS_DORA)
        c.approx("ComfyUI", dora, COMFY_DORA)
        return c

    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """2 for Qwen-Image's own image/text-stream MLPs and modulation (in diffusers' or musubi-tuner's names); its
        joint-attention layers alone are named as FLUX's are."""
        return 2 if any(_OWN_MODULES.search(k) for k in tensors) else 0

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
            "encoder_hidden_states_mask": None,  # prompts of one length (a mask only when lengths differ)
            "timestep": torch.empty(batch, device=device, dtype=dtype),
            "img_shapes": image_shapes(batch, h, w),
            "return_dict": False,
        }

    @override
    def sampling_latent_shape(self, vae_config: dict[str, Any], height: int, width: int) -> tuple[int, ...]:
        """The latents ``QwenImagePipeline`` decodes for one ``height x width`` image: one frame of the video VAE,
        ``[1, z_dim, 1, H/8, W/8]`` (the planner measures that decode:
        :func:`lightning_lora.plan.sampling.sampling_pieces`)."""
        scale = 2 ** (len(vae_config["dim_mult"]) - 1)
        return (1, vae_config["z_dim"], 1, height // scale, width // scale)

    def block_count(self, model: DiffusersModel) -> int:
        return model.config.num_layers

    @override
    def cached_latent_shape(self, config: Mapping[str, Any], height: int, width: int) -> tuple[int, int, int]:
        return (config["out_channels"], height // 8, width // 8)  # one frame of the video VAE, without its axis

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL's last hidden state of ``text_len`` tokens, zeros to the cached length, an int64 mask."""
        embeds = torch.zeros(batch, self.max_sequence_length, config["joint_attention_dim"])
        embeds[:, :text_len] = torch.randn(batch, text_len, config["joint_attention_dim"], generator=generator)
        mask = (torch.arange(self.max_sequence_length) < text_len).expand(batch, -1)
        return {"prompt_embeds": embeds.bfloat16(), "prompt_embeds_mask": mask.long()}

    @classmethod
    @override
    def text_length_options(cls, text_len: int) -> tuple[dict[str, Any], int]:
        # The denoiser sees the caption's tokens alone: the cache keeps its default length (512, the shipped configs').
        return {"max_sequence_length": max(text_len, 512)}, text_len

    def sampling_bytes(self, model: DiffusersModel, height: int, width: int, text_len: int) -> float:
        c = model.config
        tokens = (height // 16) * (width // 16) + text_len
        inner = c.num_attention_heads * c.attention_head_dim
        # The widest intermediates of a dual-stream block (q, k, v and the 4x MLP, bf16; the guided and unguided
        # passes run one after the other) and the VAE decode at full resolution (96 channels, causal-convolution
        # caches: a few more buffers than a 2D VAE).
        block = tokens * (3 * inner + 4 * inner + inner) * 2 * 2
        vae = height * width * 96 * 2 * 6
        return float(block + vae + 127e6 * 2)
