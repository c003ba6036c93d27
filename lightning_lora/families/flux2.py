"""FLUX.2 (klein and dev): a rectified-flow MMDiT on patchified, batch-normalised VAE latents, conditioned on the
stacked hidden states of an LLM (Qwen3 for klein, Mistral-Small-3.1 for dev).

Shapes, for an image of ``H x W`` pixels and a batch ``B``:

* The VAE (``AutoencoderKLFlux2``) downsamples by 8 into 32 channels (the tiny test VAE: 16). Its latents are
  *patchified* before anything else: each 2x2 patch of a channel becomes 4 channels (channel ``4c + 2i + j`` is pixel
  ``(i, j)`` of the patch of channel ``c``), ``[B, 32, H/8, W/8] -> [B, 128, H/16, W/16]``, then normalised per channel
  by the VAE's own batch-norm statistics: ``(z - running_mean) / sqrt(running_var + eps)`` (the pipeline decodes
  ``x * std + mean``, then unpatchifies). The cache stores exactly that: ``[B, 128, H/16, W/16]``, so image sides are
  multiples of 16 (:attr:`Flux2.architecture.latent_divisor`).
* The transformer sees one token per latent position (``patch_size`` 1): ``[B, (H/16)(W/16), 128]``, row-major. Its
  rotary positions have *four* axes ``(t, h, w, l)``: image token ``(r, c)`` is ``(0, r, c, 0)``, text token ``l`` is
  ``(0, 0, 0, l)`` (:func:`image_ids`, :func:`text_ids`).
* Text: klein wraps the prompt in Qwen3's chat template (one user turn, the assistant header and an empty ``<think>``
  block: ``enable_thinking=False``), pads or cuts it to ``max_sequence_length`` (512) tokens and stacks the hidden
  states of layers 9, 18 and 27 side by side: ``prompt_embeds [B, 512, 3 x 2560]`` for klein 4B (Qwen3-4B), ``3 x 4096``
  for klein 9B (Qwen3-8B). dev does the same with Mistral-Small-3.1 (a system message, then the user turn; layers 10,
  20, 30; ``3 x 5120``). The transformer has no text mask: it attends over all 512 positions, pad tokens included,
  so the cache keeps all of them (7.5 MiB a caption in bf16 for klein 4B) and the loss uses what the pipeline uses.
* Timesteps are noise levels ``sigma`` in (0, 1); the transformer multiplies them by 1000 inside (the pipeline feeds
  ``t / 1000`` for its scheduler's ``t = 1000 sigma``). The prediction is the velocity ``noise - x0`` of ``x_sigma =
  (1 - sigma) x0 + sigma noise`` (the scheduler's Euler step is ``x + (sigma_next - sigma) v``), as FLUX.1.
* Guidance: klein has no guidance input. The distilled klein models (``FLUX.2-klein-4B`` / ``-9B``, 4 steps) sample
  without guidance; the base models (``FLUX.2-klein-base-*``, ``is_distilled: false`` in ``model_index.json``) with
  classifier-free guidance, ``neg + scale (pos - neg)``, the empty prompt as negative. dev is guidance-distilled like
  FLUX.1-dev: the scale is an input (``guidance``, trained at :attr:`Flux2.guidance`, 1.0 by default).

Reference images (edit training): both pipelines take images beside the prompt (``image=[...]``, in order). Each is
encoded like a target (patchified, batch-normalised latents), packed, and appended to the image tokens of every
denoising step, the ``i``-th reference at positions ``(10 + 10 i, row, col, 0)`` (:func:`reference_ids`: the time axis
tells the images apart); only the target's tokens are predicted. The training step does the same with each target's
cached controls (``data.images[].controls``, in the target's bucket: a 1024² target with one 1024² reference is twice
the image tokens), and targets without controls train text-to-image in the same run. The pipelines take references
of at least 64 pixels a side (and scale down those over 1024² pixels), so samples with controls are drawn at 64 pixels
or more.

Timestep shift: FLUX.2's pipelines shift their schedule by ``exp(mu)`` with an empirical ``mu`` that grows with the
image tokens *and* the number of steps (``compute_empirical_mu``: at 1024x1024, 4096 tokens, ``mu`` = 2.02 for 50
steps, shift 7.6). ``timestep_sampling: flux2_shift`` (the default) draws logit-normal noise levels moved by the same
shift for the batch's image size at ``inference_steps`` steps, so training sees the noise levels inference visits;
``logit_normal`` / ``uniform`` draw them unshifted (what diffusers' own FLUX.2 LoRA scripts do).

dev's ``tokenizer`` folder is Mistral-Small-3.1's ``PixtralProcessor``, which transformers 5 builds only with
torchvision; the pipeline only applies its chat template to text, so the tokenizer is loaded alone (``AutoTokenizer``:
the same tokens, since the template starts with ``<s>`` and neither adds special tokens).

LoRA files
----------
The diffusers layout (``transformer.<module>``), which ``Flux2KleinPipeline.load_lora_weights`` and
``Flux2Pipeline.load_lora_weights`` load; and the ComfyUI layout (``--format kohya``): ComfyUI builds FLUX.2 with Black
Forest Labs' module names (:mod:`lightning_lora.formats.bfl`), and its loader (``comfy/lora.py``
``model_lora_keys_unet``) maps ``lora_unet_<BFL module with _>`` onto every weight of the model it built. The file
holds ``lora_down`` / ``lora_up`` / ``alpha`` per BFL module (LyCORIS tensors for DoRA and LoHa), the separate q/k/v
LoRAs fused exactly into one block-diagonal LoRA of rank ``3r`` (:mod:`lightning_lora.formats.kohya` explains the
algebra). diffusers reads the same file (``Flux2LoraLoaderMixin``: ``_convert_kohya_flux2_lora_to_diffusers``, which
splits a block-diagonal qkv back into rank-``r`` parts) except the modulation layers, dev's guidance embedder and the
final modulation, which it drops. A LoKr on q/k/v has no fused form: those parts are written one by one under
``lycoris_<diffusers name>``, which diffusers does not apply; export says so (ComfyUI maps those of the double
blocks' q/k/v, by the rules below). kohya's sd-scripts has no FLUX.2 network.

ComfyUI also reads part of a diffusers file: its FLUX.2 model is a kind of its FLUX model, so its FLUX rules
(``comfy/utils.py`` ``flux_to_diffusers``, each FLUX.1 diffusers name onto its BFL weight or rows of a fused one) apply
to the FLUX.2 layers that have FLUX.1's diffusers names: the double blocks' attention, ``x_embedder``,
``context_embedder``, ``proj_out`` and ``norm_out.linear``, in every release that runs FLUX.2. The SwiGLU MLPs
(``ff.linear_in`` / ``linear_out``) and the single blocks' fused ``to_qkv_mlp_proj`` / ``to_out`` entries came in
later releases, the shared modulation and guidance layers in none: :meth:`Flux2.lora_coverage` counts only what every
release applies, so a diffusers file loads in ComfyUI exactly when it holds only those layers, and the kohya file is
the one ComfyUI applies whole.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
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
from lightning_lora.families.encoders import MISTRAL_SMALL_31, QWEN3_4B_LM, QWEN3_8B_LM
from lightning_lora.families.facts import Architecture, Compiling, Editing, LoraFiles, Planning, RandomModels
from lightning_lora.families.flux import with_control_tokens
from lightning_lora.formats.bfl import flux2_lora_slices, flux2_slices_of, flux_slices_of
from lightning_lora.formats.clients import COMFY_PEFT_DORA, Coverage
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.kohya import KohyaLayout, KohyaNetwork, from_kohya_by, fused_to_kohya, separate_parts

__all__ = [
    "FLUX2_DEV_TRANSFORMER",
    "FLUX2_KLEIN_4B_TRANSFORMER",
    "FLUX2_KLEIN_9B_TRANSFORMER",
    "FLUX2_VAE",
    "Flux2",
    "Flux2TimestepSampling",
    "Flux2Variant",
    "empirical_mu",
    "image_ids",
    "normalize_latents",
    "pack",
    "patchify",
    "reference_ids",
    "text_ids",
]

Flux2Variant = Literal["klein", "dev"]
Flux2TimestepSampling = Literal["flux2_shift", "logit_normal", "uniform"]

_PIPELINES: dict[str, str] = {"klein": "Flux2KleinPipeline", "dev": "Flux2Pipeline"}
_COMFY_FLUX1_NAMES = (
    "ComfyUI's FLUX rules map a FLUX.2 diffusers name in every release only where FLUX.1 has it (double-block "
    "attention, embedders, final layer); its MLP and single-block entries came later: the kohya file loads whole"
)

FLUX2_KLEIN_4B_TRANSFORMER: dict[str, Any] = {
    "_class_name": "Flux2Transformer2DModel",
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 20,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 2000,
    "eps": 1e-06,
    "guidance_embeds": False,
}
"""FLUX.2 klein 4B's ``transformer/config.json`` (3.9 B parameters; the distilled and the base model share it)."""

FLUX2_KLEIN_9B_TRANSFORMER: dict[str, Any] = {
    **FLUX2_KLEIN_4B_TRANSFORMER,
    "num_layers": 8,
    "num_single_layers": 24,
    "num_attention_heads": 32,
    "joint_attention_dim": 12288,
}
"""FLUX.2 klein 9B's transformer (9.1 B parameters; Qwen3-8B captions: ``3 x 4096`` wide)."""

FLUX2_DEV_TRANSFORMER: dict[str, Any] = {
    **FLUX2_KLEIN_4B_TRANSFORMER,
    "num_layers": 8,
    "num_single_layers": 48,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "guidance_embeds": True,
}
"""FLUX.2 dev's transformer (32 B parameters; guidance-distilled; Mistral-Small-3.1 captions: ``3 x 5120`` wide)."""

FLUX2_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKLFlux2",
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 32,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "patch_size": [2, 2],
}
"""FLUX.2's ``vae/config.json`` (klein and dev share it; the rest is the class's defaults): 8x down into 32 channels,
patchified 2x2 to the transformer's 128. The pipelines undo the batch norm and the patches before decoding (on the
small latents: a few MiB), so the decode sees ``[1, 32, H/8, W/8]``, as the planner measures it
(:func:`lightning_lora.plan.sampling.sampling_pieces`)."""

_KLEIN_4B = ("black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-base-4B")
_KLEIN_9B = ("black-forest-labs/FLUX.2-klein-9B", "black-forest-labs/FLUX.2-klein-base-9B")
_DEV = "black-forest-labs/FLUX.2-dev"
_DISTILLED = {_KLEIN_4B[0]: True, _KLEIN_4B[1]: False, _KLEIN_9B[0]: True, _KLEIN_9B[1]: False}
"""``is_distilled`` of the klein hub models' ``model_index.json`` (the step-distilled models sample without CFG)."""

_COMFY_PREFIX = "model.diffusion_model."  # the transformer's keys in ComfyUI's all-in-one checkpoints
_ATTENTION = r"attn\.(to_q|to_k|to_v|to_out\.0)"
_TEXT_ATTENTION = r"attn\.(add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_SINGLE = r"attn\.(to_qkv_mlp_proj|to_out)"
_MLP = r"(ff|ff_context)\.(linear_in|linear_out)"
# The modules diffusers' kohya FLUX.2 converter reads (the rest it drops with a warning).
_DIFFUSERS_KOHYA = re.compile(
    r"^(transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|(ff|ff_context)\.linear_(in|out))"
    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)"
    r"|x_embedder|context_embedder|time_guidance_embed\.timestep_embedder\.linear_[12]|proj_out)$"
)
_COMFY_DORA = (
    "ComfyUI divides dora_scale by the row norms of the base weight, not of the patched one (ComfyUI PR #15458): close "
    "to the trained DoRA, not equal"
)
_DIFFUSERS_DORA = "diffusers drops dora_scale (the layer loads as a plain LoRA)"
# Names only FLUX.2's transformer has (diffusers names: its BFL names are FLUX.1's).
_OWN_MODULES = re.compile(
    r"(single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)\.|\.(ff|ff_context)\.linear_(in|out)\."
    r"|stream_modulation|time_guidance_embed)"
)

# compute_empirical_mu's fit (FLUX.2's sampling code): mu = A2 tokens + B2 at 200 steps (and above 4300 tokens for any
# step count), mu = A1 tokens + B1 at 10 steps, linear in the step count between those two.
_A1, _B1 = 8.73809524e-05, 1.89833333
_A2, _B2 = 0.00016927, 0.45666666


def empirical_mu(image_tokens: int, steps: int) -> float:
    """The ``mu`` of FLUX.2's sampling schedule (shift ``exp(mu)``) for ``image_tokens`` packed tokens and ``steps``
    steps: linear in the tokens, and for up to 4300 tokens linear in the step count between its values at 10 and 200
    steps (fewer steps, more shift)."""
    at_200 = _A2 * image_tokens + _B2
    if image_tokens > 4300:
        return at_200
    at_10 = _A1 * image_tokens + _B1
    slope = (at_200 - at_10) / 190.0
    return at_200 + slope * (steps - 200)


def patchify(z: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w] -> [B, 4C, h/2, w/2]``: pixel ``(i, j)`` of each 2x2 patch of channel ``c`` goes to channel
    ``4c + 2i + j``."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


def normalize_latents(vae: DiffusersModel, patched: torch.Tensor) -> torch.Tensor:
    """Patchified latents normalised by the VAE's batch-norm statistics (``(z - mean) / sqrt(var + eps)``)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patched)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).to(patched) + vae.config.batch_norm_eps)
    return (patched - mean) / std


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w] -> [B, h * w, C]``: one token per latent position, row-major."""
    return latents.flatten(2).transpose(1, 2)


def image_ids(h: int, w: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions ``[h * w, 4]`` = ``(0, row, col, 0)`` of the packed tokens of an ``h x w`` latent grid."""
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], dim=1)


def text_ids(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions ``[n, 4]`` = ``(0, 0, 0, l)`` of ``n`` text tokens."""
    ids = torch.zeros(n, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(n, device=device)
    return ids


def reference_ids(controls: torch.Tensor) -> torch.Tensor:
    """Positions ``[N h w, 4]`` of the packed tokens of reference latents ``[B, N, C, h, w]``, as the pipelines place
    them (``_prepare_image_ids``): reference ``i``'s token ``(r, c)`` is ``(10 + 10 i, r, c, 0)``."""
    n, h, w = controls.shape[1], controls.shape[3], controls.shape[4]
    ids = image_ids(h, w, controls.device).repeat(n, 1)
    ids[:, 0] = (10 + 10 * torch.arange(n, device=controls.device)).repeat_interleave(h * w)
    return ids


@functools.cache
def _text_facts(variant: str) -> tuple[tuple[int, ...], str]:
    """The hidden-state layers the variant's pipeline stacks (its ``encode_prompt`` default) and its system message
    (dev; empty for klein): read from diffusers, so a release that changes them changes the text cache key."""
    import diffusers

    cls = getattr(diffusers, _PIPELINES[variant])
    layers = tuple(inspect.signature(cls.encode_prompt).parameters["text_encoder_out_layers"].default)
    if variant == "klein":
        return layers, ""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return layers, SYSTEM_MESSAGE


class Flux2(DiffusionFamily):
    """FLUX.2 klein (4B / 9B, distilled or base) and FLUX.2 dev.

    Args:
        variant: ``klein`` (``Flux2KleinPipeline``: Qwen3 captions, no guidance input) or ``dev`` (``Flux2Pipeline``:
            Mistral-Small-3.1 captions, distilled guidance input). It must match ``model.pretrained``.
        guidance: the guidance value fed to a guidance-distilled transformer (dev) during training; klein has none.
        max_sequence_length: text tokens per prompt, chat template included (the pipelines' 512); longer prompts are
            cut. Pass the same value to the pipeline at inference if you change it.
        timestep_sampling: ``flux2_shift`` (logit-normal, shifted as FLUX.2's sampler shifts its schedule for the
            image size at ``inference_steps`` steps), ``logit_normal`` (unshifted) or ``uniform``.
        logit_mean: mean of the logit-normal draw.
        logit_std: standard deviation of the logit-normal draw.
        shift: a fixed shift for ``flux2_shift``; null means FLUX.2's own (image size and ``inference_steps``).
        inference_steps: the step count whose schedule ``flux2_shift`` follows (50: the pipelines' default; 4 for the
            distilled klein models' schedule, which shifts more).
    """

    name: ClassVar[str] = "flux2"
    architecture: ClassVar[Architecture] = Architecture(
        pipeline_classes=tuple(_PIPELINES.values()),
        denoiser_class="Flux2Transformer2DModel",
        denoiser_subfolder="transformer",
        text_encoders=("text_encoder",),  # Qwen3 (klein) / Mistral-Small-3.1 (dev)
        latent_divisor=16,
        lora_presets={
            # The image attention of the double blocks, and the single blocks' two projections (FLUX.2 fuses q, k, v
            # with the MLP input, and the attention output with the MLP output: there is no attention-only layer there).
            "attention": rf".*(transformer_blocks\.\d+\.{_ATTENTION}|single_transformer_blocks\.\d+\.{_SINGLE})",
            # Plus the text stream's attention projections in the double blocks.
            "attention_all": rf".*(transformer_blocks\.\d+\.({_ATTENTION}|{_TEXT_ATTENTION})"
            rf"|single_transformer_blocks\.\d+\.{_SINGLE})",
            # Plus the double blocks' SwiGLU MLPs: every linear layer inside the blocks.
            "all_linear": rf".*(transformer_blocks\.\d+\.({_ATTENTION}|{_TEXT_ATTENTION}|{_MLP})"
            rf"|single_transformer_blocks\.\d+\.{_SINGLE})",
        },
        step_distilled={_KLEIN_4B[0]: _KLEIN_4B[1], _KLEIN_9B[0]: _KLEIN_9B[1]},  # 4 steps; their base models
    )
    compiling: ClassVar[Compiling] = Compiling(stream_sources=("x_embedder", "context_embedder"))
    planning: ClassVar[Planning] = Planning(
        known_denoisers={
            **dict.fromkeys(_KLEIN_4B, FLUX2_KLEIN_4B_TRANSFORMER),
            **dict.fromkeys(_KLEIN_9B, FLUX2_KLEIN_9B_TRANSFORMER),
            _DEV: FLUX2_DEV_TRANSFORMER,
        },
        known_text_encoders={
            **dict.fromkeys(_KLEIN_4B, {"text_encoder": QWEN3_4B_LM}),
            **dict.fromkeys(_KLEIN_9B, {"text_encoder": QWEN3_8B_LM}),
            _DEV: {"text_encoder": MISTRAL_SMALL_31},
        },
        vae_architecture=FLUX2_VAE,
        # Compiled by inductor, full-width klein 4B blocks at 1024x1024 with 512-token captions kept 0.75
        # (double-stream) and 0.72 (single-stream) of what their eager forward saves, 0.73 of the whole model
        # (dev/probes/saved_share.py on the CPU; FLUX.1's measured 0.86 there against the 0.78 calibrated on the GPU, so
        # this errs high, the safe side). That was a share of the eager count as the CPU runs it; of the count made as
        # the GPU runs (autocast, the fused rms_norm) the same compiled bytes are 0.80.
        compiled_saved_fraction=0.80,
    )
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(
            DiffusersLayout("transformer"),
            KohyaLayout(  # ComfyUI's layout: BFL's names, q/k/v fused (module docstring)
                KohyaNetwork("networks.lora_flux2", "flux2"),  # sd-scripts has none: its FLUX.1 names, for FLUX.2
                to_kohya=functools.partial(fused_to_kohya, slices=flux2_lora_slices),
                from_kohya=functools.partial(from_kohya_by, loader="Flux2LoraLoaderMixin"),
            ),
        ),
        tools=("diffusers", "ComfyUI"),  # sd-scripts has no FLUX.2 network
        modelspec={"architecture": "flux-2/lora", "implementation": "https://github.com/black-forest-labs/flux2"},
        markers=("flux2", "flux-2"),  # kohya's, ModelSpec's
    )

    editing: ClassVar[Editing] = Editing(max_controls=None)  # reference images, in order; or none

    def __init__(
        self,
        variant: Flux2Variant = "klein",
        guidance: float = 1.0,
        max_sequence_length: int = 512,
        timestep_sampling: Flux2TimestepSampling = "flux2_shift",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        shift: float | None = None,
        inference_steps: int = 50,
    ) -> None:
        option = "model.family.init_args"
        if variant not in _PIPELINES:
            raise ConfigError(f"{option}.variant: {variant!r} is not one of {', '.join(_PIPELINES)}.")
        if max_sequence_length < 16:
            raise ConfigError(
                f"{option}.max_sequence_length: {max_sequence_length} leaves no room for a prompt (the chat template "
                "alone is about 12 tokens); use 512, the pipeline's default."
            )
        if shift is not None and shift <= 0:
            raise ConfigError(f"{option}.shift: {shift} must be positive (null: FLUX.2's own, by image size).")
        if inference_steps < 1:
            raise ConfigError(f"{option}.inference_steps: {inference_steps} must be at least 1 (50, or 4 distilled).")
        self.variant = variant
        self.guidance = guidance
        self.max_sequence_length = max_sequence_length
        self.timestep_sampling = timestep_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.shift = shift
        self.inference_steps = inference_steps

    # -- loading -----------------------------------------------------------------------------------------------
    @override
    def check_source(self, source: ModelSource) -> None:
        pipeline = _PIPELINES[self.variant]
        other = next(v for v in _PIPELINES if v != self.variant)
        try:
            check_source(source, (pipeline,))
        except ConfigError as e:
            if _PIPELINES[other] not in str(e):
                raise
            raise ConfigError(
                f"{e} FLUX.2 {other} is model.family.init_args.variant: {other} (it is {self.variant})."
            ) from None
        known = self.planning.known_denoisers.get(source.pretrained)
        if not source.is_local and known is not None and known["guidance_embeds"] != (self.variant == "dev"):
            raise ConfigError(
                f"model.family.init_args.variant: {source.pretrained} is FLUX.2 {other}, not {self.variant}; "
                f"set variant: {other}."
            )

    def load_denoiser(self, source: ModelSource) -> nn.Module:
        """The transformer; a single ``denoiser_file`` may hold BFL's names (the download for ComfyUI, which diffusers
        converts), diffusers' names, or either under ComfyUI's all-in-one prefix ``model.diffusion_model.`` (which
        diffusers' FLUX.2 converter does not strip: it is stripped here, and the file's other parts left out)."""
        from diffusers import Flux2Transformer2DModel
        from safetensors import safe_open

        file = source.denoiser_file
        if file is not None:
            with safe_open(file, framework="pt") as f:
                prefixed = any(k.startswith(_COMFY_PREFIX) for k in f.keys())
            if prefixed:
                from safetensors.torch import load_file

                weights = {
                    k.removeprefix(_COMFY_PREFIX): v for k, v in load_file(file).items() if k.startswith(_COMFY_PREFIX)
                }
                model = Flux2Transformer2DModel.from_single_file(
                    weights,
                    config=source.local_path,
                    subfolder=self.architecture.denoiser_subfolder,
                    torch_dtype=source.dtype,
                    local_files_only=source.is_local,
                )
                return model.requires_grad_(False).eval()
        return self.load_denoiser_weights(Flux2Transformer2DModel, source)

    def load_vae(self, source: ModelSource) -> nn.Module:
        from diffusers import AutoencoderKLFlux2

        vae = load_weights(AutoencoderKLFlux2.from_pretrained, source, "vae", torch_dtype=source.dtype)
        return vae.requires_grad_(False).eval()

    def load_text_encoders(self, source: ModelSource) -> Any:
        import diffusers
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        from transformers import AutoTokenizer

        if self.variant == "klein":
            from transformers import Qwen3ForCausalLM

            te: Any = load_weights(Qwen3ForCausalLM.from_pretrained, source, "text_encoder", dtype=source.dtype)
        else:
            from transformers import Mistral3ForConditionalGeneration

            te = load_weights(
                Mistral3ForConditionalGeneration.from_pretrained, source, "text_encoder", dtype=source.dtype
            )
        # dev's folder holds a PixtralProcessor, which transformers 5 builds only with torchvision installed; the
        # pipeline only applies its chat template to text, which its tokenizer does alike (the template starts with
        # <s>, so neither adds special tokens): the tokenizer alone is loaded, with or without torchvision.
        tokenizer = load_component(AutoTokenizer.from_pretrained, source, "tokenizer")
        if not tokenizer.chat_template:
            raise ConfigError(
                f"model.pretrained: the tokenizer of {source.pretrained!r} has no chat template (FLUX.2 wraps every "
                "prompt in it); use the model's own tokenizer folder, with its chat_template.jinja."
            )
        # A pipeline with only its text parts: encode_prompt is then exactly what inference does.
        cls = getattr(diffusers, _PIPELINES[self.variant])
        return cls(
            scheduler=None,
            vae=None,
            text_encoder=te.requires_grad_(False).eval(),
            tokenizer=tokenizer,
            transformer=None,
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.flux2 import save_tiny_flux2

        return save_tiny_flux2(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompt_embeds [B, max_sequence_length, 3 x hidden]``: the pipeline's ``encode_prompt`` (every position,
        pad tokens included: the transformer attends over all of them)."""
        layers, _ = _text_facts(self.variant)
        embeds, _ = encoders.encode_prompt(
            prompt=list(prompts),
            device=encoders.text_encoder.device,
            max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=layers,
        )
        return {"prompt_embeds": embeds}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.flux2 import RANDOM_FLUX2

        return RANDOM_FLUX2

    @torch.no_grad()
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [-1, 1] -> ``[B, 4 x channels, H/16, W/16]`` (float32): the posterior's mean
        (deterministic, so a cached entry has one right value), patchified, normalised by the VAE's batch norm."""
        z = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
        return normalize_latents(vae, patchify(z).float())

    @property
    @override
    def text_tokens(self) -> int:
        return self.max_sequence_length

    @override
    def text_cache_tag(self) -> str:
        layers, system = _text_facts(self.variant)
        digest = hashlib.sha256(json.dumps([list(layers), system]).encode()).hexdigest()[:8]
        return f"flux2-{self.variant}-len{self.max_sequence_length}-layers{digest}"

    @override
    def prompt_limit(self, encoders: Any) -> PromptLimit:
        if self.variant == "klein":
            tokenizer = encoders.tokenizer
            template = tokenizer.apply_chat_template(
                [{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            overhead = len(tokenizer(template).input_ids)
            return PromptLimit(tokenizer, self.max_sequence_length - overhead, "Qwen3")
        # dev: the pipeline's system turn and an empty user turn. The template holds <s>, which a plain call of the
        # tokenizer (what PromptLimit counts) adds too: that one is not the prompt's.
        tokenizer = getattr(encoders.tokenizer, "tokenizer", encoders.tokenizer)  # a PixtralProcessor's, or itself
        _, system = _text_facts("dev")
        messages = [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ]
        template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        overhead = len(tokenizer(template, add_special_tokens=False).input_ids)
        added = len(tokenizer("").input_ids)  # <s> of a plain call
        return PromptLimit(tokenizer, self.max_sequence_length - overhead + added, "Mistral")

    # -- training ----------------------------------------------------------------------------------------------
    def resolution_shift(self, image_tokens: int) -> float:
        """The shift ``exp(mu)`` FLUX.2's sampler applies for ``image_tokens`` tokens at ``inference_steps`` steps,
        or the fixed ``shift``."""
        if self.shift is not None:
            return self.shift
        return math.exp(empirical_mu(image_tokens, self.inference_steps))

    def sample_timesteps(self, latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        b, _, h, w = latents.shape  # patchified: one token per latent position
        mode = self.timestep_sampling
        return objectives.sample_sigmas(
            b,
            "flux_shift" if mode == "flux2_shift" else mode,
            generator=generator,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            shift=self.resolution_shift(h * w),
        )

    @override
    def prediction_layout(self, latent_map: torch.Tensor) -> torch.Tensor:
        """Packed as the latents are (:func:`pack`)."""
        return pack(latent_map)

    def predict(
        self, denoiser: DiffusersModel, batch: dict[str, torch.Tensor], noise: torch.Tensor, timesteps: torch.Tensor
    ) -> objectives.Prediction:
        x0 = batch["latents"].float()
        b, _, h, w = x0.shape
        dtype = compute_dtype(denoiser)
        sigmas = timesteps.to(x0.device).float()
        noisy = objectives.flow_match_noisy(x0, noise.float(), sigmas)
        text = batch["prompt_embeds"]
        guidance = None
        if getattr(denoiser.config, "guidance_embeds", False):
            guidance = torch.full((b,), self.guidance, device=x0.device, dtype=torch.float32)
        tokens, ids = pack(noisy), image_ids(h, w, x0.device)
        controls = batch.get("controls")
        if controls is not None:  # reference images: their tokens after the target's
            controls = controls.to(x0.device).float()
            b, n, c = controls.shape[:3]
            references = pack(controls.reshape(b * n, c, h, w)).reshape(b, n * h * w, c)
            tokens, ids = torch.cat([tokens, references], dim=1), torch.cat([ids, reference_ids(controls)])
        prediction = denoiser(
            hidden_states=tokens.to(dtype),
            encoder_hidden_states=text.to(device=x0.device, dtype=dtype),
            timestep=sigmas.to(dtype),  # as the pipeline rounds it: in the latents' dtype
            img_ids=ids,
            txt_ids=text_ids(text.shape[1], x0.device),
            guidance=guidance,
            return_dict=False,
        )[0][:, : h * w]  # the references' outputs are not predicted: the pipeline drops them
        target = pack(objectives.flow_match_target(x0, noise.float()))
        return objectives.Prediction(prediction, target)

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def is_distilled(self, source: ModelSource) -> bool:
        """``is_distilled`` of the klein pipeline's ``model_index.json`` (a step-distilled model ignores CFG)."""
        if self.variant != "klein":
            return False
        if not source.is_local and source.pretrained in _DISTILLED:
            return _DISTILLED[source.pretrained]
        from diffusers import Flux2KleinPipeline

        try:
            config = Flux2KleinPipeline.load_config(source.local_path, revision=source.revision)
        except (OSError, ValueError):
            return False
        return bool(config.get("is_distilled", False))

    @property
    @override
    def pipeline_class(self) -> str:
        return _PIPELINES[self.variant]

    @override
    def pipeline_options(self, source: ModelSource) -> dict[str, Any]:
        return {"is_distilled": self.is_distilled(source)} if self.variant == "klein" else {}

    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """As ``pipe(prompt, guidance_scale=...)`` draws it: klein base models with classifier-free guidance above 1
        (the cached empty prompt as the negative), distilled klein without, dev with ``guidance_scale`` as its guidance
        input."""
        extra: dict[str, Any] = {}
        guided = self.variant == "klein" and settings.guidance_scale > 1 and not pipeline.config.is_distilled
        if guided:
            if text.negative is None:
                raise ConfigError(
                    f"SampleImages guidance_scale: {settings.guidance_scale} needs the empty prompt's embeddings; use "
                    "1.0 (no classifier-free guidance)."
                )
            extra["negative_prompt_embeds"] = text.to_denoiser(text.negative["prompt_embeds"])
        return {
            "prompt_embeds": text.to_denoiser(text.embeddings["prompt_embeds"]),
            "guidance_scale": settings.guidance_scale,
            **extra,
        }

    @override
    def control_inputs(self, images: list[Any]) -> dict[str, Any]:
        """The references as ``image=[...]``; the pipelines refuse one under 64 pixels a side (a
        :class:`ConfigError` naming the sample's size)."""
        if not images:
            return {}
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        try:
            for image in images:
                Flux2ImageProcessor.check_image_input(image)
        except ValueError as e:
            raise ConfigError(f"SampleImages height/width: {e} (FLUX.2's pipelines' reference images).") from None
        return {"image": list(images)}

    # -- interop: what diffusers, ComfyUI and sd-scripts make of a FLUX.2 LoRA file (module docstring) ---------------
    @override
    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        c = Coverage()
        modules = list(variants)
        c.skip("kohya", modules, "kohya's sd-scripts has no FLUX.2 network")
        if format == "diffusers":  # ComfyUI's FLUX rules, which its FLUX.2 model gets (module docstring)
            flux1 = flux_slices_of(variants)
            c.skip("ComfyUI", [m for m in modules if m not in flux1], _COMFY_FLUX1_NAMES)
            c.approx("ComfyUI", [m for m, v in variants.items() if v == "DoRA"], COMFY_PEFT_DORA)
            return c
        separate = sorted(separate_parts(variants, flux2_slices_of(variants)))
        dora = [m for m, v in variants.items() if v == "DoRA" and m not in separate]
        lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
        # Parts without a fused form go under per-part lycoris_<diffusers name> names, which ComfyUI's FLUX rules map
        # where FLUX.1 has the name (the double blocks' q/k/v).
        flux1 = flux_slices_of(separate)
        c.skip("ComfyUI", [m for m in separate if m not in flux1], "no fused form: per-part names ComfyUI does not map")
        c.approx("ComfyUI", [m for m, v in variants.items() if v == "DoRA"], _COMFY_DORA)
        c.skip("diffusers", lycoris, "diffusers' FLUX.2 kohya converter reads lora_down/lora_up only")
        c.skip("diffusers", [m for m in separate if m not in lycoris], "written under per-part names")
        outside = [m for m in modules if not _DIFFUSERS_KOHYA.match(m) and m not in lycoris]
        c.skip(
            "diffusers", outside, "diffusers' kohya FLUX.2 converter drops it (modulation, guidance, final modulation)"
        )
        c.approx("diffusers", [m for m in dora if m not in outside], _DIFFUSERS_DORA)
        return c

    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """2 for FLUX.2's own diffusers names (its fused single-block projections, SwiGLU MLPs, shared modulation); its
        BFL names are FLUX.1's."""
        return 2 if any(_OWN_MODULES.search(k) for k in tensors) else 0

    # -- memory planning ---------------------------------------------------------------------------------------
    def example_inputs(
        self, model: DiffusersModel, batch: int, height: int, width: int, text_len: int, device: str, dtype: torch.dtype
    ) -> dict[str, Any]:
        c = model.config
        h, w = height // 16, width // 16
        return {
            "hidden_states": torch.empty(batch, h * w, c.in_channels, device=device, dtype=dtype),
            "encoder_hidden_states": torch.empty(batch, text_len, c.joint_attention_dim, device=device, dtype=dtype),
            "timestep": torch.empty(batch, device=device, dtype=dtype),
            "img_ids": image_ids(h, w, device),
            "txt_ids": text_ids(text_len, device),
            "guidance": torch.empty(batch, device=device, dtype=torch.float32) if c.guidance_embeds else None,
            "return_dict": False,
        }

    @override
    def example_inputs_with_controls(
        self,
        model: DiffusersModel,
        batch: int,
        height: int,
        width: int,
        text_len: int,
        controls: int,
        device: str,
        dtype: torch.dtype,
    ) -> dict[str, Any]:
        """The inputs with ``controls`` references of the target's size appended (twice the image tokens for one)."""
        return with_control_tokens(self.example_inputs(model, batch, height, width, text_len, device, dtype), controls)

    def block_count(self, model: DiffusersModel) -> int:
        return model.config.num_layers + model.config.num_single_layers

    @override
    def cached_latent_shape(self, config: Mapping[str, Any], height: int, width: int) -> tuple[int, int, int]:
        return (config["in_channels"], height // 16, width // 16)  # patchified, batch-normalised

    @override
    def example_text(
        self, config: Mapping[str, Any], batch: int, text_len: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Three LLM layers side by side, every one of the ``text_len`` positions (no mask)."""
        embeds = torch.randn(batch, text_len, config["joint_attention_dim"], generator=generator)
        return {"prompt_embeds": embeds.bfloat16()}

    @classmethod
    @override
    def text_length_options(cls, text_len: int) -> tuple[dict[str, Any], int]:
        return {"max_sequence_length": text_len}, text_len  # the denoiser attends over every padded position

    def sampling_bytes(self, model: DiffusersModel, height: int, width: int, text_len: int) -> float:
        c = model.config
        tokens = (height // 16) * (width // 16) + text_len
        inner = c.num_attention_heads * c.attention_head_dim
        mlp = int(inner * c.mlp_ratio)
        # The widest intermediates of a single block (the fused q, k, v and SwiGLU input, then the attention and MLP
        # outputs, bf16; the guided and unguided passes run one after the other) and the VAE decode at full
        # resolution (128 channels at full size, a few buffers, as FLUX.1's).
        block = tokens * (3 * inner + 2 * mlp + inner + mlp) * 2 * 2
        vae = height * width * 128 * 2 * 4
        return float(block + vae + 84e6 * 2)
