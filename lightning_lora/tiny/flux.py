"""The tiny FLUX.1 pipeline (see :mod:`lightning_lora.tiny` for the approach), built from configs alone:

* ``FluxTransformer2DModel`` with 2 double-stream and 2 single-stream blocks,
* ``AutoencoderKL`` with four blocks (so, like the real VAE, a spatial scale factor of 8),
* ``CLIPTextModel`` and ``T5EncoderModel`` with a couple of layers each,
* hand-built CLIP (byte-level BPE) and T5 (Unigram) tokenizers,
* ``FlowMatchEulerDiscreteScheduler`` with FLUX.1-dev's real scheduler config.

The ``dim64`` variant
---------------------
``dim64=True`` uses 16 latent channels (so the transformer's ``in_channels`` is 64, exactly like real FLUX) and sizes
every ``nn.Linear`` of the transformer and both text encoders so that ``in_features`` is a multiple of 64. bitsandbytes'
CPU 4-bit path crashes on layers with ``in_features < 64`` in eval mode without gradients (bitsandbytes 0.50:
``shape '[32, 0]' is invalid``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny.shared import (
    CLIP_MAX_LENGTH,
    SMALL_VAE,
    _build,
    _save_tiny,
    make_clip_tokenizer,
    make_t5_tokenizer,
)

__all__ = ["FLUX_DEV_SCHEDULER_CONFIG", "RANDOM_FLUX", "build_tiny_flux", "save_tiny_flux", "tiny_flux_vae"]

#: The scheduler config of black-forest-labs/FLUX.1-dev (``scheduler/scheduler_config.json``).
FLUX_DEV_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def tiny_flux_vae(seed: int, latent_channels: int = 16) -> AutoencoderKL:
    """FLUX.1's VAE in miniature (Z-Image uses the same one): 16 latent channels, scale factor 8, FLUX's
    ``scaling_factor`` / ``shift_factor``, no quant convs."""
    return _build(seed, "vae", lambda: AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,  # 4 blocks -> 3 downsamplings -> scale factor 8
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,  # FLUX VAE values
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ))  # fmt: skip


def build_tiny_flux(seed: int = 0, dim64: bool = False, guidance_embeds: bool = True) -> FluxPipeline:
    """A FLUX.1-dev-shaped ``FluxPipeline`` with tiny random weights (fp32, every component in ``eval()``).

    Args:
        seed: determines every weight; the same seed gives bit-identical weights in any process.
        dim64: 16 latent channels (transformer ``in_channels`` 64, like real FLUX) and every Linear of the transformer
            and text encoders with ``in_features`` a multiple of 64 (for bitsandbytes 4-bit on CPU). Otherwise 4
            latent channels (``in_channels`` 16) and widths of 16/32.
        guidance_embeds: True for a FLUX.1-dev-like model (distilled guidance input), False for schnell-like.
    """
    clip_tok = make_clip_tokenizer()
    t5_tok = make_t5_tokenizer()
    width = 64 if dim64 else 32  # text-encoder width = transformer's joint_attention_dim / pooled_projection_dim
    ffn = 128 if dim64 else 37  # an odd size catches shape mix-ups in the small variant
    latent_channels = 16 if dim64 else 4

    transformer = _build(seed, "transformer", lambda: FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # latents are packed 2x2 before the transformer
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32 if dim64 else 16,
        num_attention_heads=2,
        joint_attention_dim=width,
        pooled_projection_dim=width,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(8, 12, 12) if dim64 else (4, 4, 8),  # must sum to attention_head_dim
    ))  # fmt: skip
    vae = tiny_flux_vae(seed, latent_channels)
    text_encoder = _build(seed, "text_encoder", lambda: CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok),
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=width,
        bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id,
        pad_token_id=clip_tok.pad_token_id,
    )))  # fmt: skip
    text_encoder_2 = _build(seed, "text_encoder_2", lambda: T5EncoderModel(T5Config(  # type: ignore[call-arg]
        vocab_size=len(t5_tok),
        d_model=width,
        d_kv=width // 4,
        d_ff=ffn,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # like T5 v1.1 XXL
        dropout_rate=0.0,
        pad_token_id=t5_tok.pad_token_id,
        eos_token_id=t5_tok.eos_token_id,
        decoder_start_token_id=0,
    )))  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG)
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def save_tiny_flux(folder: Path, seed: int = 0, dim64: bool = False) -> Path:
    """Build the tiny FLUX pipeline and ``save_pretrained`` it to ``folder``; return ``folder``.

    ``FluxPipeline.from_pretrained(folder)`` loads it back with identical weights. If ``folder`` already holds a
    pipeline (``model_index.json``) it is returned untouched, unless it is a tiny pipeline made with other arguments
    (``FileExistsError``). Any other non-empty folder is never overwritten (``FileExistsError``). The pipeline is
    written to a temporary sibling folder first and renamed into place, so a crash never leaves a half-written
    pipeline that looks complete.

    Exactness: loaded with ``from_pretrained(folder, disable_mmap=True)`` the pipeline reproduces the in-memory one
    bit for bit. With the default memory-mapped load the weights are equal but not 64-byte aligned, and CPU matmuls
    then round differently (transformer outputs differ by ~4e-7).
    """
    wanted = {"seed": seed, "dim64": dim64, "guidance_embeds": True}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_flux(seed=seed, dim64=dim64), "FLUX")


RANDOM_FLUX = RandomModels(
    denoiser="black-forest-labs/FLUX.1-dev",
    tiny_denoiser={  # 1 double + 1 single block, 2 heads of 32
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": 64,
        "pooled_projection_dim": 64,
        "axes_dims_rope": (8, 12, 12),
    },
    tiny_vae=SMALL_VAE,
    scheduler="FlowMatchEulerDiscreteScheduler",
    scheduler_config=FLUX_DEV_SCHEDULER_CONFIG,
)
"""What the benchmark builds for FLUX.1 with random weights (:meth:`lightning_lora.families.Flux.random_models`)."""
