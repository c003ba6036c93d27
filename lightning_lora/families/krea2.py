"""Krea 2 (krea/Krea-2-Raw, krea/Krea-2-Turbo): a single-stream flow-matching MMDiT on Qwen-Image's VAE latents,
conditioned on twelve tapped layers of Qwen3-VL-4B fused inside the transformer.

Shapes, for an image of ``H x W`` pixels and a batch ``B``:

* The VAE is Qwen-Image's (``AutoencoderKLQwenImage``): one frame, 8x down into 16 channels, normalised per channel
  with its ``latents_mean`` / ``latents_std`` (:meth:`lightning_lora.families.QwenImage.encode_images`, which this
  family calls). The cache keeps ``[B, 16, H/8, W/8]``.
* The transformer (12.8 B parameters: 28 blocks 6144 wide, 48 query heads and 12 key/value heads of 128, a gated
  attention output, SwiGLU 16384 wide) sees 2x2 latent patches as tokens, packed exactly as FLUX packs them
  (:func:`lightning_lora.families.flux.pack_latents`): ``[B, (H/16)(W/16), 64]``, so image sides are multiples of 16.
  Text and image tokens form one sequence ``[text; image]`` through every block. Rotary positions are 3-D: every
  text token sits at ``(0, 0, 0)``, image patch ``(r, c)`` at ``(0, r, c)`` (:func:`position_ids`).
* Text: ``Krea2Pipeline`` puts the prompt into Qwen-Image's template (a system turn "Describe the image by detailing
  ...", the prompt as the user turn, the assistant header), pads it *before* the closing 5 tokens to a fixed
  ``max_sequence_length`` (512) after the system turn, runs Qwen3-VL-4B with positions that count real tokens only, and
  stacks the hidden states of layers 2, 5, ..., 35 per token: ``[B, 512, 12, 2560]`` with a mask ``[B, 512]`` (the
  prompt's tokens, the padding, then the 5 closing tokens). Inside the transformer a text-fusion stage (2 blocks that
  attend across the 12 layers of each token, a linear projector from 12 to 1, 2 blocks across the tokens) makes one
  2560-wide stream of it.

Cached text, and batches of it
------------------------------
Text tokens carry no position (all at the origin) and padded ones are masked as attention keys everywhere, so the
transformer's output for the image depends only on the *set* of valid text tokens, not on where the padding sits. The
cache therefore keeps each prompt's valid tokens first and zeros after them (:func:`compact_text`:
``prompt_embeds [L, 12, 2560]`` in the encoder's dtype, 31.5 MB per caption in bf16 at the default 512, and a bool
``prompt_mask [L]``), and :meth:`Krea2.loss` cuts a batch back to its longest prompt, passing the mask only where
lengths differ (:func:`lightning_lora.families.qwenimage.trim_text`): the transformer computes what the pipeline
computes (up to the order of a sum), over a caption's own tokens (often under 100) instead of 512 beside the 4096
image tokens of a 1024x1024 image. The length only
decides where a long prompt is cut (``max_sequence_length - 5`` of its tokens are read): a smaller one halves the
cache's size without changing what shorter prompts train.

The objective
-------------
Rectified flow, as for FLUX (:mod:`lightning_lora.objectives`): ``x_sigma = (1 - sigma) x0 + sigma noise``, the
transformer takes ``sigma`` itself (``t / 1000`` for the scheduler's ``t = 1000 sigma``; it multiplies by 1000
inside) and predicts the velocity ``noise - x0`` (the scheduler's Euler step is ``x + (sigma_next - sigma) v``).

Timestep shift: ``Krea2Pipeline`` shifts its schedule by ``exp(mu)``, ``mu`` linear in the packed image tokens from 0.5
at 256 (256x256 pixels) to 1.15 at 6400 (1280x1280; shift 2.47 at 1024x1024), the scheduler config its docstring gives
and Krea's own sampler's range (krea-ai/krea-2 ``sampling.py``); the distilled Turbo model samples at a fixed
``mu = 1.15`` (shift 3.16). ``timestep_sampling: krea_shift`` (the default) draws logit-normal noise levels moved by
the base model's shift for the batch's image size (musubi-tuner's ``krea2_shift``), or by a fixed ``shift``.

Guidance and distillation
-------------------------
Krea 2 Raw is the undistilled base (Krea: "train on Raw, run on Turbo"); it samples with classifier-free guidance in
Krea's convention: ``cond + scale (cond - uncond)``, on whenever ``guidance_scale > 0`` (the usual CFG at ``1 +
scale``), the empty prompt as the negative. Krea 2 Turbo (``architecture.step_distilled``; a folder says it by
``is_distilled`` in its ``model_index.json``, which ``Krea2Pipeline`` samples by: :meth:`Krea2.is_distilled`) is
step-distilled to 8 steps without guidance (``guidance_scale`` 0). LoRAs trained on Raw apply to Turbo (Krea's
model cards), which is why the shipped config trains Raw.

LoRA files
----------
The diffusers layout (``transformer.<module>``), which ``Krea2Pipeline.load_lora_weights`` loads, and which every
ComfyUI that loads Krea 2 maps layer by layer onto its model (:mod:`lightning_lora.formats.krea2`): a ComfyUI-specific
file would hold the same numbers under other names, so lightning-lora writes none. kohya's sd-scripts has no Krea 2
network (kohya's musubi-tuner trains Krea 2 and writes ``lora_unet_<original name>``, which ComfyUI reads and
diffusers 0.42 does not). LoKr and LoHa have no file format for this family.
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
    check_source,
    compute_dtype,
    load_component,
    load_weights,
)
from lightning_lora.families.encoders import QWEN3_VL_4B
from lightning_lora.families.facts import Architecture, Compiling, LoraFiles, Planning, RandomModels
from lightning_lora.families.flux import pack_latents
from lightning_lora.families.qwenimage import QWEN_IMAGE_VAE, QwenImage, trim_text
from lightning_lora.formats.clients import COMFY_PEFT_DORA, Coverage
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.krea2 import comfy_target

__all__ = ["KREA2_TRANSFORMER", "Krea2", "Krea2TimestepSampling", "compact_text", "position_ids"]

Krea2TimestepSampling = Literal["krea_shift", "logit_normal", "uniform"]

_RAW, _TURBO = "krea/Krea-2-Raw", "krea/Krea-2-Turbo"

KREA2_TRANSFORMER: dict[str, Any] = {
    "_class_name": "Krea2Transformer2DModel",
    "in_channels": 64,
    "num_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "num_key_value_heads": 12,
    "intermediate_size": 16384,
    "timestep_embed_dim": 256,
    "text_hidden_dim": 2560,
    "num_text_layers": 12,
    "text_num_attention_heads": 20,
    "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912,
    "num_layerwise_text_blocks": 2,
    "num_refiner_text_blocks": 2,
    "axes_dims_rope": [32, 48, 48],
    "rope_theta": 1000.0,
    "norm_eps": 1e-05,
}
"""The transformer of krea/Krea-2-Raw and krea/Krea-2-Turbo (12.8 B parameters; the two share it). From Krea's
reference code (krea-ai/krea-2 ``inference.py``, ``single_mmdit_large_wide``: 6144 features in 48 heads with 12
key/value heads, 28 layers, 2x2 patches of 16 channels, a 256-wide time embedding, 12 text layers 2560 wide in 20
heads, rope theta 1000; ``mmdit.py``: SwiGLU ``int(2 features / 3) x 4`` rounded up to 128, so 16384 and 6912, rotary
axes ``128 - 12 x 8``, ``6 x 8``, ``6 x 8``); these are ``Krea2Transformer2DModel``'s defaults in diffusers 0.42.1,
whose single-file loader builds Krea 2 with krea/Krea-2-Raw's config (``single_file_utils.py``)."""

_DISTILLED = {_RAW: False, _TURBO: True}
"""Whether each hub model is step-distilled (Krea's model cards: Raw undistilled, Turbo 8 steps without guidance)."""

# Krea2Pipeline's scheduler config (its docstring): mu linear from base_shift (0.5) at base_image_seq_len (256) packed
# image tokens to max_shift (1.15) at max_image_seq_len (6400); lightning_lora.tiny.krea2.KREA2_SCHEDULER_CONFIG holds
# the whole of it.
_BASE_TOKENS, _MAX_TOKENS, _BASE_SHIFT, _MAX_SHIFT = 256, 6400, 0.5, 1.15

_BLOCK = r"transformer_blocks\.\d+"
_ATTENTION = r"attn\.(to_q|to_k|to_v|to_gate|to_out\.0)"
_FEED_FORWARD = r"ff\.(gate|up|down)"
_AROUND = r"img_in|time_embed\.linear_[12]|time_mod_proj|txt_in\.linear_[12]|text_fusion\.projector|final_layer\.linear"
# Names only Krea 2 has, in diffusers' names or its original ones (Krea's, ComfyUI's, musubi-tuner's with "_").
_OWN_MODULES = re.compile(
    r"(^|[._])(text_fusion|txtfusion|time_mod_proj|txt_in[._]linear_[12]|txtmlp[._]\d|tproj[._]1"
    r"|attn[._]to_gate|blocks[._]\d+[._](attn[._](wq|wk|wv|wo)|mlp[._](gate|up|down)))[._]"
)

_QWEN = QwenImage()  # Krea 2 reads and writes latents with Qwen-Image's VAE, exactly as Qwen-Image does


@functools.cache
def _pipeline_text() -> tuple[str, str, int, int, tuple[int, ...]]:
    """``Krea2Pipeline``'s template prefix and suffix, the prefix tokens it drops, its suffix's length and its default
    text-encoder taps (read from a pipeline with no components, so a diffusers release that changes them changes the
    text cache key)."""
    from diffusers import Krea2Pipeline

    pipe: Any = Krea2Pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)  # type: ignore[arg-type]
    return (
        pipe.prompt_template_encode_prefix,
        pipe.prompt_template_encode_suffix,
        pipe.prompt_template_encode_start_idx,
        pipe.prompt_template_encode_num_suffix_tokens,
        tuple(pipe.text_encoder_select_layers),
    )


def compact_text(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's text ``[B, L, ...]`` with its mask ``[B, L]`` (valid tokens anywhere) as each prompt's valid
    tokens first, in their order, zeros after them, and the mask of that (bool, ``True`` first)."""
    mask = mask.bool()
    out = torch.zeros_like(embeds)
    kept = torch.zeros_like(mask)
    for i in range(embeds.shape[0]):
        valid = embeds[i][mask[i]]
        out[i, : len(valid)] = valid
        kept[i, : len(valid)] = True
    return out, kept


def position_ids(text_len: int, rows: int, cols: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotary positions ``[text_len + rows * cols, 3]`` (float32) of a ``[text; image]`` sequence: the text at the
    origin, packed image token ``(r, c)`` (row-major) at ``(0, r, c)``."""
    image = torch.zeros(rows, cols, 3, device=device)
    image[..., 1] = torch.arange(rows, device=device)[:, None]
    image[..., 2] = torch.arange(cols, device=device)[None, :]
    return torch.cat([torch.zeros(text_len, 3, device=device), image.reshape(rows * cols, 3)])


def _model_index(source: ModelSource) -> dict[str, Any]:
    """``model_index.json`` of ``source`` (a folder's, or a hub id's when it can be read), ``{}`` when it cannot be
    read."""
    from diffusers import Krea2Pipeline

    try:
        return dict(Krea2Pipeline.load_config(source.local_path, revision=source.revision))
    except (OSError, ValueError):
        return {}


class Krea2(DiffusionFamily):
    """Krea 2 Raw (the undistilled base, for training) and Krea 2 Turbo (step-distilled).

    Args:
        max_sequence_length: text tokens per prompt after the template's system turn, its 5 closing tokens included
            (the pipeline's 512): longer prompts are cut at ``max_sequence_length - 5`` tokens. Shorter prompts train
            the same at any length (see the module docstring), so pass the same value to ``Krea2Pipeline`` only to cut
            long prompts alike.
        timestep_sampling: ``krea_shift`` (a logit-normal draw moved towards noise by Krea 2's shift for the batch's
            image size, or by ``shift``), ``logit_normal`` (unshifted) or ``uniform``.
        logit_mean: mean of the logit-normal draw.
        logit_std: standard deviation of the logit-normal draw.
        shift: a fixed shift for ``krea_shift``; null means the base model's (``exp(mu)``, ``mu`` from 0.5 at 256x256 to
            1.15 at 1280x1280). Turbo's fixed schedule is ``exp(1.15)`` = 3.16.
    """

    name: ClassVar[str] = "krea2"
    architecture: ClassVar[Architecture] = Architecture(
        pipeline_classes=("Krea2Pipeline",),
        denoiser_class="Krea2Transformer2DModel",
        denoiser_subfolder="transformer",
        text_encoders=("text_encoder",),  # Qwen3-VL-4B
        latent_divisor=16,
        lora_presets={
            # Every linear layer of the blocks' attention: q, k, v, the output gate and the output projection (Krea's
            # configuration for long runs, musubi-tuner's docs/krea2.md).
            "attention": rf".*{_BLOCK}\.{_ATTENTION}",
            # Plus each block's SwiGLU feed-forward (gate, up, down): every linear layer inside the blocks.
            "attention_ff": rf".*{_BLOCK}\.({_ATTENTION}|{_FEED_FORWARD})",
            # Every linear layer of the transformer (Krea's default configuration): plus the text-fusion blocks and
            # projector, and the image, time, text and output projections around the blocks.
            "all_linear": rf".*({_BLOCK}|text_fusion\.(layerwise|refiner)_blocks\.\d+)\.({_ATTENTION}|{_FEED_FORWARD})"
            rf"|.*({_AROUND})",
        },
        step_distilled={_TURBO: _RAW},  # 8 steps, no guidance; Krea: "train on Raw, run on Turbo"
    )
    compiling: ClassVar[Compiling] = Compiling(stream_sources=("img_in", "txt_in"))
    planning: ClassVar[Planning] = Planning(
        known_denoisers=dict.fromkeys(_DISTILLED, KREA2_TRANSFORMER),
        known_text_encoders=dict.fromkeys(_DISTILLED, {"text_encoder": QWEN3_VL_4B}),
        vae_architecture=QWEN_IMAGE_VAE,  # Krea 2 decodes with Qwen-Image's VAE
        # compiled_saved_fraction: the default, not measured for Krea 2's blocks (dev/probes/saved_share.py did not
        # finish in 30 minutes on a 2-core CPU); it counts only where compiled blocks are not checkpointed, unlike in
        # configs/krea2_24gb.yaml.
    )
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(DiffusersLayout("transformer"),),  # ComfyUI maps it too (module docstring)
        tools=("diffusers", "ComfyUI"),  # sd-scripts has no Krea 2 network
        # The IDs kohya-ss/musubi-tuner writes for Krea 2 LoRAs (src/musubi_tuner/utils/sai_model_spec.py).
        modelspec={"architecture": "Krea-2/lora", "implementation": "https://github.com/krea-ai/krea-2"},
        markers=("Krea-2",),  # ModelSpec's (musubi-tuner's, ours)
    )

    def __init__(
        self,
        max_sequence_length: int = 512,
        timestep_sampling: Krea2TimestepSampling = "krea_shift",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        shift: float | None = None,
    ) -> None:
        option = "model.family.init_args"
        if max_sequence_length < 8:
            raise ConfigError(
                f"{option}.max_sequence_length: {max_sequence_length} leaves no room for a prompt (the template's "
                "closing tokens alone are 5); use 512, the pipeline's default."
            )
        if shift is not None and shift <= 0:
            raise ConfigError(f"{option}.shift: {shift} must be positive (null: Krea 2's own, by image size).")
        self.max_sequence_length = max_sequence_length
        self.timestep_sampling = timestep_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.shift = shift

    # -- loading -----------------------------------------------------------------------------------------------
    @override
    def check_source(self, source: ModelSource) -> None:
        import diffusers
        import transformers

        needed = (("Krea2Pipeline", diffusers), ("Qwen3VLModel", transformers))
        missing = [name for name, library in needed if not hasattr(library, name)]
        if missing:
            raise ConfigError(
                f"model.family: Krea 2 needs {' and '.join(missing)}, which the installed diffusers "
                f"{diffusers.__version__} / transformers {transformers.__version__} lack; upgrade them "
                "(pip install -U diffusers transformers; lightning-lora tests Krea 2 with diffusers 0.42.1)."
            )
        check_source(source, self.architecture.pipeline_classes)

    def load_vae(self, source: ModelSource) -> nn.Module:
        return _QWEN.load_vae(source)

    def load_text_encoders(self, source: ModelSource) -> Any:
        from diffusers import Krea2Pipeline
        from transformers import AutoTokenizer, Qwen3VLModel
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        text_encoder = load_weights(Qwen3VLModel.from_pretrained, source, "text_encoder", dtype=source.dtype)
        tokenizer = load_component(AutoTokenizer.from_pretrained, source, "tokenizer")
        taps = _pipeline_text()[4]
        found = _model_index(source).get("text_encoder_select_layers")
        if found is not None and tuple(found) != taps:
            raise ConfigError(
                f"model.pretrained: {source.pretrained!r} taps the text encoder's layers {list(found)} "
                f"(model_index.json's text_encoder_select_layers), not Krea 2's {list(taps)}, which the text cache "
                "holds. Train a Krea 2 model (krea/Krea-2-Raw), or a folder with Krea 2's model_index.json."
            )
        # A pipeline with only its text parts: encode_prompt is then exactly what inference does.
        return Krea2Pipeline(
            scheduler=None,  # type: ignore[arg-type]
            vae=None,  # type: ignore[arg-type]
            text_encoder=text_encoder.requires_grad_(False).eval(),
            tokenizer=tokenizer,
            transformer=None,  # type: ignore[arg-type]
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.krea2 import save_tiny_krea2

        return save_tiny_krea2(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompt_embeds [B, max_sequence_length, 12, D]`` and ``prompt_mask [B, max_sequence_length]``: the
        pipeline's ``encode_prompt``, each prompt's valid tokens first (:func:`compact_text`)."""
        embeds, mask = encoders.encode_prompt(
            prompt=list(prompts), device=encoders.text_encoder.device, max_sequence_length=self.max_sequence_length
        )
        embeds, mask = compact_text(embeds, mask)
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.krea2 import RANDOM_KREA2

        return RANDOM_KREA2

    @torch.no_grad()
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        return _QWEN.encode_images(vae, pixels)

    @property
    @override
    def text_tokens(self) -> int:
        return self.max_sequence_length

    @override
    def text_cache_tag(self) -> str:
        digest = hashlib.sha256(json.dumps(_pipeline_text()).encode()).hexdigest()[:8]
        return f"krea2-len{self.max_sequence_length}-template{digest}"

    @override
    def prompt_limit(self, encoders: Any) -> PromptLimit:
        # The pipeline tokenizes prefix + prompt to max_sequence_length + start_idx - suffix tokens, then the suffix.
        prefix, _, start, suffix, _ = _pipeline_text()
        read = self.max_sequence_length + start - suffix - len(encoders.tokenizer(prefix).input_ids)
        return PromptLimit(encoders.tokenizer, max(read, 1), "Qwen3-VL")

    # -- training ----------------------------------------------------------------------------------------------
    def resolution_shift(self, image_tokens: int) -> float:
        """The shift ``exp(mu)`` ``Krea2Pipeline`` applies for ``image_tokens`` packed tokens (its ``calculate_shift``
        with Krea 2's scheduler config), or the fixed ``shift``."""
        if self.shift is not None:
            return self.shift
        return objectives.resolution_shift(image_tokens, _BASE_TOKENS, _MAX_TOKENS, _BASE_SHIFT, _MAX_SHIFT)

    def sample_timesteps(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        b, _, h, w = latents.shape
        mode = self.timestep_sampling
        return objectives.sample_sigmas(
            b,
            "flux_shift" if mode == "krea_shift" else mode,  # a logit-normal draw moved by the shift
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
        x0 = batch["latents"].float()
        _, _, h, w = x0.shape
        dtype = compute_dtype(denoiser)
        sigmas = timesteps.to(x0.device).float()
        noisy = objectives.flow_match_noisy(x0, noise.float(), sigmas)
        text, mask = trim_text(batch["prompt_embeds"], batch["prompt_mask"])
        prediction = denoiser(
            hidden_states=pack_latents(noisy).to(dtype),
            encoder_hidden_states=text.to(device=x0.device, dtype=dtype),
            timestep=sigmas.to(dtype),  # as the pipeline rounds it: in the latents' dtype
            position_ids=position_ids(text.shape[1], h // 2, w // 2, x0.device),
            encoder_attention_mask=None if mask is None else mask.to(x0.device),
            return_dict=False,
        )[0]
        target = pack_latents(objectives.flow_match_target(x0, noise.float()))
        return objectives.Prediction(prediction, target)

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def is_distilled(self, source: ModelSource) -> bool:
        """Whether ``source`` is step-distilled (Turbo): a known hub id by ``architecture.step_distilled``, else its
        ``model_index.json``'s ``is_distilled`` (what ``Krea2Pipeline`` samples by)."""
        if not source.is_local and source.pretrained in _DISTILLED:
            return source.pretrained in self.architecture.step_distilled
        return bool(_model_index(source).get("is_distilled", False))

    @override
    def pipeline_options(self, source: ModelSource) -> dict[str, Any]:
        return {"is_distilled": self.is_distilled(source)}

    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """As ``pipe(prompt, guidance_scale=...)`` draws it: the cached text cut to its valid tokens (with the empty
        prompt's, to the longer of the two: the pipeline runs both with one set of positions), classifier-free guidance
        in Krea's convention whenever ``guidance_scale > 0``."""

        def length(cached: dict[str, torch.Tensor]) -> int:
            return max(int(cached["prompt_mask"].sum(dim=1).max()), 1)

        def cut(cached: dict[str, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return text.to_denoiser(cached["prompt_embeds"][:, :n]), cached["prompt_mask"][:, :n].to(text.device).bool()

        guided: dict[str, Any] = {}
        n = length(text.embeddings)
        if settings.guidance_scale > 0:
            if text.negative is None:
                raise ConfigError(
                    f"SampleImages guidance_scale: {settings.guidance_scale} needs the empty prompt's embeddings; use "
                    "0.0 (Krea 2 Turbo samples without classifier-free guidance)."
                )
            n = max(n, length(text.negative))
            embeds, mask = cut(text.negative, n)
            guided = {"negative_prompt_embeds": embeds, "negative_prompt_embeds_mask": mask}
        embeds, mask = cut(text.embeddings, n)
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "guidance_scale": settings.guidance_scale,
            "max_sequence_length": self.max_sequence_length,
            **guided,
        }

    # -- interop: what diffusers, ComfyUI and sd-scripts make of a Krea 2 LoRA file (formats.krea2) ------------------
    @override
    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        """diffusers loads its layout; ComfyUI every layer its Krea 2 key map lists (all linear layers:
        :func:`~lightning_lora.formats.krea2.comfy_target`), DoRA as a plain LoRA; sd-scripts nothing."""
        c = Coverage()
        modules = list(variants)
        c.skip("kohya", modules, "kohya's sd-scripts has no Krea 2 network (musubi-tuner trains Krea 2 LoRAs)")
        c.skip("ComfyUI", [m for m in modules if comfy_target(m) is None], "ComfyUI's Krea 2 key map lacks it")
        c.approx("ComfyUI", [m for m, v in variants.items() if v == "DoRA"], COMFY_PEFT_DORA)
        return c

    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """2 for Krea 2's own names (its text fusion, gated attention, modulation and text projections; its original
        block names), in any layout."""
        return 2 if any(_OWN_MODULES.search(k) for k in tensors) else 0

    # -- memory planning ---------------------------------------------------------------------------------------
    def example_inputs(
        self, model: DiffusersModel, batch: int, height: int, width: int, text_len: int, device: str, dtype: torch.dtype
    ) -> dict[str, Any]:
        c = model.config
        rows, cols = height // 16, width // 16
        return {
            "hidden_states": torch.empty(batch, rows * cols, c.in_channels, device=device, dtype=dtype),
            "encoder_hidden_states": torch.empty(
                batch, text_len, c.num_text_layers, c.text_hidden_dim, device=device, dtype=dtype
            ),
            "timestep": torch.empty(batch, device=device, dtype=dtype),
            "position_ids": position_ids(text_len, rows, cols, device),
            "encoder_attention_mask": None,  # prompts of one length (a mask only when lengths differ)
            "return_dict": False,
        }

    def block_count(self, model: DiffusersModel) -> int:
        return model.config.num_layers

    @override
    def sampling_latent_shape(self, vae_config: dict[str, Any], height: int, width: int) -> tuple[int, ...]:
        return _QWEN.sampling_latent_shape(vae_config, height, width)  # one frame of Qwen-Image's video VAE

    @override
    def cached_latent_shape(self, config: Mapping[str, Any], height: int, width: int) -> tuple[int, int, int]:
        return (config["in_channels"] // 4, height // 8, width // 8)  # 2x2 patches of the VAE's channels

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Twelve Qwen3-VL layers of ``text_len`` valid tokens, zeros to the cached length, a bool mask."""
        shape = (config["num_text_layers"], config["text_hidden_dim"])
        embeds = torch.zeros(batch, self.max_sequence_length, *shape)
        embeds[:, :text_len] = torch.randn(batch, text_len, *shape, generator=generator)
        mask = (torch.arange(self.max_sequence_length) < text_len).expand(batch, -1)
        return {"prompt_embeds": embeds.bfloat16(), "prompt_mask": mask}

    @classmethod
    @override
    def text_length_options(cls, text_len: int) -> tuple[dict[str, Any], int]:
        # The denoiser sees the caption's tokens alone: the cache keeps its default length (512, the shipped configs').
        return {"max_sequence_length": max(text_len, 512)}, text_len
