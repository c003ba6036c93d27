"""A tiny, randomly initialised FLUX.2 klein pipeline, built offline and deterministically (see
:mod:`lightning_lora.tiny` for the approach; the Qwen tokenizer is Z-Image's, :mod:`lightning_lora.tiny_zimage`).

What is built
-------------
A ``Flux2KleinPipeline`` with the real structure and configs at tiny widths:

* ``Flux2Transformer2DModel``: 2 double-stream and 2 single-stream blocks (klein 4B has 5 and 20), 2 heads of 32
  split into four rotary axes of 8 (the real 128 is 32/32/32/32), SwiGLU MLPs of ratio 3 as in the real model, no
  guidance embedder (klein has none), ``in_channels`` 64: 16 VAE channels patchified 2x2 (the real VAE has 32: 128);
* ``AutoencoderKLFlux2``: four blocks (a spatial scale factor of 8) with 16 latent channels and the VAE's batch norm
  over the patchified channels, whose running mean and variance are set to random values (a fresh BatchNorm's 0 and 1
  would make the normalisation the identity, and a test of it vacuous);
* ``Qwen3ForCausalLM``: 28 layers 64 wide (the real Qwen3-4B has 36 of 2560), so the pipeline's default text layers
  9, 18 and 27 exist and 27 is not the last (whose output is normed): the caption features are ``3 x 64 = 192`` wide,
  the transformer's ``joint_attention_dim``. Every linear layer's input is a multiple of 64 (bitsandbytes' CPU NF4);
* the tiny byte-level BPE ``Qwen2Tokenizer`` with Qwen3's chat template (``enable_thinking=False`` appends the empty
  ``<think>`` block, as the pipeline asks);
* ``FlowMatchEulerDiscreteScheduler`` with dynamic ("exponential") shifting, as FLUX.2 ships it: the pipeline passes
  its own ``mu`` (``compute_empirical_mu``) for every image size and step count.

``is_distilled`` is False (a base model: samples use classifier-free guidance with the empty prompt), so the guided
path of the pipeline is what the tests compare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_lora.tiny import _build, _save_tiny
from lightning_lora.tiny_zimage import make_qwen_tokenizer

__all__ = ["FLUX2_SCHEDULER_CONFIG", "build_tiny_flux2", "save_tiny_flux2"]

#: FLUX.2's ``scheduler/scheduler_config.json`` (klein and dev): dynamic shifting with an exponential time shift; the
#: pipelines always pass ``mu`` (their empirical fit to image tokens and step count), so the base/max values are unused.
FLUX2_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}

_TEXT_WIDTH, _TEXT_LAYERS, _LATENT_CHANNELS = 64, 28, 16


def build_tiny_flux2(seed: int = 0) -> Flux2KleinPipeline:
    """A FLUX.2-klein-shaped ``Flux2KleinPipeline`` with tiny random weights (fp32, every component in ``eval()``); see
    the module docstring. The same ``seed`` gives bit-identical weights in any process."""
    tokenizer = make_qwen_tokenizer()
    transformer = _build(seed, "transformer", lambda: Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,  # 2x2 patchified VAE channels
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=3 * _TEXT_WIDTH,  # three Qwen3 layers' hidden states side by side
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(8, 8, 8, 8),  # (T, H, W, L) axes; sums to attention_head_dim
        rope_theta=2000,
        guidance_embeds=False,  # klein: no distilled guidance input
    ))  # fmt: skip

    def vae_factory() -> AutoencoderKLFlux2:
        vae: Any = AutoencoderKLFlux2(  # Any: diffusers does not type its batch norm (vae.bn)
            block_out_channels=(8, 8, 8, 8),  # 4 blocks -> 3 downsamplings -> scale factor 8
            layers_per_block=1,
            latent_channels=_LATENT_CHANNELS,
            norm_num_groups=4,
            sample_size=64,
        )
        with torch.no_grad():  # random batch-norm statistics, so the normalisation is not the identity
            vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape))
            vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape))
        return vae

    vae = _build(seed, "vae", vae_factory)
    text_encoder = _build(seed, "text_encoder", lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_WIDTH,
        intermediate_size=128,
        num_hidden_layers=_TEXT_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3's
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )))  # fmt: skip
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )


def save_tiny_flux2(folder: Path, seed: int = 0) -> Path:
    """Build the tiny FLUX.2 klein pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.save_tiny_flux`); ``Flux2KleinPipeline.from_pretrained(folder)`` loads it back."""
    wanted = {"family": "flux2", "seed": seed}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_flux2(seed), "FLUX.2 klein")
