"""A tiny, randomly initialised Qwen-Image pipeline, built offline and deterministically (see :mod:`lightning_lora.tiny`
for the approach and the FLUX / SDXL / SD1.5 builders; this module adds Qwen-Image's parts).

What is built
-------------
A ``QwenImagePipeline`` with the real structure and configs at tiny widths:

* ``QwenImageTransformer2DModel``: 2 dual-stream blocks, 2 heads of 16 (RoPE axes 4 + 6 + 6), latent patches of 2x2
  over 4 latent channels (``in_channels`` 16, ``out_channels`` 4), text width 64;
* ``AutoencoderKLQwenImage``: the real causal-3D layout (4 levels, temporal downsampling flags ``[False, True, True]``:
  a spatial scale factor of 8 like the real VAE), 8 base channels, 4 latent channels with per-channel
  ``latents_mean`` / ``latents_std`` (the real VAE's first four values, so the normalisation is exercised);
* ``Qwen2_5_VLForConditionalGeneration``: a 2-layer text model 64 wide (multiples of 64, so NF4 works on the CPU, see
  :mod:`lightning_lora.tiny.flux`) with multimodal RoPE sections ``[4, 6, 6]`` (half the head width of 32, as the real
  model's ``[16, 24, 24]`` is half of 128), and a 1-block vision tower (never run: Qwen-Image reads text only);
* a byte-level BPE ``Qwen2Tokenizer`` written out by hand;
* ``FlowMatchEulerDiscreteScheduler`` with Qwen/Qwen-Image's real scheduler config
  (:data:`QWEN_IMAGE_SCHEDULER_CONFIG`).

The tokenizer
-------------
Qwen's tokenizer is GPT-2-style byte-level BPE: a regular expression splits the text into words (a word keeps its
leading space), every byte becomes a printable character (the space is ``Ġ``, the newline ``Ċ``) and merges glue
characters into tokens. The pipeline wraps each prompt in a chat template and drops its first
``prompt_template_encode_start_idx`` = 34 tokens (the system message and the user turn's header), a number that is
right for the real tokenizer, where every word of the template is one token. The tiny vocabulary has the same
property: every word of the template and of :data:`~lightning_lora.tiny.shared.CAPTION_WORDS` (with and without its
leading space) is one token, so the template's header is exactly 34 tokens here too and the kept embeddings are the
prompt's tokens plus the 5 that close the template (``<|im_end|>``, ``Ċ``, ``<|im_start|>``, ``assistant``, ``Ċ``). The
merges are built like the tiny CLIP vocabulary's (each word glued left to right with merges that rank below every
earlier one, so no later word changes how an earlier one splits); no trainer, so token ids never change between
processes. The three special tokens come last: ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of
sequence).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny.shared import CAPTION_WORDS, _build, _save_tiny, byte_level_bpe

__all__ = [
    "QWEN_IMAGE_SCHEDULER_CONFIG",
    "RANDOM_QWENIMAGE",
    "TEMPLATE_WORDS",
    "build_tiny_qwenimage",
    "make_qwen_tokenizer",
    "qwen_vocab_and_merges",
    "save_tiny_qwenimage",
    "tiny_qwen_transformer",
    "tiny_qwen_vae",
    "tiny_qwen_vl",
]

#: The scheduler config of Qwen/Qwen-Image (``scheduler/scheduler_config.json``): a dynamic ("exponential") shift
#: ``exp(mu)`` with ``mu`` linear in the image tokens from 0.5 at 256 to 0.9 at 8192, and the inference schedule
#: stretched to end at sigma 0.02.
QWEN_IMAGE_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

#: The words of QwenImagePipeline's prompt template (each one token in the tiny vocabulary, as in the real one).
TEMPLATE_WORDS: tuple[str, ...] = (
    "system", "Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity", "text",
    "spatial", "relationships", "of", "objects", "and", "background", "user", "assistant",
)  # fmt: skip

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
_TEXT_WIDTH, _LATENT_CHANNELS = 64, 4
# The real VAE's first four per-channel statistics (AutoencoderKLQwenImage's defaults, Qwen/Qwen-Image vae/config.json).
_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075]
_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558]


def qwen_vocab_and_merges(
    words: Iterable[str] = (*TEMPLATE_WORDS, *CAPTION_WORDS),
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary and merges of the tiny Qwen tokenizer
    (:func:`lightning_lora.tiny.shared.byte_level_bpe`): the byte characters, every piece the merges make, then the
    three special tokens."""
    return byte_level_bpe(words, (ENDOFTEXT, IM_START, IM_END))


def make_qwen_tokenizer(
    words: Iterable[str] = (*TEMPLATE_WORDS, *CAPTION_WORDS), specials: tuple[str, ...] = ()
) -> Qwen2Tokenizer:
    """The tiny Qwen2 tokenizer, in memory (pad ``<|endoftext|>``, eos ``<|im_end|>``, right padding); ``words``: the
    words that are one token each, ``specials``: special tokens after the three (the edit pipelines' vision ones)."""
    vocab, merges = byte_level_bpe(words, (ENDOFTEXT, IM_START, IM_END, *specials))
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # tokenizers takes (left, right) pairs
        unk_token=None,  # type: ignore[arg-type]  # byte-level: every text has tokens
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END, *specials],
        model_max_length=32768,
    )


def tiny_qwen_transformer(seed: int, **options: Any) -> QwenImageTransformer2DModel:
    """The tiny Qwen-Image transformer (module docstring); ``options``: more of its config (``zero_cond_t``)."""
    return _build(seed, "transformer", lambda: QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * _LATENT_CHANNELS,  # 2x2 latent patches are packed into one token
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_WIDTH,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        **options,
    ))  # fmt: skip


def tiny_qwen_vae(seed: int = 0) -> AutoencoderKLQwenImage:
    """The tiny ``AutoencoderKLQwenImage`` (see the module docstring): Qwen-Image's VAE, which Krea 2 uses too."""
    return _build(seed, "vae", lambda: AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # 3 downsamplings: scale factor 8, as the real VAE
        latents_mean=_LATENTS_MEAN,
        latents_std=_LATENTS_STD,
    ))  # fmt: skip


def tiny_qwen_vl(seed: int, tokenizer: Qwen2Tokenizer, **ids: Any) -> Qwen2_5_VLForConditionalGeneration:
    """The tiny Qwen2.5-VL (module docstring) for ``tokenizer``'s vocabulary; ``ids``: its vision token ids (an edit
    model's, whose vision tower runs)."""
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": _TEXT_WIDTH,
            "intermediate_size": 2 * _TEXT_WIDTH,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e6},
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": _TEXT_WIDTH,
            "patch_size": 2,
            "temporal_patch_size": 1,
        },
        **ids,
    )
    return _build(seed, "text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(config))


def build_tiny_qwenimage(seed: int = 0) -> QwenImagePipeline:
    """A Qwen-Image-shaped ``QwenImagePipeline`` with tiny random weights (fp32, every component in ``eval()``); see the
    module docstring. The same ``seed`` gives bit-identical weights in any process."""
    tokenizer = make_qwen_tokenizer()
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=tiny_qwen_vae(seed),
        text_encoder=tiny_qwen_vl(seed, tokenizer),
        tokenizer=tokenizer,
        transformer=tiny_qwen_transformer(seed),
    )


def save_tiny_qwenimage(folder: Path, seed: int = 0) -> Path:
    """Build the tiny Qwen-Image pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`)."""
    wanted = {"family": "qwenimage", "seed": seed}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_qwenimage(seed), "Qwen-Image")


TINY_QWEN_VAE: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": _LATENT_CHANNELS,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "latents_mean": _LATENTS_MEAN,
    "latents_std": _LATENTS_STD,
}
"""What the benchmark's tiny ``AutoencoderKLQwenImage`` changes in the real one: the tiny transformers' 4 latent
channels (Krea 2 decodes with it too)."""

RANDOM_QWENIMAGE = RandomModels(
    denoiser="Qwen/Qwen-Image",
    tiny_denoiser={  # the tiny pipeline's transformer: 2 blocks, 2 heads of 16, 4 latent channels
        "in_channels": 4 * _LATENT_CHANNELS,
        "out_channels": _LATENT_CHANNELS,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": _TEXT_WIDTH,
        "axes_dims_rope": [4, 6, 6],
    },
    tiny_vae=TINY_QWEN_VAE,
    scheduler="FlowMatchEulerDiscreteScheduler",
    scheduler_config=QWEN_IMAGE_SCHEDULER_CONFIG,
)
"""What the benchmark builds for Qwen-Image with random weights (``QwenImage.random_models``)."""
