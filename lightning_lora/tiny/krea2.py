"""A tiny, randomly initialised Krea 2 pipeline, built offline and deterministically (see :mod:`lightning_lora.tiny`).

Krea 2 (krea/Krea-2-Raw, krea/Krea-2-Turbo) is a ``Krea2Pipeline`` of five components. This module builds each one
from a config with the real model's *structure* and tiny widths:

* ``Krea2Transformer2DModel``: 2 single-stream blocks instead of 28, 64 wide in 4 query heads of 16 and 2 key/value
  heads (grouped-query attention like the real 48 / 12), rotary axes 4 / 6 / 6 (the real 32 / 48 / 48 of 128); the
  text-fusion stage as the real one (2 layer-wise and 2 refiner blocks, here 64 wide in 2 heads) over the real 12
  tapped text-encoder layers; latent patches of 2x2 over 4 latent channels (``in_channels`` 16; the real 16 x 4 = 64);
* ``AutoencoderKLQwenImage``: Qwen-Image's tiny VAE (:func:`lightning_lora.tiny.qwenimage.tiny_qwen_vae`), which Krea 2
  decodes with;
* ``Qwen3VLModel`` (the real text encoder is Qwen3-VL-4B-Instruct, 36 layers of 2560): 36 layers of 64, so that the
  pipeline taps its real layers (2, 5, ..., 35); 4 query heads and 2 key/value heads of 16, multimodal rotary sections
  ``[4, 2, 2]`` (half the head width, as the real ``[24, 20, 20]`` is half of 128); every linear layer's input a
  multiple of 64 so that bitsandbytes' CPU NF4 path accepts it; a 1-block vision tower (never run: Krea 2 reads text
  only). ~1.4 M parameters;
* the tiny byte-level BPE ``Qwen2Tokenizer`` of Qwen-Image (:func:`lightning_lora.tiny.qwenimage.make_qwen_tokenizer`):
  Krea 2 wraps prompts in Qwen-Image's template, and every word of it is one token there as in the real tokenizer, so
  the pipeline's ``prompt_template_encode_start_idx`` (34) and its 5 suffix tokens are right here too;
* ``FlowMatchEulerDiscreteScheduler`` with Krea 2's resolution-dependent shift (:data:`KREA2_SCHEDULER_CONFIG`).

The saved ``model_index.json`` holds the pipeline's own ``text_encoder_select_layers`` (the real taps),
``is_distilled: false`` (the Raw model's schedule) and ``patch_size`` 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLModel

from lightning_lora.families.facts import RandomModels
from lightning_lora.tiny.qwenimage import TINY_QWEN_VAE, make_qwen_tokenizer, tiny_qwen_vae
from lightning_lora.tiny.shared import _build, _save_tiny

__all__ = ["KREA2_SCHEDULER_CONFIG", "RANDOM_KREA2", "build_tiny_krea2", "save_tiny_krea2"]

#: Krea 2's scheduler config, as ``Krea2Pipeline``'s docstring gives it (diffusers 0.42.1): a dynamic ("exponential")
#: shift ``exp(mu)``, ``mu`` linear in the packed image tokens from 0.5 at 256 (256x256 pixels) to 1.15 at 6400
#: (1280x1280), the range of Krea's own sampler (krea-ai/krea-2 ``sampling.py``: ``minres`` 256, ``maxres`` 1280).
KREA2_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 6400,
    "time_shift_type": "exponential",
}


def build_tiny_krea2(seed: int = 0) -> Krea2Pipeline:
    """A Krea-2-shaped ``Krea2Pipeline`` with tiny random weights (fp32, every component in ``eval()``); the same
    ``seed`` gives bit-identical weights in any process. See the module docstring for the shapes."""
    tokenizer = make_qwen_tokenizer()
    width = 64  # the text encoder's hidden size = the transformer's text_hidden_dim
    transformer = _build(seed, "transformer", lambda: Krea2Transformer2DModel(
        in_channels=4 * 4,  # 4 latent channels in 2x2 patches
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        timestep_embed_dim=32,
        text_hidden_dim=width,
        num_text_layers=12,  # the pipeline's 12 taps
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=128,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim; each even
    ))  # fmt: skip
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": 36,  # Qwen3-VL-4B's: the pipeline taps layers 2, 5, ..., 35
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                "rope_theta": 5_000_000.0},  # Qwen3-VL-4B's theta
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": width,
            "patch_size": 2,
            "temporal_patch_size": 1,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        tie_word_embeddings=True,
    )  # fmt: skip
    text_encoder = _build(seed, "text_encoder", lambda: Qwen3VLModel(config))
    return Krea2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**KREA2_SCHEDULER_CONFIG),
        vae=tiny_qwen_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def save_tiny_krea2(folder: Path, seed: int = 0) -> Path:
    """Build the tiny Krea 2 pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`); ``Krea2Pipeline.from_pretrained(folder)`` loads it back."""
    wanted = {"family": "krea2", "seed": seed}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_krea2(seed=seed), "Krea 2")


RANDOM_KREA2 = RandomModels(
    denoiser="krea/Krea-2-Raw",
    tiny_denoiser={  # the tiny pipeline's transformer: 2 blocks, 4 heads of 16 (2 key/value), 4 latent channels
        "in_channels": 16,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "timestep_embed_dim": 32,
        "text_hidden_dim": 64,
        "text_num_attention_heads": 2,
        "text_num_key_value_heads": 2,
        "text_intermediate_size": 128,
        "axes_dims_rope": [4, 6, 6],
    },
    tiny_vae=TINY_QWEN_VAE,  # Krea 2 decodes with Qwen-Image's VAE
    scheduler="FlowMatchEulerDiscreteScheduler",
    scheduler_config=KREA2_SCHEDULER_CONFIG,
)
"""What the benchmark builds for Krea 2 with random weights (:meth:`lightning_lora.families.Krea2.random_models`)."""
