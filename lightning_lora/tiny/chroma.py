"""A tiny, randomly initialised Chroma pipeline, built offline and deterministically (see :mod:`lightning_lora.tiny`).

Chroma (lodestones/Chroma1-HD) is a ``ChromaPipeline`` of five components; this module builds each from a config with
the real model's *structure* and tiny widths:

* ``ChromaTransformer2DModel``: 2 double-stream and 2 single-stream blocks (the real model: 19 and 38) of 2 heads of
  16, 16 latent channels packed 2x2 (``in_channels`` 64, as the real model), T5's 64-wide features as its
  ``joint_attention_dim``, and the approximator (``distilled_guidance_layer``, which makes every block's modulation
  from the timestep) with 2 layers of 32 instead of 5 of 5120;
* FLUX.1's VAE in miniature (:func:`lightning_lora.tiny.flux.tiny_flux_vae`: 16 latent channels, scale factor 8),
  which Chroma uses;
* ``T5EncoderModel``, 2 layers 64 wide (every linear layer's input a multiple of 64, so bitsandbytes' CPU NF4 path
  takes them), and the hand-built T5 tokenizer (:func:`lightning_lora.tiny.shared.make_t5_tokenizer`);
* ``FlowMatchEulerDiscreteScheduler`` with FLUX.1's scheduler config (Chroma keeps FLUX's resolution-dependent shift).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
from transformers import T5Config, T5EncoderModel

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny.flux import FLUX_DEV_SCHEDULER_CONFIG, tiny_flux_vae
from lightning_lora.tiny.shared import SMALL_VAE, _build, _save_tiny, make_t5_tokenizer

__all__ = ["RANDOM_CHROMA", "TINY_CHROMA_TRANSFORMER", "build_tiny_chroma", "save_tiny_chroma"]

TINY_CHROMA_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels, packed 2x2
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 64,
    "axes_dims_rope": [4, 4, 8],  # sums to the head width
    "approximator_num_channels": 16,  # its input: timestep, guidance (0) and block index embeddings, 4 channels each
    "approximator_hidden_dim": 32,
    "approximator_layers": 2,
}
"""The tiny transformer's config (the benchmark's ``--tiny`` Chroma too)."""


def build_tiny_chroma(seed: int = 0) -> ChromaPipeline:
    """A Chroma-shaped ``ChromaPipeline`` with tiny random weights (fp32, every component in ``eval()``); the same
    ``seed`` gives bit-identical weights in any process. See the module docstring for the shapes."""
    tokenizer = make_t5_tokenizer()
    with warnings.catch_warnings():  # diffusers 0.42's Chroma builds FLUX's position embedding by a deprecated path
        warnings.filterwarnings("ignore", message=".*FluxPosEmbed.*", category=FutureWarning)
        transformer = _build(seed, "transformer", lambda: ChromaTransformer2DModel(**TINY_CHROMA_TRANSFORMER))
    text_encoder = _build(seed, "text_encoder", lambda: T5EncoderModel(T5Config(  # type: ignore[call-arg]
        vocab_size=len(tokenizer),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # like T5 v1.1 XXL
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=0,
    )))  # fmt: skip
    return ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG),
        vae=tiny_flux_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def save_tiny_chroma(folder: Path, seed: int = 0) -> Path:
    """Build the tiny Chroma pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`); ``ChromaPipeline.from_pretrained(folder)`` loads it back."""
    return _save_tiny(Path(folder), {"family": "chroma", "seed": seed}, lambda: build_tiny_chroma(seed=seed), "Chroma")


RANDOM_CHROMA = RandomModels(
    denoiser="lodestones/Chroma1-HD",
    tiny_denoiser=TINY_CHROMA_TRANSFORMER,
    tiny_vae=SMALL_VAE,  # Chroma decodes with FLUX.1's VAE
    scheduler="FlowMatchEulerDiscreteScheduler",
    scheduler_config=FLUX_DEV_SCHEDULER_CONFIG,
)
"""What the benchmark builds for Chroma with random weights (:meth:`lightning_lora.families.Chroma.random_models`)."""
