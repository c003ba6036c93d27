"""Chroma (lodestones/Chroma1-HD, Chroma1-Base): FLUX.1-schnell retrained, 8.9 B, T5 only, no guidance embedding.

Shapes, for an image of ``H x W`` pixels and a batch ``B`` (FLUX.1's where not said otherwise,
:mod:`lightning_lora.families.flux`):

* FLUX.1's VAE: latents ``[B, 16, H/8, W/8]``, normalised ``(z - shift_factor) * scaling_factor``, packed 2x2 into
  ``[B, (H/16)(W/16), 64]`` tokens; image sides are multiples of 16.
* The transformer is FLUX.1's 19 double-stream and 38 single-stream blocks *without* their modulation layers: one
  approximator MLP (``distilled_guidance_layer``, 5 layers of 5120) turns the timestep into every block's shift, scale
  and gate. No pooled CLIP vector, no guidance input (``ChromaTransformer2DModel``: 8.9 B parameters, FLUX.1-dev 11.9).
* Text: T5-XXL alone, run *with* its attention mask (FLUX.1 runs it without), up to ``max_sequence_length`` (512)
  tokens: ``prompt_embeds [B, 512, 4096]``. The transformer sees the prompt's tokens and the first padding token, the
  rest masked out (lodestones' training code; ``ChromaPipeline`` builds that mask). The cache keeps the padded
  embeddings and a ``prompt_mask [B, 512]`` (bool, true for the prompt's tokens and that one pad token).
* Timesteps are noise levels ``sigma``; the transformer multiplies them by 1000 inside (the pipeline feeds ``t /
  1000``) and predicts the velocity ``noise - x0``, as FLUX.1.

The mask, and a bug of diffusers'
---------------------------------
The masked text positions take no part in the attention, so the loss cuts the cached text to the batch's longest
prompt (plus its pad token) and masks only what remains: at batch 1 there is no mask at all (every attention kernel,
FlashAttention too), and a 20-token prompt costs 21 text tokens, not 512. The result is the masked 512-token forward's.
The mask is boolean (keep / drop). diffusers 0.42's ``ChromaPipeline`` hands the transformer the same mask as *float*
0/1, which PyTorch's attention *adds* to the scores (a bias of +1 on the kept pairs) instead of masking: an open bug
(diffusers issue #13619; fixed once in PR #12263, undone by PR #12508). lightning-lora trains the model as lodestones
trained it and ComfyUI runs it (padding masked), and draws its samples through ``ChromaPipeline`` with the boolean mask
that PR #12263 gave it; ``tests/families/test_chroma.py`` shows both numbers.

Two more facts of diffusers' Chroma that the family works around: with gradient checkpointing, its single blocks are
called without the mask (``ChromaTransformer2DModel.forward``), so the family checkpoints inside each block instead
(``compiling.checkpoints_in_blocks``); and its single-file converter hard-codes FLUX.1's widths (3072).

Guidance: Chroma samples with real classifier-free guidance, two forwards a step, ``neg + scale * (pos - neg)`` with a
negative prompt (the samples use the empty one), ``guidance_scale`` above 1 (the pipeline's default 5.0); 1 or less
samples without a negative.

LoRA files: the diffusers layout (``transformer.<module>``: ``ChromaPipeline.load_lora_weights``; ComfyUI builds Chroma
as a kind of FLUX and maps these names onto its fused weights, ``comfy/lora.py``'s FLUX rules) and the ComfyUI layout
(``diffusion_model.<original module>``, q/k/v fused as in the checkpoint: :mod:`lightning_lora.formats.comfyui`), which
every ComfyUI release that runs Chroma maps and diffusers reads as a kohya FLUX file. :meth:`Chroma.lora_coverage` says
which layers each tool applies.
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
from lightning_lora.families.encoders import T5_XXL
from lightning_lora.families.facts import Architecture, Compiling, LoraFiles, Planning, RandomModels
from lightning_lora.families.flux import FLUX1_VAE, Flux, flux_vae_latents, latent_image_ids, pack_latents
from lightning_lora.formats.bfl import FluxDims
from lightning_lora.formats.chroma import chroma_lora_slices, chroma_slice
from lightning_lora.formats.clients import COMFY_DORA, COMFY_PEFT_DORA, DIFFUSERS_DORA, Coverage, rules_unknown
from lightning_lora.formats.comfyui import ComfyLayout
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.kohya import flux_from_kohya, separate_parts
from lightning_lora.objectives import TimestepSampling

__all__ = ["CHROMA_TRANSFORMER", "Chroma", "text_for_denoiser"]

_HUB_IDS = ("lodestones/Chroma1-HD", "lodestones/Chroma1-Base")

CHROMA_TRANSFORMER: dict[str, Any] = {
    "_class_name": "ChromaTransformer2DModel",
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "axes_dims_rope": [16, 56, 56],
    "approximator_num_channels": 64,
    "approximator_hidden_dim": 5120,
    "approximator_layers": 5,
}
"""lodestones/Chroma1-HD's ``transformer/config.json`` (8.9 B parameters; Chroma1-Base has the same architecture):
``ChromaTransformer2DModel``'s defaults, which diffusers' ``from_single_file`` also assumes for the original files."""

# The modules outside the blocks: kohya's FLUX converter in diffusers drops them; the approximator has no FLUX name.
_OUTSIDE_BLOCKS = re.compile(r"^(x_embedder|context_embedder|proj_out|distilled_guidance_layer\..+)$")
_APPROXIMATOR = re.compile(r"^distilled_guidance_layer\.")
# FLUX.1's layers that Chroma pruned, in any layout (diffusers, BFL; dots or underscores).
_PRUNED = re.compile(
    r"norm1(_context)?[._]linear|(^|[._])norm[._]linear|norm_out[._]linear|time_text_embed|img_mod|txt_mod"
    r"|modulation[._]lin|time_in|vector_in|guidance_in|adaLN_modulation"
)
_UNIT = FluxDims(1, 4)  # which parts share a fused layer is all a name tells


def _named(module: str) -> bool:
    """Whether ``module`` is a layer of the Chroma transformer (it has an original name)."""
    try:
        chroma_slice(module, _UNIT)
    except KeyError:
        return False
    return True


def text_for_denoiser(
    embeds: torch.Tensor, mask: torch.Tensor, image_tokens: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cached ``embeds [B, L, D]`` cut to the longest prompt of the batch (``mask [B, L]``, true for each prompt's
    tokens and its first pad token), and the joint attention mask ``[B, text + image_tokens]`` (bool, True: attend) of
    what remains, or None where every remaining text token is attended (a batch of 1: no mask at all)."""
    mask = mask.to(device=embeds.device, dtype=torch.bool)
    kept = int(mask.sum(dim=1).max())
    embeds, mask = embeds[:, :kept], mask[:, :kept]
    if bool(mask.all()):
        return embeds, None
    return embeds, torch.cat([mask, mask.new_ones(mask.shape[0], image_tokens)], dim=1)


class Chroma(DiffusionFamily):
    """Chroma1-HD / Chroma1-Base.

    Args:
        max_sequence_length: T5 tokens per prompt (512, the pipeline's limit); longer prompts are cut.
        timestep_sampling: ``flux_shift`` (logit-normal, shifted by image size as the pipeline's schedule is),
            ``logit_normal`` (SD3) or ``uniform``.
        logit_mean: mean of the logit-normal draw.
        logit_std: standard deviation of the logit-normal draw.
        shift: a fixed shift for ``flux_shift``; null means FLUX's resolution-dependent value.
    """

    name: ClassVar[str] = "chroma"
    architecture: ClassVar[Architecture] = Architecture(
        pipeline_classes=("ChromaPipeline",),
        denoiser_class="ChromaTransformer2DModel",
        denoiser_subfolder="transformer",
        text_encoders=("text_encoder",),  # T5-XXL
        latent_divisor=16,
        lora_presets=Flux.architecture.lora_presets,  # FLUX.1's blocks and layer names
    )
    compiling: ClassVar[Compiling] = Compiling(
        stream_sources=("x_embedder", "context_embedder"),
        joined_streams=("transformer_blocks",),
        checkpoints_in_blocks=True,  # diffusers' own checkpointing drops the single blocks' attention mask
    )
    planning: ClassVar[Planning] = Planning(
        known_denoisers=dict.fromkeys(_HUB_IDS, CHROMA_TRANSFORMER),
        known_text_encoders=dict.fromkeys(_HUB_IDS, {"text_encoder": T5_XXL}),
        vae_architecture=FLUX1_VAE,
    )
    lora_files: ClassVar[LoraFiles] = LoraFiles(
        layouts=(
            DiffusersLayout("transformer"),
            ComfyLayout(
                slices=chroma_lora_slices,
                from_comfy=lambda tensors: flux_from_kohya(_as_kohya(tensors)),
            ),
        ),
        tools=("diffusers", "ComfyUI"),  # lightning-lora knows no kohya sd-scripts rules for Chroma
        # The IDs kohya's sd-scripts writes for Chroma LoRAs (library/sai_model_spec.py).
        modelspec={"architecture": "chroma/lora", "implementation": "https://huggingface.co/lodestones/Chroma"},
        markers=("chroma",),
    )

    def __init__(
        self,
        max_sequence_length: int = 512,
        timestep_sampling: TimestepSampling = "flux_shift",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        shift: float | None = None,
    ) -> None:
        if not 1 <= max_sequence_length <= 512:
            raise ConfigError(
                f"model.family.init_args.max_sequence_length: {max_sequence_length}; ChromaPipeline reads 1 to 512 T5 "
                "tokens (512, its default)."
            )
        self.max_sequence_length = max_sequence_length
        self.timestep_sampling = timestep_sampling
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.shift = shift

    # -- loading -----------------------------------------------------------------------------------------------
    def load_text_encoders(self, source: ModelSource) -> Any:
        from diffusers import ChromaPipeline
        from transformers import T5EncoderModel, T5TokenizerFast  # type: ignore[attr-defined]
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        text_encoder = load_weights(T5EncoderModel.from_pretrained, source, "text_encoder", dtype=source.dtype)
        # A pipeline with only its text parts: encode_prompt is then exactly what inference does.
        return ChromaPipeline(
            scheduler=None,
            vae=None,
            text_encoder=text_encoder.requires_grad_(False).eval(),
            tokenizer=load_component(T5TokenizerFast.from_pretrained, source, "tokenizer"),
            transformer=None,
        )

    @classmethod
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.chroma import save_tiny_chroma

        return save_tiny_chroma(folder, seed=seed)

    # -- encoding ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _, mask, *_ = encoders.encode_prompt(
            prompt=list(prompts),
            device=encoders.text_encoder.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "prompt_mask": mask.bool()}

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.chroma import RANDOM_CHROMA

        return RANDOM_CHROMA

    @torch.no_grad()
    def encode_images(self, vae: DiffusersModel, pixels: torch.Tensor) -> torch.Tensor:
        return flux_vae_latents(vae, pixels)

    @property
    @override
    def text_tokens(self) -> int:
        return self.max_sequence_length

    @override
    def text_cache_tag(self) -> str:
        # T5 with its attention mask (FLUX.1's cache runs it without); the kept pad token is the mask's.
        return f"chroma-t5-masked-len{self.max_sequence_length}"

    @override
    def prompt_limit(self, encoders: Any) -> PromptLimit:
        return PromptLimit(encoders.tokenizer, self.max_sequence_length, "T5")

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
        """Packed as the latents are (:func:`~lightning_lora.families.flux.pack_latents`)."""
        return pack_latents(latent_map)

    @override
    def predict(
        self, denoiser: DiffusersModel, batch: dict[str, torch.Tensor], noise: torch.Tensor, timesteps: torch.Tensor
    ) -> objectives.Prediction:
        x0 = batch["latents"]
        _, _, h, w = x0.shape
        dtype = compute_dtype(denoiser)
        sigmas = timesteps.to(x0.device)
        noisy = objectives.flow_match_noisy(x0.float(), noise.float(), sigmas)
        text, mask = text_for_denoiser(batch["prompt_embeds"], batch["prompt_mask"], (h // 2) * (w // 2))
        prediction = denoiser(
            hidden_states=pack_latents(noisy).to(dtype),
            encoder_hidden_states=text.to(dtype),
            timestep=sigmas.to(dtype),
            img_ids=latent_image_ids(h, w, device=x0.device, dtype=dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=x0.device, dtype=dtype),
            attention_mask=mask,
            return_dict=False,
        )[0]
        target = pack_latents(objectives.flow_match_target(x0.float(), noise.float()))
        return objectives.Prediction(prediction, target)

    # -- sampling ----------------------------------------------------------------------------------------------
    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """The prompt's (and, with ``guidance_scale`` above 1, the empty prompt's) embeddings cut to their tokens, each
        with its boolean mask (the pipeline keeps a boolean mask boolean: see the module docstring)."""

        def cut(embeddings: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            embeds, _ = text_for_denoiser(embeddings["prompt_embeds"], embeddings["prompt_mask"], 0)
            return text.to_denoiser(embeds), torch.ones(embeds.shape[:2], dtype=torch.bool, device=text.device)

        embeds, mask = cut(text.embeddings)
        inputs: dict[str, Any] = {
            "prompt_embeds": embeds,
            "prompt_attention_mask": mask,
            "guidance_scale": settings.guidance_scale,
        }
        if settings.guidance_scale > 1:  # the pipeline's CFG: neg + scale * (pos - neg)
            if text.negative is None:
                raise ConfigError(
                    f"SampleImages guidance_scale: {settings.guidance_scale} needs the empty prompt's embeddings (the "
                    "negative prompt); use 1.0 to sample without guidance."
                )
            inputs["negative_prompt_embeds"], inputs["negative_prompt_attention_mask"] = cut(text.negative)
        return inputs

    # -- interop -----------------------------------------------------------------------------------------------
    @override
    def lora_coverage(self, format: str, variants: Mapping[str, str]) -> Coverage:
        """diffusers: its own layout whole; a ComfyUI-layout file as a kohya FLUX file (its converter keeps the blocks'
        plain LoRA layers). ComfyUI: a diffusers file through its FLUX rules (``comfy/utils.py`` ``flux_to_diffusers``:
        the blocks' layers, the embedders and ``proj_out``; no approximator layer), its own layout whole. kohya's
        sd-scripts: nothing lightning-lora knows of."""
        c = Coverage()
        modules = list(variants)
        dora = [m for m, v in variants.items() if v == "DoRA"]
        c.skip("kohya", modules, "lightning-lora knows no kohya sd-scripts rules for Chroma")
        if format == "diffusers":
            approximator = [m for m in modules if _APPROXIMATOR.match(m)]
            c.skip("ComfyUI", approximator, "ComfyUI's FLUX rules name no approximator layer (its ComfyUI name does)")
            c.approx("ComfyUI", dora, COMFY_PEFT_DORA)
            return c
        if format != "comfyui":
            return rules_unknown(self.name, format, variants)
        separate = sorted(separate_parts(variants, {m: chroma_slice(m, _UNIT) for m in modules if _named(m)}))
        lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
        c.skip("diffusers", lycoris, "diffusers' kohya FLUX converter reads lora_down/lora_up only")
        c.skip(
            "diffusers", separate, "written under ComfyUI's per-part names, which diffusers' converter does not read"
        )
        c.skip(
            "diffusers", [m for m in modules if _OUTSIDE_BLOCKS.match(m)], "diffusers' kohya FLUX converter drops it"
        )
        if any(_APPROXIMATOR.match(m) for m in modules):
            c.skip("diffusers", modules, "diffusers' kohya FLUX converter refuses a file with approximator layers")
        c.approx("diffusers", dora, DIFFUSERS_DORA)
        c.approx("ComfyUI", dora, COMFY_DORA)
        return c

    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """2 for the approximator, Chroma's own module; 1 for FLUX.1's names where Flux claims them and none of them is
        a layer Chroma pruned (the modulations, the timestep, pooled-text and guidance embedders): FLUX.1's and
        Chroma's blocks share their names and widths, so such a file is either's (its header or ``--family`` says);
        0 otherwise."""
        if any("distilled_guidance_layer" in k for k in tensors):
            return 2
        return 1 if Flux.claims_lora_keys(tensors) and not any(_PRUNED.search(k) for k in tensors) else 0

    # -- memory planning ---------------------------------------------------------------------------------------
    def example_inputs(
        self, model: DiffusersModel, batch: int, height: int, width: int, text_len: int, device: str, dtype: torch.dtype
    ) -> dict[str, Any]:
        """One forward's arguments at the longest text (no mask: every text token attended)."""
        c = model.config
        tokens = (height // 16) * (width // 16)
        return {
            "hidden_states": torch.empty(batch, tokens, c.in_channels, device=device, dtype=dtype),
            "encoder_hidden_states": torch.empty(batch, text_len, c.joint_attention_dim, device=device, dtype=dtype),
            "timestep": torch.empty(batch, device=device, dtype=dtype),
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
        """T5 features of ``text_len`` tokens (the prompt and its pad token), zeros to the cached length, the mask."""
        embeds = torch.zeros(batch, self.max_sequence_length, config["joint_attention_dim"])
        embeds[:, :text_len] = torch.randn(batch, text_len, config["joint_attention_dim"], generator=generator)
        mask = (torch.arange(self.max_sequence_length) < text_len).expand(batch, -1)
        return {"prompt_embeds": embeds.bfloat16(), "prompt_mask": mask}

    @classmethod
    @override
    def text_length_options(cls, text_len: int) -> tuple[dict[str, Any], int]:
        # The denoiser sees the prompt's tokens alone: the cache keeps the pipeline's length (512, the shipped one's).
        return {"max_sequence_length": max(text_len, 512)}, text_len

    def sampling_bytes(self, model: DiffusersModel, height: int, width: int, text_len: int) -> float:
        c = model.config
        tokens = (height // 16) * (width // 16) + text_len
        inner = c.num_attention_heads * c.attention_head_dim
        block = tokens * (3 * inner + 4 * inner + inner) * 2  # batch 1: the two CFG forwards run one after the other
        return float(block + height * width * 128 * 2 * 4 + 84e6 * 2)


def _as_kohya(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ComfyUI-layout file's tensors under kohya's names (``diffusion_model.a.b`` -> ``lora_unet_a_b``), as diffusers'
    FLUX converter reads them."""
    out = {}
    for key, tensor in tensors.items():
        module, _, suffix = key.removeprefix("diffusion_model.").partition(".lora_")
        if suffix:
            out[f"lora_unet_{module.replace('.', '_')}.lora_{suffix}"] = tensor
        else:
            module, _, suffix = key.removeprefix("diffusion_model.").rpartition(".")
            out[f"lora_unet_{module.replace('.', '_')}.{suffix}"] = tensor
    if any("distilled_guidance_layer" in k for k in out):
        raise ValueError("holds approximator (distilled_guidance_layer) layers, which diffusers' converter cannot read")
    return out
